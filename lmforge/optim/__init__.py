"""The optimizers (adamw.py, adam.py, sgd.py, adagrad.py, rmsprop.py, lion.py; built by name in
build.py), the learning-rate schedule (schedule.py) and gradient clipping (clip.py)."""
