"""tierckpt run: the resilient launcher (a torchrun drop-in with HyperPod-style run policies).

The pure parts live in small modules that the I/O shell drives: ``jobspec`` (the job file),
``detect.rules`` (log-rule evaluation) and ``decide.escalation`` (restart decisions).
"""
