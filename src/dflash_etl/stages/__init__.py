"""One module per stage; each exposes `run(config, run_dir, ...)` and a `python -m` entry."""
