"""The shipped reference model and its synthetic retrieval tasks (see model.py, tasks.py)."""
