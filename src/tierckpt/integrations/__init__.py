"""Framework integrations; each module imports its framework lazily, on use.

    tierckpt.integrations.lightning    TierckptCheckpointIO: Lightning's CheckpointIO over the tiers
    tierckpt.integrations.ray          ray.train.Checkpoint objects for tierckpt's durable steps
    tierckpt.integrations.torchtitan   torchtitan's CheckpointManager saving through the DCP plug-ins
"""
