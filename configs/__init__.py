"""Experiment configs: `get_config()` per file; sweeps via `get_sweep()`."""
