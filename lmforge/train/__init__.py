"""Training: setup.py (build and wrap), loop.py (the steps), state.py and checkpoint.py (the run folder), report.py, tracking.py, plots.py and summary.py (what a run reports)."""
