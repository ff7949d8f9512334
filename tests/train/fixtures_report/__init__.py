"""Synthetic run directories for the training-health report tests (see `synth.py`)."""
