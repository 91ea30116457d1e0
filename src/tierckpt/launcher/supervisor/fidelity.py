"""What ``hyperpodrun`` and the HyperPod operator's add-on give beside recovery, for one agent:
the HTTP API (``--server-port``), the pre/post-train scripts, the per-namespace log file.

Call order (the supervisor, loop.py): ``Fidelity(opts, events)`` in its constructor, before the
first rendezvous (the API answers ``INIT`` while the node waits, and its status follows every
event from then on; the log file receives every record); ``pre_train(generation, node)`` in its
``start_workers`` hook, before each (re)start of the processes; ``post_train(generation, node)``
once the workers succeeded, before the ``exit`` event; ``close()`` before ``Events.close``.
A failing script raises ``TrainScriptError`` into the loop, which ends the run (exit 70).
"""

from __future__ import annotations

import logging
from typing import Any

from tierckpt import workerenv
from tierckpt.launcher.agentapi import AgentApi, AgentStatus
from tierckpt.launcher.events import Events
from tierckpt.launcher.options import RunOptions
from tierckpt.observability import ROOT, namespace_log

__all__ = ["Fidelity"]


class Fidelity:
    """The API server, the scripts and the namespace log of one agent; see the module doc."""

    def __init__(self, opts: RunOptions, events: Events) -> None:
        self.opts = opts
        self.events = events
        self.status = AgentStatus()
        events.listen(self.status.on_event)
        self._log: logging.Handler | None = None
        if opts.log_dir is not None and opts.namespace:
            self._log = namespace_log(opts.namespace, opts.log_dir)
            root = logging.getLogger(ROOT)
            if root.getEffectiveLevel() > logging.INFO:
                root.setLevel(logging.INFO)
            root.addHandler(self._log)
        self.api = AgentApi.start(opts.api, self.status)
        if self.api is not None:  # written once the node's index is known, as every event
            host, port = self.api.address
            events.emit("api", generation=0, host=host, port=port)

    def _env(self, generation: int, node: int) -> dict[str, str]:
        env = {workerenv.JOB_RESTART_COUNT: str(generation), workerenv.GENERATION: str(generation),
               "GROUP_RANK": str(node)}
        for key, value in ((workerenv.NAMESPACE, self.opts.namespace), (workerenv.MEMORY_DIR, self.opts.memory_dir),
                           (workerenv.DURABLE_URL, self.opts.durable_url)):
            if value:
                env[key] = value
        return env

    def pre_train(self, generation: int, node: int) -> None:
        self._script("pre_train", generation, node)

    def post_train(self, generation: int, node: int) -> None:
        self._script("post_train", generation, node)

    def _script(self, phase: str, generation: int, node: int) -> None:
        scripts = self.opts.scripts
        run: Any = scripts.pre_train if phase == "pre_train" else scripts.post_train
        seconds = run(self._env(generation, node))
        if seconds is not None:
            self.events.emit("script", generation=generation, phase=phase, seconds=round(seconds, 3),
                             argv=list(scripts.pre if phase == "pre_train" else scripts.post))

    def close(self) -> None:
        if self.api is not None:
            self.api.close()
            self.api = None
        if self._log is not None:
            logging.getLogger(ROOT).removeHandler(self._log)
            self._log.close()
            self._log = None
