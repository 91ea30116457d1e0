"""The agent's side of ``tierckpt.resilient``: restarts inside the workers' processes.

    restarts.py  InProcessRestarts: which faults restart in-process, the request, the events
    replace.py   a dead rank replaced alone (route, tag) and the agent-hosted store (StoreHost)
"""
