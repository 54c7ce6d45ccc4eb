"""Training: optimiser and schedule, train step and loop, checkpoints, metrics, evaluation."""
