"""What the local benchmark measures with: the state dict, round-trip checks, peak anonymous RSS.

Peak anonymous RSS of a phase comes from the kernel's high-water mark. When the phase
starts, free heap pages go back to the kernel (``malloc_trim``, so reused memory still shows
as an increase), ``RssAnon`` is read and ``VmHWM`` reset (``echo 5 > /proc/self/clear_refs``);
when it ends, the peak anonymous increase is ``VmHWM - RssFile - RssShmem - RssAnon(start)``. ``VmHWM``
counts shared-memory pages too; a shared-memory slot that a save maps stays mapped
afterwards, so subtracting the end-of-phase ``RssShmem`` leaves the anonymous part. A phase
that maps shared memory and unmaps it again (a load reading a slot) would be overcounted
that way, so a thread samples ``RssAnon`` and ``RssShmem`` every 2 ms during the phase, and
when ``RssShmem`` fell by the end the sampled ``RssAnon`` peak is reported instead.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import threading
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "RssProbe",
    "StateSpec",
    "VerificationError",
    "build_state",
    "check_equal",
    "cpu_pressure",
    "empty_like_state",
    "load_average",
    "local_tensors",
    "median",
    "rss_anon",
    "trim_heap",
]

_COLS = 1024  # each tensor is (rows, 1024) float32; rows split evenly across ranks
_STATUS_FIELDS = ("RssAnon", "RssFile", "RssShmem", "VmHWM")
_SHMEM_SLACK = 1 << 20  # shared memory unmapped during a phase beyond this: use the sampled peak


class VerificationError(RuntimeError):
    """A benchmarked round trip did not give back the bytes it was given."""


@dataclass(frozen=True)
class StateSpec:
    """The benchmark's state dict: ``tensors`` float32 tensors of ``rows`` x 1024, sharded by rows."""

    tensors: int
    rows: int

    @classmethod
    def for_size(cls, total_bytes: int, tensors: int, world_size: int) -> StateSpec:
        rows = total_bytes // 4 // tensors // _COLS
        rows -= rows % world_size
        if tensors < 1 or rows < world_size:
            raise ValueError(
                f"{total_bytes} bytes in {tensors} tensors leaves under {4 * _COLS * world_size} bytes "
                "per tensor; raise --size-mib or lower --tensors"
            )
        return cls(tensors, rows)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole state (every rank's shards together)."""
        return self.tensors * self.rows * _COLS * 4


def build_state(spec: StateSpec, rank: int, world_size: int, mesh: Any = None) -> dict[str, Any]:
    """Distinct, deterministic values per tensor; DTensors sharded on dim 0 when ``mesh`` is given."""
    local_rows = spec.rows // world_size
    gen = torch.Generator().manual_seed(1234 + rank)
    base = torch.rand(local_rows, _COLS, generator=gen)
    state: dict[str, Any] = {}
    for i in range(spec.tensors):
        # base + i: every tensor differs, so a load that swaps two tensors is caught
        local = torch.add(base, float(i))
        state[f"layer_{i:03d}.weight"] = local if mesh is None else _shard(local, mesh)
    return state


def empty_like_state(state: dict[str, Any]) -> dict[str, Any]:
    """A zeroed load target with the same keys, shapes and sharding (pages touched now)."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if _is_dtensor(value):
            out[key] = _shard(torch.zeros_like(value.to_local()), value.device_mesh)
        else:
            out[key] = torch.zeros_like(value)
    return out


def local_tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    """Each value's local tensor (a DTensor's shard), in key order."""
    return [v.to_local() if _is_dtensor(v) else v for _, v in sorted(state.items())]


def check_equal(expected: list[torch.Tensor], got: list[torch.Tensor], what: str) -> None:
    """Raise VerificationError unless every tensor in ``got`` is bitwise equal to ``expected``."""
    if len(expected) != len(got):
        raise VerificationError(f"{what}: {len(got)} tensors came back, expected {len(expected)}")
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
            raise VerificationError(f"{what}: tensor {i} differs from what was saved")


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in _STATUS_FIELDS:
                out[name] = int(rest.split()[0]) * 1024
    return out


def rss_anon() -> int:
    """This process's anonymous resident bytes now."""
    return _status()["RssAnon"]


class RssProbe:
    """``with RssProbe() as p: ...`` then ``p.extra``: peak anonymous bytes above the start.

    ``p.source`` says how it was measured: "hwm" (the kernel's high-water mark, exact),
    "sampled" (the phase unmapped shared memory it had mapped, which the high-water mark
    cannot tell from anonymous memory, so the peak of ``RssAnon`` sampled every
    ``interval`` seconds is used), or None where ``/proc/self/clear_refs`` is not writable.
    """

    def __init__(self, interval: float = 0.002) -> None:
        self.extra: int | None = None
        self.source: str | None = None
        self._interval = interval
        self._start: dict[str, int] = {}
        self._peak = {"RssAnon": 0, "RssShmem": 0}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> RssProbe:
        trim_heap()
        self._start = _status()
        self._peak = {k: self._start[k] for k in self._peak}
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            return self
        self._thread = threading.Thread(target=self._sample, name="bench-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        end = _status()
        self._note(end)
        if self._peak["RssShmem"] > end["RssShmem"] + _SHMEM_SLACK:
            self.extra, self.source = self._peak["RssAnon"] - self._start["RssAnon"], "sampled"
        else:
            self.extra = end["VmHWM"] - end["RssFile"] - end["RssShmem"] - self._start["RssAnon"]
            self.source = "hwm"
        self.extra = max(0, self.extra)

    def _sample(self) -> None:
        while not self._stop.wait(self._interval):
            self._note(_status())

    def _note(self, status: dict[str, int]) -> None:
        for key in self._peak:
            self._peak[key] = max(self._peak[key], status[key])


def trim_heap() -> None:
    """Give free heap pages back to the kernel (glibc), so a phase that reuses memory freed
    by an earlier phase shows its allocations as an increase instead of hiding them."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _shard(local: torch.Tensor, mesh: Any) -> Any:
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False)


def cpu_pressure() -> str | None:
    """``/proc/pressure/cpu``'s first line, where the kernel has it."""
    try:
        with open("/proc/pressure/cpu") as f:
            return f.readline().strip()
    except OSError:
        return None


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()
