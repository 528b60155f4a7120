"""`sparse-framework eval`: experiment files, the sweep runner, tables, plots and pages."""
