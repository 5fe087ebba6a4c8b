"""A LoRA checkpoint merged into its base's Hugging Face safetensors (streamed), or exported as a PEFT adapter.

The merge reads the base through fsspec, tensor by tensor in chunks of rows, adds the LoRA delta in
float32 and casts back to the base dtype, and streams the result into HF-named shards whose headers
are written first (every shape and dtype is known from the base's headers). Memory stays flat in the
model size: a few chunk buffers, the LoRA factors and the libraries. Tensors without a LoRA delta
(embedding, norms, a vision or audio tower, anything else) are copied byte for byte. Every other file
of the base (config.json, generation_config.json, tokenizer files, chat template) is copied, except
weights in any format and weight indexes: a base's stale index must never describe the new shards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import posixpath
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import fsspec
import numpy as np
from threadpoolctl import threadpool_limits

from worker.merge import mapping, output
from worker.merge.lora import load_lora
from worker.merge.output import FileEntry
from worker.merge.safetensors_io import FLOAT_DTYPES, TensorInfo, encode_header, read_header
from worker.training import models

CHUNK_BYTES = 16 * 1024 * 1024  # float32 working size of one chunk of rows
BUFFERS = 6  # chunks in flight: being read and merged, written, hashed, and queued between
PROGRESS_EVERY_S = 0.2
SHARD_METADATA = {"format": "pt"}  # what transformers expects in a safetensors header
INDEX = "model.safetensors.index.json"
# Files of the base never carried over: weights in any format, their indexes, and our own manifest.
NOT_COPIED = (".safetensors", ".index.json", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")

Progress = Callable[[int, int], None]


@dataclasses.dataclass
class MergeResult:
    path: str  # the output directory
    files: list[FileEntry]  # every file written but manifest.json, which lists them
    total_bytes: int
    tensors: int  # tensors written
    merged_tensors: int  # of which a LoRA delta changed (merge) or LoRA matrices (PEFT export: all)
    seconds: float


@dataclasses.dataclass
class Checkpoint:
    """An HF checkpoint's layout: its config.json and safetensors headers (no tensor data read)."""

    url: str
    fs: fsspec.AbstractFileSystem
    root: str
    config: dict
    tensors: list[TensorInfo]  # every tensor, shard by shard in file order
    other_files: list[str]  # the files a merge carries over

    def path(self, name: str) -> str:
        return posixpath.join(self.root, name)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {t.name: t.shape for t in self.tensors}


def open_checkpoint(model_dir: str) -> Checkpoint:
    """Read a checkpoint's layout through fsspec (a local path or a URL such as ``gs://``).

    The shards are the files ``model.safetensors.index.json`` lists when there is one (and every tensor
    must be where it says), else every ``*.safetensors`` file."""
    fs, root = fsspec.core.url_to_fs(model_dir)
    if not fs.isdir(root):
        raise FileNotFoundError(f"{model_dir}: no such directory")
    sizes = {posixpath.basename(e["name"]): e["size"] for e in fs.ls(root, detail=True) if e["type"] == "file"}
    if "config.json" not in sizes:
        raise FileNotFoundError(f"{model_dir}: no config.json (expected a Hugging Face checkpoint directory)")
    with fs.open(posixpath.join(root, "config.json"), "rb") as f:
        config = json.load(f)
    weight_map = None
    if INDEX in sizes:
        with fs.open(posixpath.join(root, INDEX), "rb") as f:
            weight_map = json.load(f).get("weight_map") or {}
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if s not in sizes]
        if missing:
            raise FileNotFoundError(f"{model_dir}/{INDEX} lists {', '.join(missing)}, which the directory lacks")
    else:
        shards = sorted(n for n in sizes if n.endswith(".safetensors"))
    if not shards:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files (expected a Hugging Face checkpoint)")

    tensors: list[TensorInfo] = []
    seen: dict[str, str] = {}
    for shard in shards:
        with fs.open(posixpath.join(root, shard), "rb") as f:
            infos = read_header(f, f"{model_dir}/{shard}", sizes[shard])
        for t in infos:
            if t.name in seen:
                raise ValueError(f"{model_dir}: tensor {t.name} is in both {seen[t.name]} and {shard}")
            if weight_map is not None and weight_map.get(t.name) != shard:
                raise ValueError(f"{model_dir}/{INDEX} puts {t.name} in {weight_map.get(t.name)}, but it is in {shard}")
            seen[t.name] = shard
        tensors += infos
    if weight_map is not None and set(weight_map) != set(seen):
        lost = sorted(set(weight_map) - set(seen))[:3]
        raise ValueError(f"{model_dir}/{INDEX} lists tensors no shard holds: {', '.join(lost)}")
    others = sorted(n for n in sizes if not n.endswith(NOT_COPIED) and n != output.MANIFEST)
    return Checkpoint(model_dir, fs, root, config, tensors, others)


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def plan_shards(tensors: list[TensorInfo], shard_size: int) -> list[list[TensorInfo]]:
    """Fill shards in order up to ``shard_size`` tensor bytes; a larger tensor gets a shard of its own
    (transformers' rule)."""
    shards: list[list[TensorInfo]] = []
    size = 0
    for t in tensors:
        if not shards or (size + t.nbytes > shard_size and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def merge_lora(
    base_dir: str,
    checkpoint_dir: str,
    out_dir: str,
    *,
    rank: int,
    alpha: float,
    shard_size: int = 5 * 10**9,
    progress: Progress | None = None,
) -> MergeResult:
    """Write the base with the LoRA of ``checkpoint_dir`` merged in, as an HF checkpoint at ``out_dir``.

    ``out_dir`` (local) appears only once complete, with a ``manifest.json``; it must not exist yet.
    ``progress(bytes_done, bytes_total)`` is called as the shards are written, a few times a second.
    Everything is checked (paths, shapes, dtypes, ranks) before the first byte is written."""
    started = time.perf_counter()
    base = open_checkpoint(base_dir)
    config = models.model_config_from_hf(base.config)
    by_name = {t.name: t for t in base.tensors}
    loras = {
        f.tensor: f for f in mapping.to_hf(load_lora(checkpoint_dir), config, base.shapes, rank=rank, where=base_dir)
    }
    for name in loras:
        t = by_name[name]
        if t.dtype not in FLOAT_DTYPES or len(t.shape) != 2:
            raise ValueError(f"{base_dir}/{t.file}: cannot merge LoRA into {name} ({t.dtype} {list(t.shape)})")
    groups = plan_shards(base.tensors, shard_size)
    names = shard_names(len(groups))
    headers = [encode_header(g, SHARD_METADATA) for g in groups]
    total = sum(len(h) + sum(t.nbytes for t in g) for h, g in zip(headers, groups, strict=True))
    widest = max((by_name[name].shape[1] * 4 for name in loras), default=0)  # float32 bytes of a row

    # One BLAS thread: the rank-r products are small, and idle BLAS threads spin on the cores the writer and
    # the hasher need (a third faster on 2 cores).
    with (
        output.staging(out_dir) as tmp,
        _Merger(base, loras, alpha / rank, max(CHUNK_BYTES, widest)) as merger,
        threadpool_limits(1, user_api="blas"),
    ):
        reporter = _Reporter(progress, total)
        reporter(0)
        files = [merger.write_shard(tmp, n, h, g, reporter) for n, h, g in zip(names, headers, groups, strict=True)]
        reporter.done()
        if len(groups) > 1:
            index = {
                "metadata": {"total_size": sum(t.nbytes for t in base.tensors)},
                "weight_map": {t.name: n for n, g in zip(names, groups, strict=True) for t in g},
            }
            files.append(output.write_file(tmp, INDEX, (json.dumps(index, indent=2) + "\n").encode()))
        for name in base.other_files:
            with base.fs.open(base.path(name), "rb") as src:
                files.append(output.copy_file(src, tmp, name))
        output.write_manifest(
            tmp,
            files,
            kind="merged_model",
            base=base_dir,
            checkpoint=checkpoint_dir,
            lora_rank=rank,
            lora_alpha=alpha,
            tensors=len(base.tensors),
            merged_tensors=len(loras),
        )
    return MergeResult(
        path=str(out_dir),
        files=files,
        total_bytes=sum(f.size for f in files),
        tensors=len(base.tensors),
        merged_tensors=len(loras),
        seconds=time.perf_counter() - started,
    )


class _Reporter:
    """Calls ``progress`` at most every PROGRESS_EVERY_S, and once at the end."""

    def __init__(self, progress: Progress | None, total: int) -> None:
        self.progress = progress
        self.total = total
        self.base = 0  # bytes of the finished shards
        self.last = 0.0

    def __call__(self, current: int) -> None:
        now = time.monotonic()
        if self.progress is not None and now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            self.progress(self.base + current, self.total)

    def done(self) -> None:
        if self.progress is not None:
            self.progress(self.total, self.total)


class _Merger:
    """Reads base tensors in chunks into reusable buffers, adds LoRA deltas, and hands the buffers to
    the file writer's thread."""

    def __init__(self, base: Checkpoint, loras: dict[str, mapping.HFLora], scale: float, chunk: int) -> None:
        self.base = base
        self.loras = loras
        self.scale = np.float32(scale)
        self.buffers = output.Buffers(BUFFERS, chunk)
        self.delta = np.empty(chunk // 4, np.float32)
        self.work = np.empty(chunk // 4, np.float32)
        self.files = contextlib.ExitStack()
        self.open: dict = {}  # base file name -> open file

    def __enter__(self) -> _Merger:
        return self

    def __exit__(self, *exc) -> None:
        self.files.close()

    def _file(self, name: str):
        if name not in self.open:
            self.open[name] = self.files.enter_context(self.base.fs.open(self.base.path(name), "rb"))
        return self.open[name]

    def write_shard(
        self, root: Path, name: str, header: bytes, tensors: list[TensorInfo], report: _Reporter
    ) -> FileEntry:
        out = output.StreamedFile(root, name)
        try:
            out.write(header)
            for t in tensors:
                for view, buf in self._chunks(t):
                    out.write(view, lambda buf=buf: self.buffers.put(buf))
                    report(out.written)
            entry = out.close()
        except BaseException:
            out.abort()
            raise
        report.base += entry.size
        return entry

    def _chunks(self, t: TensorInfo) -> Iterator[tuple[memoryview, bytearray]]:
        """``t``'s bytes as merged, in chunks: (view of a buffer, the buffer to give back)."""
        f = self._file(t.file)
        f.seek(t.offset)
        lora = self.loras.get(t.name)
        if lora is None:
            for start in range(0, t.nbytes, self.buffers.size):
                buf = self.buffers.get()
                view = memoryview(buf)[: min(self.buffers.size, t.nbytes - start)]
                self._read(f, view, t)
                yield view, buf
            return
        dtype = FLOAT_DTYPES[t.dtype]
        out_dim, in_dim = t.shape
        rows = max(1, self.buffers.size // (in_dim * 4))
        for r0 in range(0, out_dim, rows):
            n = min(rows, out_dim - r0)
            buf = self.buffers.get()
            view = memoryview(buf)[: n * in_dim * dtype.itemsize]
            self._read(f, view, t)
            weight = np.frombuffer(buf, dtype, n * in_dim).reshape(n, in_dim)
            delta = self.delta[: n * in_dim].reshape(n, in_dim)
            np.matmul(lora.b[r0 : r0 + n], lora.a, out=delta)
            delta *= self.scale
            if dtype == np.float32:
                weight += delta
            else:
                work = self.work[: n * in_dim].reshape(n, in_dim)
                np.copyto(work, weight)
                work += delta
                np.copyto(weight, work, casting="unsafe")
            yield view, buf

    def _read(self, f, view: memoryview, t: TensorInfo) -> None:
        done = 0
        while done < len(view):
            n = f.readinto(view[done:])
            if not n:
                raise ValueError(f"{self.base.url}/{t.file}: ends inside tensor {t.name}")
            done += n


def export_peft(
    base_dir: str,
    checkpoint_dir: str,
    out_dir: str,
    *,
    rank: int,
    alpha: float,
    base_model_name_or_path: str,
    progress: Progress | None = None,
) -> MergeResult:
    """Write the LoRA of ``checkpoint_dir`` as a PEFT adapter (``adapter_config.json`` +
    ``adapter_model.safetensors``) that ``peft.PeftModel`` and vLLM's ``--lora-modules`` load on top of
    the base. Names follow the base's own module paths (``base_model.model.model.layers.0...`` or,
    for the multimodal layout, ``base_model.model.model.language_model.layers.0...``); a sliding
    layer's fused kv LoRA becomes k_proj and v_proj adapters sharing one A."""
    from safetensors.numpy import save

    started = time.perf_counter()
    base = open_checkpoint(base_dir)
    config = models.model_config_from_hf(base.config)
    factors = mapping.to_hf(load_lora(checkpoint_dir), config, base.shapes, rank=rank, where=base_dir)
    tensors = {}
    for f in factors:
        stem = "base_model.model." + f.tensor.removesuffix(".weight")
        tensors[stem + ".lora_A.weight"] = np.ascontiguousarray(f.a)
        tensors[stem + ".lora_B.weight"] = np.ascontiguousarray(f.b)
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": rank,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted({f.target for f in factors}, key=models.HF_TARGET_MODULES.index),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    data = save(tensors, metadata=SHARD_METADATA)
    with output.staging(out_dir) as tmp:
        if progress is not None:
            progress(0, len(data))
        files = [
            output.write_file(tmp, "adapter_config.json", (json.dumps(adapter_config, indent=2) + "\n").encode()),
            output.write_file(tmp, "adapter_model.safetensors", data),
        ]
        if progress is not None:
            progress(len(data), len(data))
        output.write_manifest(
            tmp,
            files,
            kind="peft_adapter",
            base=base_dir,
            checkpoint=checkpoint_dir,
            lora_rank=rank,
            lora_alpha=alpha,
            tensors=len(tensors),
        )
    return MergeResult(
        path=str(out_dir),
        files=files,
        total_bytes=sum(f.size for f in files),
        tensors=len(tensors),
        merged_tensors=len(tensors),
        seconds=time.perf_counter() - started,
    )
