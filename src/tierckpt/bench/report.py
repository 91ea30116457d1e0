"""Turn merged benchmark figures into medians, ratios, goal verdicts and a printed table.

Ratios are time ratios within the same run: ``t/memcpy`` divides by the median of
``np.copyto`` (one thread per rank) of the same bytes, the memcpy anchor of the
environment baseline; ``t/DCP`` divides by DCP's figure of the same kind (a save by
FileSystemWriter's save, a load by FileSystemReader's load, a blocking time by
``async_save``'s blocking time).
"""

from __future__ import annotations

from typing import Any

from tierckpt.bench.measure import median

__all__ = ["ROWS", "format_report", "summarise"]

# (method, figure, label); the table's rows in print order
ROWS = (
    ("memcpy_numpy", "copy", "memcpy: np.copyto into preallocated, 1 thread/rank"),
    ("memcpy_torch", "copy", "memcpy: torch copy_ into preallocated"),
    ("torch_save", "save", "torch.save -> /dev/shm"),
    ("torch_save", "load", "torch.load <- /dev/shm"),
    ("dcp_fs", "save", "DCP FileSystemWriter -> /dev/shm"),
    ("dcp_fs", "load", "DCP FileSystemReader <- /dev/shm"),
    ("dcp_async", "blocking", "DCP async_save (thread): call blocks"),
    ("dcp_async", "save", "DCP async_save (thread): until done"),
    ("tierckpt", "blocking", "tierckpt Checkpointer.save: call blocks"),
    ("tierckpt", "save", "tierckpt save to memory: until result()"),
    ("tierckpt", "load", "tierckpt Checkpointer.load from memory"),
    ("training", "copy", "loop: torch copy_ of the state (anchor)"),
    ("training", "step_nosave", "loop: a step, no save"),
    ("training", "step_blocking", "loop: a step + blocking save"),
    ("training", "step_overlap", "loop: a step + overlapped save"),
    ("training", "stall_blocking", "loop: blocking save, stall (call)"),
    ("training", "stall_overlap", "loop: overlapped save, stall (call + fence)"),
    ("training", "fence_overlap", "loop: overlapped save, of which the fence"),
    ("first_saves", "first", "first save of a Checkpointer (call)"),
    ("first_saves", "reserve", "background slot reservation after it"),
    ("first_saves", "later", "saves 2-5 (call), median"),
    ("first_saves", "later_max", "saves 2-5 (call), slowest"),
    ("tierckpt_dcp", "save", "tierckpt dcp.save + TieredStorageWriter"),
    ("tierckpt_dcp", "load", "tierckpt dcp.load + TieredStorageReader"),
    ("paired", "copy", "rounds: torch copy_ into preallocated"),
    ("paired", "blocking", "rounds: Checkpointer.save call blocks"),
    ("paired", "save", "rounds: Checkpointer.save until result()"),
    ("paired", "dcp_save", "rounds: DCP FileSystemWriter -> /dev/shm"),
    ("paired", "load", "rounds: Checkpointer.load from memory"),
    ("paired", "dcp_load", "rounds: DCP FileSystemReader <- /dev/shm"),
)
_MEMCPY = "memcpy_numpy.copy"
_DCP = {"copy": "dcp_fs.save", "save": "dcp_fs.save", "load": "dcp_fs.load", "blocking": "dcp_async.blocking"}
_LEAK_FROM = 5  # save number the leak growth is measured from (earlier saves warm up)


def summarise(merged: dict[str, Any], state_bytes: int, leak_bytes: int) -> dict[str, Any]:
    """Per figure: median, GB/s, ratios, peak extra anonymous RSS; the goals; the leak check."""
    figures: dict[str, dict[str, Any]] = {}
    for method, figs in merged["methods"].items():
        for fig, raw in figs.items():
            rss = [v for v in raw["rss_runs"] if v is not None]
            med = median(raw["runs_s"])
            figures[f"{method}.{fig}"] = {
                "median_s": med,
                "best_s": min(raw["runs_s"]),
                "runs_s": raw["runs_s"],
                "warmup_s": raw["warmup_s"],
                "gb_per_s": state_bytes / med / 1e9 if med > 0 else None,
                "rss_extra_bytes": max(rss) if rss else None,
                "rss_runs": raw["rss_runs"],
                "rss_source": _source(raw["rss_source"]),
            }
    for key, f in figures.items():
        f["t_over_memcpy"] = _ratio(f, figures.get(_MEMCPY))
        f["t_over_dcp"] = _ratio(f, figures.get(_DCP.get(key.split(".")[1], "")))
    leak = _leak(merged["leak"], leak_bytes)
    goals = _goals(figures, merged["checks"], leak, state_bytes)
    return {"figures": figures, "checks": merged["checks"], "failures": merged["failures"], "leak": leak,
            "goals": goals}


def _source(sources: list[str | None]) -> str | None:
    known = [x for x in sources if x is not None]
    return None if not known else ("sampled" if "sampled" in known else "hwm")


def _ratio(f: dict[str, Any], ref: dict[str, Any] | None) -> float | None:
    if ref is None or ref["median_s"] <= 0:
        return None
    return float(f["median_s"] / ref["median_s"])


def _leak(series: dict[str, list[int]] | None, leak_bytes: int) -> dict[str, Any] | None:
    if not series or not series["tierckpt"]:
        return None
    saves = len(series["tierckpt"])
    start = min(_LEAK_FROM, saves)
    growth = {name: anon[-1] - anon[start - 1] for name, anon in series.items()}
    return {
        "saves": saves, "from_save": start, "state_bytes": leak_bytes,
        "growth_bytes": growth["tierckpt"], "dcp_fs_growth_bytes": growth.get("dcp_fs"),
        "rss_anon_after_each": series["tierckpt"], "dcp_fs_rss_anon_after_each": series.get("dcp_fs"),
    }


def _goal(name: str, value: float | None, limit: float, *, at_least: bool, detail: str,
          unit: str = "x") -> dict[str, Any]:
    ok = None if value is None else (value >= limit if at_least else value <= limit)
    return {"goal": name, "value": value, "unit": unit, "limit": limit, "at_least": at_least,
            "pass": ok, "detail": detail}


def _goals(figs: dict[str, Any], checks: dict[str, bool], leak: dict[str, Any] | None,
           state_bytes: int) -> list[dict[str, Any]]:
    def t(key: str) -> float | None:
        return figs[key]["median_s"] if key in figs else None

    def div(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b <= 0 else a / b

    if "paired.blocking" in figs:  # rounds timed back to back: the verdicts come from these
        return _paired_goals(figs, checks, leak, state_bytes, t, div)
    goals = [
        _goal("async save blocking <= 1.3 x memcpy", div(t("tierckpt.blocking"), t(_MEMCPY)), 1.3,
              at_least=False, detail="Checkpointer.save call / np.copyto; vs torch copy_: "
              + _fmt_x(div(t("tierckpt.blocking"), t("memcpy_torch.copy")))),
        _goal("sync save to memory >= 3 x faster than DCP FileSystemWriter",
              div(t("dcp_fs.save"), t("tierckpt.save")), 3.0, at_least=True,
              detail="DCP save / (Checkpointer.save + result()); via the DCP plug-in: "
              + _fmt_x(div(t("dcp_fs.save"), t("tierckpt_dcp.save")))),
        _goal("load from memory >= 3 x faster than DCP FileSystemReader",
              div(t("dcp_fs.load"), t("tierckpt.load")), 3.0, at_least=True,
              detail="DCP load / Checkpointer.load; via the DCP plug-in: "
              + _fmt_x(div(t("dcp_fs.load"), t("tierckpt_dcp.load")))),
    ]
    return goals + _common_goals(figs, checks, leak, state_bytes)


def _round_ratio(figs: dict[str, Any], num: str, den: str) -> float | None:
    """Median over rounds of ``num / den`` (both timed in the same round)."""
    if num not in figs or den not in figs:
        return None
    pairs = [a / b for a, b in zip(figs[num]["runs_s"], figs[den]["runs_s"], strict=True) if b > 0]
    return median(pairs) if pairs else None


def _paired_goals(figs: dict[str, Any], checks: dict[str, bool], leak: dict[str, Any] | None,
                  state_bytes: int, t: Any, div: Any) -> list[dict[str, Any]]:
    n = len(figs["paired.blocking"]["runs_s"])
    goals = [
        _goal("async save blocking <= 1.3 x memcpy", _round_ratio(figs, "paired.blocking", "paired.copy"), 1.3,
              at_least=False, detail=f"median of {n} rounds of Checkpointer.save call / torch copy_ of the same "
              f"bytes, timed back to back; separate runs: {_fmt_x(div(t('tierckpt.blocking'), t('memcpy_torch.copy')))}"),
        _goal("sync save to memory >= 3 x faster than DCP FileSystemWriter",
              _round_ratio(figs, "paired.dcp_save", "paired.save"), 3.0, at_least=True,
              detail=f"median of {n} rounds of DCP save / (Checkpointer.save + result()); separate runs: "
              + _fmt_x(div(t("dcp_fs.save"), t("tierckpt.save")))),
        _goal("load from memory >= 3 x faster than DCP FileSystemReader",
              _round_ratio(figs, "paired.dcp_load", "paired.load"), 3.0, at_least=True,
              detail=f"median of {n} rounds of DCP load / Checkpointer.load; separate runs: "
              + _fmt_x(div(t("dcp_fs.load"), t("tierckpt.load")))),
        _goal("load from memory, verified <= 1.5 x memcpy", _round_ratio(figs, "paired.load", "paired.copy"), 1.5,
              at_least=False, detail=f"median of {n} rounds of Checkpointer.load / torch copy_ of the same bytes"),
    ]
    return goals + _common_goals(figs, checks, leak, state_bytes)


def _common_goals(figs: dict[str, Any], checks: dict[str, bool], leak: dict[str, Any] | None,
                  state_bytes: int) -> list[dict[str, Any]]:
    goals: list[dict[str, Any]] = []
    rss = [(figs[k]["rss_extra_bytes"], k) for k in ("tierckpt.save", "tierckpt_dcp.save")
           if k in figs and figs[k]["rss_extra_bytes"] is not None]
    worst = max(rss) if rss else None
    goals.append(_goal(
        "extra anonymous RSS during saves <= 10 % of the state",
        None if worst is None else worst[0] / state_bytes, 0.10, at_least=False, unit="%",
        detail="" if worst is None else f"worst: {worst[1]}, {worst[0] / 2**20:.1f} MiB",
    ))
    goals += _overlap_goals(figs, checks)
    if "tierckpt.snapshot" in checks:
        ok = checks["tierckpt.snapshot"]
        goals.append({"goal": "save is a snapshot (tensors changed after save returns are not saved)",
                      "value": None, "unit": None, "limit": None, "at_least": None, "pass": ok, "detail": ""})
    if leak is not None:
        goals.append(_goal(
            f"anonymous RSS flat over {leak['saves']} saves (growth from save {leak['from_save']} "
            "<= 1 % of the state)",
            leak["growth_bytes"] / leak["state_bytes"], 0.01, at_least=False, unit="%",
            detail=f"{leak['growth_bytes'] / 2**20:+.2f} MiB over a {leak['state_bytes'] / 2**20:.0f} MiB state; "
            f"DCP FileSystemWriter, same saves: {leak['dcp_fs_growth_bytes'] / 2**20:+.2f} MiB",
        ))
    return goals


def _overlap_goals(figs: dict[str, Any], checks: dict[str, bool]) -> list[dict[str, Any]]:
    """Issue 9's overlapped-save and cold-save goals; ratios per round, then the median."""
    goals: list[dict[str, Any]] = []
    if "training.stall_overlap" in figs:
        r = _round_ratio
        goals.append(_goal(
            "overlapped save's visible stall <= 0.1 x memcpy", r(figs, "training.stall_overlap", "training.copy"),
            0.1, at_least=False,
            detail=f"save call + fence wait / torch copy_ of the state; blocking save: "
            f"{_fmt_x(r(figs, 'training.stall_blocking', 'training.copy'))}; a step with a save every step vs none: "
            f"overlapped {_fmt_x(r(figs, 'training.step_overlap', 'training.step_nosave'))}, blocking "
            f"{_fmt_x(r(figs, 'training.step_blocking', 'training.step_nosave'))}",
        ))
    if "training.overlap_snapshot" in checks:
        goals.append({"goal": "overlapped save is a snapshot (the optimizer step right after it is not saved)",
                      "value": None, "unit": None, "limit": None, "at_least": None,
                      "pass": checks["training.overlap_snapshot"], "detail": ""})
    if "first_saves.later_max" in figs:
        goals.append(_goal(
            "no save after the first slower than the rest (slowest <= 1.5 x median of saves 2-5)",
            _round_ratio(figs, "first_saves.later_max", "first_saves.later"), 1.5, at_least=False,
            detail=f"first save / later median: {_fmt_x(_round_ratio(figs, 'first_saves.first', 'first_saves.later'))}",
        ))
    return goals


def _fmt_value(v: float, unit: str) -> str:
    return f"{100 * v:.2f} %" if unit == "%" else f"{v:.2f}x"


def _fmt_x(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def format_report(doc: dict[str, Any]) -> str:
    """The printed table: header, one row per figure, the goals."""
    cfg, env = doc["config"], doc["env"]
    lines = [
        f"tierckpt bench (local): {cfg['state_bytes'] / 2**30:.3f} GiB float32 in {cfg['tensors']} tensors, "
        f"world size {cfg['world_size']}, median of {cfg['repeats']} after warm-up (1 run; tierckpt: 2)",
        f"torch {env['torch']}, {env['torch_threads']} torch thread(s) per rank, {env['cpus']} CPUs; "
        f"load average {_load(env['load_average_start'])} at start, {_load(env['load_average_end'])} at end",
        "",
        f"{'figure':<52} {'median s':>9} {'best s':>8} {'GB/s':>7} {'t/memcpy':>9} {'t/DCP':>7} "
        f"{'peak extra anon RSS':>22}",
    ]
    state = cfg["state_bytes"]
    for method, fig, label in ROWS:
        f = doc["figures"].get(f"{method}.{fig}")
        if f is None:
            continue
        rss = f["rss_extra_bytes"]
        mark = "*" if f["rss_source"] == "sampled" else " "
        rss_s = "n/a " if rss is None else f"{rss / 2**20:.1f} MiB ({100 * rss / state:.1f}%){mark}"
        lines.append(
            f"{label:<52} {f['median_s']:>9.4f} {f['best_s']:>8.4f} {_num(f['gb_per_s'], 7, 2)} "
            f"{_num(f['t_over_memcpy'], 9, 2)} {_num(f['t_over_dcp'], 7, 2)} {rss_s:>22}"
        )
    for method, why in doc["failures"].items():
        lines.append(f"FAILED {method}: a round trip gave back different bytes: {why}")
    lines += [
        "",
        "GB/s from the median; t/memcpy, t/DCP: median time over the memcpy (np.copyto) median and over",
        "DCP's median of the same kind (save, load, blocking).",
        "RSS: peak anonymous RSS above the start of the phase, kernel high-water mark; * = sampled every",
        "2 ms instead, because the phase unmapped shared memory (the high-water mark would count it).",
        "",
        "goals (ratios measured in this run)",
    ]
    for g in doc["goals"]:
        verdict = {True: "PASS", False: "MISS", None: "n/a "}[g["pass"]]
        value = "" if g["value"] is None else ": " + _fmt_value(g["value"], g["unit"])
        detail = f" ({g['detail']})" if g["detail"] else ""
        lines.append(f"  {verdict}  {g['goal']}{value}{detail}")
    return "\n".join(lines)


def _num(v: float | None, width: int, digits: int) -> str:
    return f"{'n/a':>{width}}" if v is None else f"{v:>{width}.{digits}f}"


def _load(avg: list[float]) -> str:
    return " ".join(f"{x:.2f}" for x in avg)
