"""Pure decisions of ``tierckpt run``: no store, no torch, no clock read (time is passed in), so
the same evidence and history give the same answer on every node.

    faults.py     FaultRecord (one detector's typed evidence), Kind, Reason
    diagnose.py   diagnose(evidence, round) -> Diagnosis: the one cause and the node to blame
    escalation.py EscalationPolicy.decide: restart, back off or give up (+ FULL_RESTART_EXIT)
    offenders.py  OffenderPolicy: which node failed too often to keep its place
"""
