"""Training: distributed setup, optimizer/schedule, checkpoints, metrics and the loop."""
