"""Writing a merge's output: all of it or nothing, every file hashed as it is written.

The files go into a temporary directory beside the destination (``.<name>.tmp-*``), which is renamed
to the destination only once complete and on disk (every file and the directory fsync()ed first, so
a machine that loses power never shows a renamed directory with files missing their data). The
temporary directory is flock()ed while its merge lives, so a later merge can tell a dead run's
leftover (lock free: it removes it) from a live one's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import glob
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

MANIFEST = "manifest.json"


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
        for path in tmp.iterdir():
            sync_file(path)
        sync_file(tmp)
        os.rename(tmp, out)
        sync_file(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(fd)


def sync_file(path: Path) -> None:
    """fsync() a file or directory: its data (or entries) on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
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
