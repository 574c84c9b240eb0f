"""Training a DFlash drafter: the blocks and their loss, the trainer, its checkpoints and the
acceptance-length evaluation. The train stage is the shell around them; nothing here imports
it."""
