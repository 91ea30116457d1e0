"""Who is in the job: membership changes, stable ranks, spares, the first round's seats.

    change.py            Change, Elastic, shrink, missing_nodes: what a membership change is (pure)
    ranks.py             a node keeps its group rank across rounds (its memory holds that rank's files)
    spares.py            SpareGate: hot spares wait outside torch's round
    seats.py             the first round's seats: which starting agents are the first MAX nodes
    snooze.py            ScaleUpSnooze: no scale-up right after a scale-down (pure)
    avoid.py             RepeatOffenders: the job-store shell around decide/offenders.py
    rdzvwait.py          rendezvous progress while an agent waits for the others
    rounds.py            Rounds, Round: one agent's side of every round (gate, stable rank, regroup,
                         offenders kept out and avoided, arrivals)
"""
