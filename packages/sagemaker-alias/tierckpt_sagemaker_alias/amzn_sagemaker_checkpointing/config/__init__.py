"""tierckpt alias: the configuration modules."""
