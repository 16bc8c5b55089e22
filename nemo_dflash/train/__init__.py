"""Training: distributed setup, optimizer/schedule, checkpoints, metrics and the loop, and the device's
memory between phases (`device`: cached GPU memory given back, free memory reported, host threads capped)."""
