"""The composition root of ``tierckpt run``: the only code that knows every part of the launcher.

    torch_agent.py  TierckptAgent (torch's LocalElasticAgent): the monitor loop and the recovery paths
    runstate.py     what survives a full job restart: the restart-state file beside the memory tier
"""
