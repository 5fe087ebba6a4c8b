"""Writing a merge's output: all of it or nothing, every file hashed as it is written.

The files go into a temporary directory beside the destination (``.<name>.tmp-*``), which is renamed
to the destination only once complete. The temporary directory is flock()ed while its merge lives, so
a later merge can tell a dead run's leftover (lock free: it removes it) from a live one's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import glob
import hashlib
import json
import os
import queue
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

MANIFEST = "manifest.json"
# Bytes per write() call. Much larger writes were erratically slow here (1.3 GB with dd: 0.4 to 4.3 s at
# bs=16M, 0.29 to 0.37 s at bs=256k, both after a sync; the kernel serves a large write with large page
# cache folios, whose allocation a VM may make slow); cp's in-kernel copy was never affected.
WRITE_BYTES = 256 * 1024


@dataclasses.dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the output directory
    size: int
    sha256: str


@contextlib.contextmanager
def staging(out_dir: str | os.PathLike) -> Iterator[Path]:
    """A fresh temporary directory beside ``out_dir``, renamed to ``out_dir`` when the block completes
    and removed if it raises (a killed process leaves it behind, unlocked, for the next run to remove)."""
    if "://" in str(out_dir):
        raise ValueError(f"{out_dir}: the output must be a local directory (it is renamed into place when complete)")
    out = Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{out}: already exists")
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    fd = os.open(tmp, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield tmp
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(fd)


def remove_leftovers(out: Path) -> list[Path]:
    """Remove the temporary directories of dead merges into ``out`` (those no live process locks)."""
    removed = []
    for name in glob.glob(glob.escape(f".{out.name}.tmp-") + "*", root_dir=out.parent):
        path = out.parent / name
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live merge
        else:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed


def write_file(root: Path, name: str, data: bytes) -> FileEntry:
    (root / name).write_bytes(data)
    return FileEntry(name, len(data), hashlib.sha256(data).hexdigest())


def copy_file(src, root: Path, name: str, chunk: int = 8 * 1024 * 1024) -> FileEntry:
    """Copy the open binary file ``src`` to ``root/name``, hashing on the way."""
    digest = hashlib.sha256()
    size = 0
    with open(root / name, "wb") as dst:
        while block := src.read(chunk):
            dst.write(block)
            digest.update(block)
            size += len(block)
    return FileEntry(name, size, digest.hexdigest())


def write_manifest(root: Path, files: list[FileEntry], **fields) -> FileEntry:
    """``manifest.json``: size and sha256 of every other file of the output, plus ``fields``."""
    manifest = {**fields, "total_bytes": sum(f.size for f in files), "files": [dataclasses.asdict(f) for f in files]}
    return write_file(root, MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())


class Buffers:
    """A fixed set of reusable byte buffers: bounds the memory in flight between reader and writer
    (and reuses pages instead of faulting fresh ones in for every chunk)."""

    def __init__(self, count: int, size: int) -> None:
        self.size = size
        self._free: queue.Queue[bytearray] = queue.Queue()
        for _ in range(count):
            self._free.put(bytearray(size))

    def get(self) -> bytearray:
        return self._free.get()

    def put(self, buf: bytearray) -> None:
        self._free.put(buf)


class StreamedFile:
    """One output file, written on one background thread and hashed on another: while the caller
    reads and merges chunk i+2, chunk i+1 is written and chunk i hashed (file I/O, hashlib and numpy
    all release the GIL). Hashing is the slowest stage (~1.7 GB/s), so it gets a core of its own."""

    def __init__(self, root: Path, name: str) -> None:
        self.name = name
        self.written = 0  # bytes on disk so far (read by the caller for progress)
        self._file = open(root / name, "wb")
        self._digest = hashlib.sha256()
        self._to_write: queue.Queue = queue.Queue()
        self._to_hash: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._threads = [
            threading.Thread(target=self._write_loop, name=f"write {name}", daemon=True),
            threading.Thread(target=self._hash_loop, name=f"hash {name}", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def write(self, data, release: Callable[[], None] | None = None) -> None:
        """Queue ``data`` (bytes or a memoryview); ``release()`` is called once it is written and hashed."""
        if self._error is not None:
            raise OSError(f"writing {self.name} failed: {self._error}") from self._error
        self._to_write.put((data, release))

    def _write_loop(self) -> None:
        while (item := self._to_write.get()) is not None:
            try:
                if self._error is None:
                    data = memoryview(item[0])
                    for start in range(0, len(data), WRITE_BYTES):
                        self._file.write(data[start : start + WRITE_BYTES])
                    self.written += len(data)
            except BaseException as exc:  # reported to the caller; buffers keep flowing back
                self._error = exc
            self._to_hash.put(item)
        self._to_hash.put(None)

    def _hash_loop(self) -> None:
        while (item := self._to_hash.get()) is not None:
            data, release = item
            try:
                self._digest.update(data)
            finally:
                if release is not None:
                    release()

    def _finish(self) -> None:
        self._to_write.put(None)
        for t in self._threads:
            t.join()
        self._file.close()

    def close(self) -> FileEntry:
        self._finish()
        if self._error is not None:
            raise OSError(f"writing {self.name} failed: {self._error}") from self._error
        return FileEntry(self.name, self.written, self._digest.hexdigest())

    def abort(self) -> None:
        self._finish()
