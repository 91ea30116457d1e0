"""Copy one committed memory step to the durable tier: the one copy under the rank drain
(``drain.py``), the node agent's flush (``agent/drain.py``), the launcher's persist on exit
(``launcher/dataplane/persist.py``) and ``tierckpt promote`` (``commands/promote.py``).

Call order for step N of save S; the callers differ in which files each of them holds and in
how they agree that every file is staged, between 4 and 5:
  1. ``sealed_step(memory, N, namespace)``: the small files, read and checked (the marker seals
     the manifest, the metadata matches its checksum). The drain saved the step itself and
     holds them already.
  2. ``pin_files(memory, N, names)``: the data files this rank or node holds, hard-linked so
     retention cannot recycle their shared-memory slots meanwhile (the drain pins on the
     committer thread, before its copy is queued). A file gone already pins as None.
  3. ``check_files(pins, manifest, where)``, optional: every item's checksum, before a byte is sent
     (a check that fails releases the pins).
  4. ``put_files(durable, N, S, pins)``: every pin is there, then ``Tier.put_file`` per file, in
     order; the pins are released whatever happens; returns the bytes sent.
     The agreement: all_gather (drain.py), a claim file (agent/drain.py), a store barrier
     (launcher/dataplane/persist.py), none (promote: one node holds every file).
  5. ``commit_step(durable, N, S, metadata, manifest)``: ``Tier.commit``, the small files and
     then the marker, last. One writer per step: the coordinator, the claim's winner, the leader.
  6. ``verify_step(durable, N, namespace)``, optional: the durable copy end to end.
Nothing here aborts a durable staging area: with several writers only the caller knows whose it is.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from tierckpt import layout
from tierckpt.errors import CheckpointNotFoundError, IntegrityError
from tierckpt.tiers.base import Tier
from tierckpt.tiers.integrity import sealed_manifest_bytes, verified_metadata, verify_copy, verify_items
from tierckpt.tiers.local import LocalTier

__all__ = [
    "Pins", "SealedStep", "check_files", "commit_step", "pin_files", "put_files", "release_pins", "sealed_step",
    "verify_step",
]

#: data file name → its pin in the memory tier (None: the file was gone when pinned)
Pins = Mapping[str, Path | None]


@dataclass(frozen=True)
class SealedStep:
    """A committed step's small files, checked against each other."""

    manifest: layout.Manifest
    manifest_raw: bytes
    metadata: bytes


def sealed_step(memory: Tier, step: int, namespace: str) -> SealedStep:
    """The step's manifest and metadata once the marker seals them; IntegrityError if not."""
    mf_raw = memory.read_file(step, layout.MANIFEST)
    manifest = sealed_manifest_bytes(memory.read_file(step, layout.MARKER), mf_raw, namespace, step,
                                     where=memory.location(step))
    return SealedStep(manifest, mf_raw, verified_metadata(memory, manifest))


def pin_files(memory: LocalTier, step: int, names: Iterable[str]) -> dict[str, Path | None]:
    """Pin each named data file of ``step``; hand the pins to ``put_files`` (or ``release_pins``)."""
    pins: dict[str, Path | None] = {}
    try:
        for name in names:
            pins[name] = memory.pin(step, name)
    except BaseException:
        release_pins(pins)
        raise
    return pins


def release_pins(pins: Pins) -> None:
    """Let retention have the files again (a pin released twice is no error)."""
    for pin in pins.values():
        if pin is not None:
            LocalTier.unpin(pin)


def check_files(pins: Pins, manifest: layout.Manifest, where: str) -> None:
    """Every item of every pinned file against the manifest's checksums; IntegrityError at the first
    that fails. A check that passes leaves the pins for ``put_files``; one that raises releases them."""
    try:
        for name, pin in _present(manifest.step, pins).items():
            verify_items(_map(pin), [r for r in manifest.items if r.file == name], f"{where}/{name}")
    except BaseException:
        release_pins(pins)
        raise


def put_files(durable: Tier, step: int, save_id: str, pins: Pins,
              done: Callable[[int, str], object] | None = None) -> int:
    """``put_file`` for each pinned file in order, once every pin is there; ``done(bytes, name)``
    after each. Releases the pins, whatever happens. Returns the bytes sent."""
    nbytes = 0
    try:
        for name, pin in _present(step, pins).items():
            size = pin.stat().st_size
            durable.put_file(step, save_id, name, pin)
            nbytes += size
            if done is not None:
                done(size, name)
    finally:
        release_pins(pins)
    return nbytes


def commit_step(durable: Tier, step: int, save_id: str, metadata: bytes, manifest: bytes) -> None:
    """Make the staged step visible: the metadata and the manifest, then the marker, last."""
    durable.commit(step, save_id, {layout.METADATA: metadata, layout.MANIFEST: manifest})


def verify_step(durable: Tier, step: int, namespace: str) -> None:
    """Read the durable copy back completely (seal, metadata, every item); IntegrityError if it fails."""
    report = verify_copy(durable, step, namespace)
    if not report.ok:
        raise IntegrityError(f"step {step}: the durable copy at {report.location} fails verification after the "
                             "copy: " + "; ".join(report.problems) + "; delete it and copy the step again", step=step)


def _present(step: int, pins: Pins) -> dict[str, Path]:
    """The pins, once every one is there: nothing is checked or sent of a step that lost a file."""
    present: dict[str, Path] = {}
    for name, pin in pins.items():
        if pin is None or not pin.exists():
            raise CheckpointNotFoundError(f"{name} of step {step} left the memory tier before its copy "
                                          "(retention removed the step); copy a newer step", step=step)
        present[name] = pin
    return present


def _map(path: Path) -> memoryview:
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        return memoryview(mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)) if size else memoryview(b"")
