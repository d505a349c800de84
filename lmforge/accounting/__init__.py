"""Cost accounting as pure functions of a config: FLOPs (shapes.py) and hardware peaks (hardware.py).
Nothing here imports the trainer; the trainer calls in here for every cost figure it prints."""
