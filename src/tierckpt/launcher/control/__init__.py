"""The job's control plane on the rendezvous store: the keys and their round trips, no policy.

    jobcontrol.py  JobControl: generation, claims, stop barrier, master, agents, done
    claimwatch.py  ClaimWatch: a thread blocked in the store's wait, woken by another node's claim
    liveness.py    Liveness: which agents stopped beating, from one watcher's reads
    resume.py      the non-finite-loss bound's store half (offer, agreed, mark_past, passed)
"""
