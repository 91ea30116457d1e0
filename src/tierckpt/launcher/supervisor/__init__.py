"""The composition root of ``tierckpt run``: the only code that knows every part of the launcher.

    loop.py         Supervisor: the monitor loop and the recovery paths, applied with the parts
    torch_agent.py  TierckptAgent (torch's LocalElasticAgent): torch's hooks, each delegating to the Supervisor
    runstate.py     what survives a full job restart: the restart-state file beside the memory tier
"""
