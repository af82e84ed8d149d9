"""One training run: building it, the workers, the loop, checkpoints, resume, records and its timeline."""
