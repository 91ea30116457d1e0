"""Local evidence of a fault: what the workers' heartbeats, processes and output say, each turned
into a verdict or a FaultRecord for decide/.

    heartbeat.py  BeatTracker: hangs and non-finite losses from tierckpt.monitor heartbeats (pure)
    hang.py       HangPolicy: is a silent rank stopped, idle or busy? (pure)
    procwatch.py  the /proc side of hang evidence: a rank's process tree, where it waits
    busyboard.py  BusyBoard: which nodes have a busy silent rank, on the rendezvous store
    rules.py      RuleMonitor: the job file's log rules (pure)
    logwatch.py   LineReader: the workers' output files, line by line
    symptom.py    a worker that died of another's death (its output's last lines)
    wake.py       Waker: a child's exit ends the wait between two polls
"""
