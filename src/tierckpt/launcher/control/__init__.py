"""The job's control plane on the rendezvous store: the keys and their round trips, no policy.

    keys.py        every key on the store, once: the control plane's schema
    store.py       connect_client, peek (a read that never blocks), store_errors, timeout_error
    jobcontrol.py  JobControl: generation, claims, stop barrier, master, agents, done
    claimwatch.py  ClaimWatch: a thread blocked in the store's wait, woken by another node's claim
    liveness.py    Liveness: which agents stopped beating, from one watcher's reads
    resume.py      the non-finite-loss bound's store half (offer, agreed, mark_past, passed)
"""
