"""Training: setup.py builds and wraps the model (the one ordered list), loop.py runs the steps;
measurements.py, report.py and summary.py are what a run reports (the run folder itself is
lmforge/runs/)."""
