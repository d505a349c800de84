"""AdamW (adamw.py), the learning-rate schedule (schedule.py) and gradient clipping (clip.py)."""
