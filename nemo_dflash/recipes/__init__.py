"""Command-line entry points: train, regenerate, evaluate, export, demo."""
