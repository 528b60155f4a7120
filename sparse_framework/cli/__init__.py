"""The `sparse-framework` command: main.py dispatches to the sub-commands (engine.py: generate,
bench, plan, run; serve.py; eval.py); tables.py draws the run, plan and plugins tables;
config_docs.py renders docs/config.md."""
