"""The import walls of REDESIGN.md §3.2 (issue 21), held as data: which part of tierckpt may import which.

Every module under ``src/tierckpt`` is parsed with ``ast`` (nothing is imported or run), mapped to
a layer by ``LAYERS``, and each of its ``tierckpt`` imports must land in its own layer or in one
that ``MAY_IMPORT`` lists. Today's crossings are ``DEBTS``, each with its reason; the test fails
on a crossing that is not a debt and on a debt that no longer crosses, so a step that pays a debt
deletes it. The number of import cycles among tierckpt modules may not grow past ``CYCLES``.

What counts as an import: every ``import`` and ``from ... import`` statement anywhere in a module:
at the top, inside functions, and under ``if TYPE_CHECKING:``. A type-only import is still a
dependency of meaning (the importer cannot be read or type-checked without the imported), and
counting it keeps a wall from being crossed by moving an import under the guard. ``from pkg import
name`` is an edge to ``pkg.name`` where that is a module, else to ``pkg``; the parent packages that
Python runs on the way are not edges. Imports by string (``importlib.import_module``, ``python -m``)
are not seen.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

# layer -> module patterns: "a.b" is that module; "a.b.*" is the package a.b and everything under
# it (never a plain module a/b.py: a flat launcher/x.py is not a package x/). The
# longest matching pattern wins, so the flat launcher/ falls back to "launcher".
LAYERS: dict[str, tuple[str, ...]] = {
    "face": ("tierckpt",),
    "entry": ("tierckpt.__main__", "tierckpt.cli"),
    "errors": ("tierckpt.errors",),
    "foundation": ("tierckpt.config", "tierckpt.layout", "tierckpt.workerenv", "tierckpt.record",
                   "tierckpt.policy", "tierckpt.observability", "tierckpt.handles", "tierckpt.guard",
                   "tierckpt._torch_compat", "tierckpt.metrics.*", "tierckpt.monitor",
                   "tierckpt.inprocess", "tierckpt.waitsample"),
    "node": ("tierckpt.node.*",),
    "tiers": ("tierckpt.tiers.*",),
    "engine.core": ("tierckpt.staging", "tierckpt.snapshot", "tierckpt.runtime", "tierckpt.topology"),
    "dcp": ("tierckpt.dcp.*",),
    "data": ("tierckpt.data.*",),
    "engine": ("tierckpt.drain", "tierckpt.localmode", "tierckpt.savepath", "tierckpt.loading",
               "tierckpt.checkpointer"),
    "agent.wire": ("tierckpt.agent.wire.*", "tierckpt.agent.wire", "tierckpt.agent.protocol",
                   "tierckpt.agent.transfer", "tierckpt.agent.client", "tierckpt.agent.tls"),
    "agent.base": ("tierckpt.agent.config", "tierckpt.agent.safefs", "tierckpt.agent.store",
                   "tierckpt.agent.metrics"),
    "agent.state": ("tierckpt.agent.state",),
    "agent.handlers": ("tierckpt.agent.handlers.*", "tierckpt.agent.serve", "tierckpt.agent.receive",
                       "tierckpt.agent.replicate", "tierckpt.agent.protect", "tierckpt.agent.prefetch",
                       "tierckpt.agent.drain", "tierckpt.agent.local", "tierckpt.agent.fetch"),
    "agent.server": ("tierckpt.agent.server",),
    "agent.service": ("tierckpt.agent.service", "tierckpt.agent.__main__", "tierckpt.agent.cli"),
    "agent.face": ("tierckpt.agent",),
    "launcher.jobspec": ("tierckpt.launcher.jobspec",),
    "launcher.leaf": ("tierckpt.launcher.events", "tierckpt.launcher.preflight", "tierckpt.launcher.exiting"),
    "launcher.decide": ("tierckpt.launcher.decide.*",),
    "launcher.control": ("tierckpt.launcher.control.*",),
    "launcher.detect": ("tierckpt.launcher.detect.*",),
    "launcher.workers": ("tierckpt.launcher.workers.*",),
    "launcher.membership": ("tierckpt.launcher.membership.*",),
    "launcher.dataplane": ("tierckpt.launcher.dataplane.*",),
    "launcher.inprocess": ("tierckpt.launcher.inprocess.*",),
    "launcher.supervisor": ("tierckpt.launcher.supervisor.*",),
    "launcher.cli": ("tierckpt.launcher", "tierckpt.launcher.cli"),
    # the launcher's root beside the sub-packages: options.py (RunOptions composes their policies)
    "launcher": ("tierckpt.launcher.*",),
    "adapters": ("tierckpt.integrations.*", "tierckpt.compat.*"),
    "commands": ("tierckpt.commands.*",),
    "demo": ("tierckpt.demo.*",),
    "deploy": ("tierckpt.deploy.*",),
    "bench": ("tierckpt.bench.*",),
    "testing": ("tierckpt.testing.*",),
}

FOUNDATION = frozenset({"errors", "foundation"})
LIBRARY = FOUNDATION | {"node", "tiers", "engine.core", "dcp", "engine", "face", "data"}
AGENT = frozenset(layer for layer in LAYERS if layer.startswith("agent."))
_WINGS = frozenset({"launcher.detect", "launcher.workers", "launcher.membership", "launcher.dataplane"})
LAUNCHER = frozenset(layer for layer in LAYERS if layer.startswith("launcher"))
_BELOW_WINGS = FOUNDATION | {"launcher.jobspec", "launcher.decide", "launcher.control", "launcher.leaf"}

# layer -> the other layers it may import (its own is always allowed; cycles are counted apart)
MAY_IMPORT: dict[str, frozenset[str]] = {
    "errors": frozenset(),
    "foundation": frozenset({"errors"}),
    "node": FOUNDATION,
    "tiers": FOUNDATION | {"node"},
    "engine.core": FOUNDATION | {"node", "tiers"},
    "dcp": FOUNDATION | {"node", "tiers", "engine.core"},  # never savepath, loading, checkpointer
    "engine": FOUNDATION | {"node", "tiers", "engine.core", "dcp"},
    "data": FOUNDATION,  # the data pipeline's position: a library part beside the engine, never the wings
    "face": LIBRARY,
    "agent.wire": FOUNDATION | {"node", "tiers"},
    "agent.base": FOUNDATION | {"node", "tiers", "agent.wire"},
    "agent.state": FOUNDATION | {"node", "tiers", "agent.wire", "agent.base"},
    "agent.handlers": FOUNDATION | {"node", "tiers", "agent.wire", "agent.base", "agent.state"},
    "agent.server": FOUNDATION | {"node", "agent.wire"},
    "agent.service": FOUNDATION | {"node", "tiers"} | AGENT,
    "agent.face": FOUNDATION | {"node", "tiers"} | AGENT,
    "launcher.jobspec": frozenset({"errors"}),
    "launcher.leaf": FOUNDATION,
    "launcher.decide": frozenset({"errors", "launcher.jobspec"}),  # and no torch, no clock: below
    "launcher.control": FOUNDATION | {"launcher.jobspec", "launcher.decide"},
    # detect/, workers/, membership/ and dataplane/ never import each other
    "launcher.detect": _BELOW_WINGS,
    "launcher.workers": _BELOW_WINGS,
    "launcher.membership": _BELOW_WINGS,
    "launcher.dataplane": _BELOW_WINGS | {"agent.face", "node", "tiers"},
    "launcher.inprocess": _BELOW_WINGS | {"launcher.workers"},
    "launcher.supervisor": FOUNDATION | {"agent.face", "node", "tiers"} | (LAUNCHER - {"launcher.cli"}),
    "launcher.cli": FOUNDATION | {"agent.face", "node", "tiers"} | LAUNCHER,
    "launcher": FOUNDATION | {"agent.face", "node", "tiers"} | (LAUNCHER - {"launcher.cli"}),
    "adapters": LIBRARY,
    "commands": LIBRARY | {"agent.face", "launcher.cli", "launcher.jobspec", "demo", "deploy"},
    "demo": LIBRARY | {"testing"},
    "deploy": FOUNDATION | {"launcher.jobspec", "launcher.cli"},
    "testing": LIBRARY | AGENT | LAUNCHER,
    "bench": LIBRARY | AGENT | LAUNCHER | {"testing"},
    "entry": frozenset(LAYERS),
}

# (importer, imported) -> why it crosses a wall today; each step of §3.7 deletes what it pays
DEBTS: dict[tuple[str, str], str] = {
    ("tierckpt.inprocess", "tierckpt.dcp.plancache"):
        "resilient clears DCP's plan cache before each generation (and so loads the whole dcp/ package)",
    ("tierckpt.node.budget", "tierckpt.tiers.peer"):
        "local_request stays in tiers/peer.py while launcher/agent.py imports it there (node/sock.py takes it after step 4)",
    ("tierckpt.launcher.decide.offenders", "tierckpt.launcher.membership.change"):
        "MEMBERSHIP_CHANGE, a claim's reason, is spelled in membership.py until decide/faults.Reason (step 5b)",
    ("tierckpt.launcher.membership.ranks", "tierckpt.launcher.supervisor.runstate"):
        "STATE_DIR is named in supervisor/runstate.py until layout.py names the launcher's state dir (§3.1)",
    ("tierckpt.launcher.membership.rounds", "tierckpt.launcher.options"):
        "Rounds reads the membership's options (elastic, avoid, restart policy, node timeout) from RunOptions "
        "until options.py's parts move below the wings",
    ("tierckpt.launcher.cli", "tierckpt.agent.config"): "AgentConfig taken past the agent's face (tierckpt.agent)",
}

# strongly connected components of more than one module in the import graph (see test_cycles)
CYCLES = 0


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted((SRC / "tierckpt").rglob("*.py"))}


def layer_of(module: str) -> str | None:
    best: tuple[int, str] | None = None
    is_package = MODULES[module].name == "__init__.py"
    for layer, patterns in LAYERS.items():
        for pattern in patterns:
            stem = pattern.removesuffix(".*")
            if pattern.endswith(".*"):
                hit = module.startswith(stem + ".") or (module == stem and is_package)
            else:
                hit = module == stem
            if hit and (best is None or len(stem) > best[0]):
                best = (len(stem), layer)
    return None if best is None else best[1]


def imports_of(module: str) -> set[str]:
    """The tierckpt modules ``module`` names in an import statement, wherever the statement is."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "tierckpt")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "tierckpt":
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.add(sub if sub in MODULES else source)
    found.discard(module)
    return found


GRAPH: dict[str, set[str]] = {m: imports_of(m) for m in MODULES}


def cycles() -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v] & MODULES.keys()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return sorted(found)


def crossings() -> set[tuple[str, str]]:
    out = set()
    for importer, imported in GRAPH.items():
        mine = layer_of(importer)
        assert mine is not None
        for target in imported:
            theirs = layer_of(target) if target in MODULES else None
            if theirs is not None and theirs != mine and theirs not in MAY_IMPORT[mine]:
                out.add((importer, target))
    return out


def test_every_module_has_a_layer() -> None:
    assert set(MAY_IMPORT) == set(LAYERS)
    unmapped = sorted(m for m in MODULES if layer_of(m) is None)
    assert not unmapped, f"map these modules to a layer in LAYERS: {unmapped}"
    unknown = sorted({t for targets in GRAPH.values() for t in targets} - MODULES.keys())
    assert not unknown, f"imports of tierckpt modules that do not exist: {unknown}"


def test_imports_respect_the_layers() -> None:
    found = crossings()
    new = sorted(found - DEBTS.keys())
    paid = sorted(DEBTS.keys() - found)
    assert not new, "imports that cross a wall (REDESIGN §3.2): " + "; ".join(
        f"{a} ({layer_of(a)}) -> {b} ({layer_of(b)})" for a, b in new)
    assert not paid, f"debts paid: delete them from DEBTS: {paid}"


def test_cycles_do_not_grow() -> None:
    found = cycles()
    largest = max(MODULES.values(), key=lambda p: len(p.read_text().splitlines()))
    print(f"\nmodules {len(MODULES)}; largest file {largest.relative_to(SRC)} "
          f"({len(largest.read_text().splitlines())} lines); import cycles {len(found)} (recorded {CYCLES})")
    for component in found:
        print("  cycle:", " ".join(component))
    assert len(found) <= CYCLES, f"new import cycles: {len(found)} > {CYCLES}: {found}"


def test_decide_is_pure() -> None:
    """decide/ gives every node the same answer from the same history: no torch, no clock read."""
    for module in sorted(m for m in MODULES if layer_of(m) == "launcher.decide"):
        for node in ast.walk(ast.parse(MODULES[module].read_text())):
            if isinstance(node, ast.Import):
                assert not any(a.name.split(".")[0] == "torch" for a in node.names), f"{module} imports torch"
            elif isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] != "torch", f"{module} imports torch"
                assert not (node.module == "time" and any(a.name in _CLOCKS for a in node.names)), \
                    f"{module} reads the clock"
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "time":
                assert node.attr not in _CLOCKS, f"{module} reads the clock"


_CLOCKS = frozenset({"time", "monotonic", "time_ns", "monotonic_ns", "perf_counter"})
