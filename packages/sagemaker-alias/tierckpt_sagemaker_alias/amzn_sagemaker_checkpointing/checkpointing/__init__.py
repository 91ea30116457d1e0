"""tierckpt alias: the checkpointing modules."""
