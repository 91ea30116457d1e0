"""A tier in a local directory: tmpfs for the memory tier, a disk or mount for durable.

Commit is a directory rename: files go to ``.staging/step_N.<save_id>/``; the
coordinator writes the small files and the marker there (fsynced when ``durable``), then
renames the directory to ``step_N`` and fsyncs the parent. A crash at any point leaves
either the old state or the new committed step, never a torn one.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import shutil
import socket
import uuid
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path

from tierckpt import layout
from tierckpt.errors import CheckpointNotFoundError, StorageError
from tierckpt.tiers.base import Hasher, Source, StepListing

__all__ = ["LocalFileReader", "LocalTier", "pid_alive"]

_HOST = socket.gethostname()
#: bytes per read(): the piece is hashed right after the kernel copied it, still in the cache
_READ_PIECE = 1 << 20


class LocalTier:
    """A namespace under ``root``; ``durable`` adds fsyncs, else data files are hard-linked."""

    def __init__(self, root: Path, namespace: str, *, name: str, durable: bool) -> None:
        self.root = Path(root)
        self.namespace = namespace
        self.name = name
        self.durable = durable
        self.ns_dir = self.root / namespace

    # -- naming -----------------------------------------------------------------
    def location(self, step: int | None = None) -> str:
        if step is None:
            return str(self.ns_dir)
        return str(self.ns_dir / layout.step_dir_name(step))

    def step_dir(self, step: int) -> Path:
        return self.ns_dir / layout.step_dir_name(step)

    def staging_dir(self, step: int, save_id: str) -> Path:
        return self.ns_dir / layout.STAGING / layout.staging_dir_name(step, save_id)

    # -- reads --------------------------------------------------------------------
    def list_steps(self, *, include_uncommitted: bool = False) -> list[StepListing]:
        try:
            names = os.listdir(self.ns_dir)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise self._error("list", self.ns_dir, exc) from exc
        out = []
        for entry in names:
            step = layout.parse_step_dir(entry)
            if step is None:
                continue
            d = self.ns_dir / entry
            committed = (d / layout.MARKER).is_file()
            if not (committed or include_uncommitted):
                continue
            files = {}
            try:
                with os.scandir(d) as entries:  # closed also when a file goes while listing
                    for f in entries:
                        if f.is_file():
                            files[f.name] = f.stat().st_size
            except FileNotFoundError:
                continue  # deleted while listing
            out.append(StepListing(step=step, committed=committed, files=files))
        return sorted(out, key=lambda s: s.step)

    @contextlib.contextmanager
    def _reading(self, path: Path, step: int) -> Iterator[None]:
        """A missing file is CheckpointNotFoundError, any other OSError a StorageError (tier, path, step)."""
        try:
            yield
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"{path} does not exist", tier=self.name, path=str(path), step=step
            ) from exc
        except OSError as exc:
            raise self._error("read", path, exc, step) from exc

    def read_file(self, step: int, name: str) -> bytes:
        path = self.step_dir(step) / name
        with self._reading(path, step):
            return path.read_bytes()

    def read_range(self, step: int, name: str, offset: int, length: int) -> memoryview:
        path = self.step_dir(step) / name
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if offset + length > size:
                    raise StorageError(
                        f"{path} holds {size} bytes; bytes {offset}..{offset + length} were asked for",
                        tier=self.name, path=str(path), step=step,
                    )
                if length == 0:
                    return memoryview(b"")
                # one mapping per file would be cheaper for many items; see map_file
                start = offset - offset % mmap.ALLOCATIONGRANULARITY
                mm = mmap.mmap(f.fileno(), length + offset - start, access=mmap.ACCESS_COPY, offset=start)
                return memoryview(mm)[offset - start :]
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"{path} does not exist", tier=self.name, path=str(path), step=step
            ) from exc
        except OSError as exc:
            if isinstance(exc, StorageError):
                raise
            raise self._error("read", path, exc, step) from exc

    def map_file(self, step: int, name: str) -> memoryview:
        """The whole file, mapped read-only (callers slice it per item)."""
        path = self.step_dir(step) / name
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    return memoryview(b"")
                # read-only and pre-faulted in one call: a fresh mapping otherwise costs a fault per page
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                return memoryview(mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ))
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"{path} does not exist", tier=self.name, path=str(path), step=step
            ) from exc
        except OSError as exc:
            raise self._error("read", path, exc, step) from exc

    def open_reader(self, step: int, name: str) -> LocalFileReader:
        """The file open for ``read_into``: plain reads, no mapping (see LocalFileReader)."""
        path = self.step_dir(step) / name
        with self._reading(path, step):
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        return LocalFileReader(fd, path, self.name, step)

    # -- writes -------------------------------------------------------------------
    def put_file(self, step: int, save_id: str, name: str, source: Source) -> None:
        staging = self.staging_dir(step, save_id)
        dest = staging / name
        try:
            staging.mkdir(parents=True, exist_ok=True)
            (staging / f".owner-{_HOST}-{os.getpid()}").touch()
            if isinstance(source, Path):
                if not self.durable:
                    try:
                        _replace_link(source, dest)
                        return
                    except OSError as exc:
                        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                            raise
                tmp = dest.with_name(f".{name}.tmp-{uuid.uuid4().hex[:8]}")
                _copy_file(source, tmp, fsync=self.durable)
                os.replace(tmp, dest)
            else:
                _write_bytes(dest, source, fsync=self.durable)
        except OSError as exc:
            raise self._error("write", dest, exc, step) from exc

    def commit(self, step: int, save_id: str, files: Mapping[str, bytes]) -> None:
        if layout.MANIFEST not in files:
            raise ValueError("commit needs the manifest among its files")
        staging = self.staging_dir(step, save_id)
        final = self.step_dir(step)
        try:
            staging.mkdir(parents=True, exist_ok=True)
            for name, raw in files.items():
                _write_bytes(staging / name, raw, fsync=self.durable)
            for owner in staging.glob(".owner-*"):
                owner.unlink(missing_ok=True)
            _write_bytes(
                staging / layout.MARKER,
                layout.marker_bytes(save_id, files[layout.MANIFEST]),
                fsync=self.durable,
            )
            if self.durable:
                _fsync_dir(staging)
            if final.exists():  # a re-save replaces the old copy in one atomic swap
                if _exchange(staging, final):
                    self._to_trash(staging)  # now holds the old copy
                else:  # no RENAME_EXCHANGE here (old kernel, some network filesystems)
                    self._to_trash(final)
                    os.rename(staging, final)
            else:
                os.rename(staging, final)
            if self.durable:
                _fsync_dir(self.ns_dir)
        except OSError as exc:
            raise self._error("commit", final, exc, step) from exc

    def delete(self, step: int) -> None:
        final = self.step_dir(step)
        try:
            (final / layout.MARKER).unlink()
            if self.durable:
                _fsync_dir(final)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise self._error("delete", final, exc, step) from exc
        if final.exists():
            self._to_trash(final)

    def abort(self, step: int, save_id: str) -> None:
        """Drop a save's staging directory (nothing visible changes)."""
        shutil.rmtree(self.staging_dir(step, save_id), ignore_errors=True)

    def pin(self, step: int, name: str) -> Path | None:
        """Hard-link a committed data file so deleting the step cannot free its storage.

        The memory tier's data files are shared-memory slots: while a pin exists the slot
        is busy (``st_nlink > 1``) and no save reuses it. ``unpin`` when done; pins of dead
        processes are removed by ``gc_staging``. None when the file is gone already.
        """
        pins = self.ns_dir / layout.PINS
        pins.mkdir(parents=True, exist_ok=True)
        pin = pins / f"{layout.step_dir_name(step)}.{name}.owner-{_HOST}-{os.getpid()}.{uuid.uuid4().hex[:6]}"
        try:
            os.link(self.step_dir(step) / name, pin)
        except FileNotFoundError:
            return None
        return pin

    @staticmethod
    def unpin(pin: Path) -> None:
        pin.unlink(missing_ok=True)

    def gc_staging(self, *, keep: Collection[str] = frozenset()) -> list[str]:
        """Remove what dead writers left behind; return the names removed.

        Staging directories whose writers on this host are all dead (``keep`` holds save
        ids in progress; another host's directories are left alone), step directories
        without a marker (a deletion that died between removing the marker and the rename:
        commits never create one), and pins of dead processes.
        """
        removed: list[str] = []
        for entry in self._scan(self.ns_dir):
            if layout.parse_step_dir(entry.name) is not None and not os.path.exists(os.path.join(entry.path, layout.MARKER)):
                self._to_trash(Path(entry.path))
                removed.append(entry.name)
        for entry in self._scan(self.ns_dir / layout.PINS):
            owner = entry.name.split(".owner-", 1)[-1].rsplit(".", 1)[0]
            if not _owner_alive(f".owner-{owner}"):
                os.unlink(entry.path)
                removed.append(entry.name)
        for entry in self._scan(self.ns_dir / layout.STAGING):
            if entry.name.rsplit(".", 1)[-1] in keep:
                continue
            owners = [p.name for p in Path(entry.path).glob(".owner-*")]
            live = [o for o in owners if _owner_alive(o)]
            if not live:
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.name)
        shutil.rmtree(self.ns_dir / layout.TRASH, ignore_errors=True)
        return removed

    # -- helpers ------------------------------------------------------------------
    def _scan(self, path: Path) -> list[os.DirEntry[str]]:
        try:
            return list(os.scandir(path))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise self._error("list", path, exc) from exc

    def _to_trash(self, path: Path, *, unless_committed: bool = False) -> None:
        """Move ``path`` out of sight (one rename), then delete it; gone already: nothing to do.

        ``unless_committed``: a step directory whose marker appeared between the caller's look and
        the rename (a commit that just landed) is put back instead.
        """
        trash = self.ns_dir / layout.TRASH
        trash.mkdir(parents=True, exist_ok=True)
        target = trash / f"{path.name}.{uuid.uuid4().hex[:8]}"
        try:
            os.rename(path, target)
        except FileNotFoundError:
            return  # someone else removed it first
        if unless_committed and (target / layout.MARKER).exists():
            os.rename(target, path)
            return
        shutil.rmtree(target, ignore_errors=True)

    def _error(self, what: str, path: Path, exc: OSError, step: int | None = None) -> StorageError:
        hint = ""
        if exc.errno == errno.ENOSPC:
            hint = ": no space left; free space or lower retention"
        elif exc.errno in (errno.EACCES, errno.EPERM):
            hint = ": permission denied; check the directory's owner and mode"
        return StorageError(
            f"{self.name} tier could not {what} {path}{hint} ({exc.strerror or exc})",
            tier=self.name, path=str(path), step=step,
        )


class LocalFileReader:
    """Reads of one local file straight into the caller's memory, hashed piece by piece.

    ``pread`` rather than a mapping: the kernel copies from its page cache (tmpfs pages for the
    memory tier) into the destination, and no page-table entries are set up for the source,
    which for a fresh process costs as much as the copy itself. Each 1 MiB piece is hashed
    right after it lands, while it is in the CPU cache, so verifying adds no pass over memory.
    ``os.preadv`` releases the GIL: several threads read one file in parallel.
    """

    concurrency = 4

    def __init__(self, fd: int, path: Path, tier: str, step: int) -> None:
        self.fd, self.path, self.tier, self.step = fd, path, tier, step

    def read_into(self, offset: int, out: memoryview, hasher: Hasher | None = None) -> None:
        pos = 0
        while pos < len(out):
            piece = out[pos : pos + _READ_PIECE]
            try:
                got = _pread_fully(self.fd, piece, offset + pos)
            except OSError as exc:
                raise StorageError(
                    f"{self.tier} tier could not read {self.path} ({exc.strerror or exc})",
                    tier=self.tier, path=str(self.path), step=self.step,
                ) from exc
            if got < len(piece):
                raise StorageError(
                    f"{self.path} ends at byte {offset + pos + got}; bytes {offset}..{offset + len(out)} "
                    "were asked for (the file is shorter than its manifest says)",
                    tier=self.tier, path=str(self.path), step=self.step,
                )
            if hasher is not None:
                hasher.update(piece)
            pos += got

    def read_scattered(self, offset: int, outs: list[memoryview], hasher: Hasher | None = None) -> None:
        for out in outs:
            self.read_into(offset, out, hasher)
            offset += len(out)

    def close(self) -> None:
        os.close(self.fd)


def _pread_fully(fd: int, out: memoryview, offset: int) -> int:
    """Bytes read into ``out`` from ``offset``: all of it, or fewer only at the end of the file."""
    got = 0
    while got < len(out):
        n = os.preadv(fd, [out[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2); False where the platform cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    rc = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host exists (one that is not ours to signal counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner_alive(owner_name: str) -> bool:
    host, _, pid = owner_name[len(".owner-") :].rpartition("-")
    if host != _HOST:
        return True  # cannot tell from here: leave it to that host
    return not pid.isdigit() or pid_alive(int(pid))


def _replace_link(source: Path, dest: Path) -> None:
    tmp = dest.with_name(f".{dest.name}.lnk-{uuid.uuid4().hex[:8]}")
    os.link(source, tmp)
    os.replace(tmp, dest)


def _write_bytes(path: Path, data: bytes | bytearray | memoryview, *, fsync: bool) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def _copy_file(source: Path, dest: Path, *, fsync: bool) -> None:
    with open(source, "rb") as src, open(dest, "wb") as dst:
        size = os.fstat(src.fileno()).st_size
        copied = 0
        while copied < size:  # kernel-side copy: no pass through Python buffers
            n = os.sendfile(dst.fileno(), src.fileno(), copied, min(size - copied, 1 << 30))
            if n == 0:
                raise OSError(errno.EIO, f"short copy of {source}")
            copied += n
        if fsync:
            os.fsync(dst.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
