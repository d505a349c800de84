"""The training loop (trainer.py), checkpoints (checkpoint.py) and run reports (report.py)."""
