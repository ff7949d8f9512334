"""Training: the DFlash drafter, data stream, loss, loop, checkpoints, eval, export and report."""
