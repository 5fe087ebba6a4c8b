"""Reading and reshaping HF checkpoints for the merge tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np


def read_tensors(model_dir: Path) -> dict[str, bytes]:
    """Every tensor of every safetensors file in a checkpoint dir, as raw bytes, read by the safetensors
    library itself (so the files are valid for it); a name in two files fails."""
    from safetensors import safe_open

    out: dict[str, bytes] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "flax") as f:  # "flax": the numpy reader has no bfloat16
            for name in f.keys():
                assert name not in out, f"{name} is in two files"
                out[name] = np.asarray(f.get_tensor(name)).tobytes()
    return out


def write_sharded(src: Path, dest: Path, shards: int, extra: dict[str, np.ndarray]) -> Path:
    """A copy of the checkpoint ``src`` with its tensors (plus ``extra``) split over ``shards`` HF-named
    files and an index, written with safetensors itself."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("*.safetensors"))
    with safe_open(str(src / "model.safetensors"), "flax") as f:
        tensors = {k: np.asarray(f.get_tensor(k)) for k in f.keys()}
    tensors.update(extra)
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({n: tensors[n] for n in part}, str(dest / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index))
    return dest
