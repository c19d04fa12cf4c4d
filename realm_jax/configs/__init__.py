"""Configs: Python files with `get_config(arg)` returning an `ml_collections.ConfigDict`."""
