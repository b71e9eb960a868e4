"""A training run: the Trainer (trainer.py, start reading there) and the parts it is built from, one concern a
file: the step, timing, the learning-rate schedule, validation, checkpoints, stopping, progress lines, the optional
profiling tools, what the run prints and the metrics it writes."""
