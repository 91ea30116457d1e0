"""One generation's worker processes: how they start, warm, and stop with their agent.

    launch.py    the workers' environment and torch's process context around them
    warm.py      StandbyPool: standby interpreters that become workers (python -m tierckpt.launcher.workers.standby)
    standby.py   the standby interpreter itself: torch imported ahead, then it becomes a worker
    reaper.py    Reaper: workers stop within a second when their agent dies
    watchdog.py  torch's file-timer watchdog, minus the agent's suicide
"""
