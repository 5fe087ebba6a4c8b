"""Base models from remote sources (``gs://`` and other fsspec URLs), copied once per host.

Tunix's safetensors loader reads local files, so a worker copies a registered remote checkpoint to
``<data dir>/models/cache/<name>-<hash of the URL>/`` before it trains: into a temporary directory
first, renamed when every file is there, so an interrupted copy is never mistaken for a model.
"""

from __future__ import annotations

import hashlib
import posixpath
import shutil
from collections.abc import Callable
from pathlib import Path

import fsspec


def cached_copy(source: str, cache_root: Path, name: str, log: Callable[[str], None] = print) -> Path:
    """The local copy of the checkpoint directory at URL ``source`` (made now if missing)."""
    dest = cache_root / f"{name}-{hashlib.sha256(source.encode()).hexdigest()[:12]}"
    if dest.is_dir():
        return dest
    fs, root = fsspec.core.url_to_fs(source)
    files = [f for f in fs.ls(root, detail=True) if f["type"] == "file"]
    total = sum(f.get("size") or 0 for f in files)
    log(f"copying base model {name} from {source}: {len(files)} files, {total / 1e9:.2f} GB")
    tmp = cache_root / f".{dest.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)  # a copy that died half-way
    tmp.mkdir(parents=True)
    done = 0
    for f in files:
        fs.get_file(f["name"], str(tmp / posixpath.basename(f["name"])))
        done += f.get("size") or 0
        log(f"copied {posixpath.basename(f['name'])} ({done / 1e9:.2f} of {total / 1e9:.2f} GB)")
    tmp.rename(dest)
    return dest
