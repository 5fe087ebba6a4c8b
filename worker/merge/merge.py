"""A LoRA checkpoint merged into its base's Hugging Face safetensors (streamed), or exported as a PEFT adapter.

The merge reads the base through fsspec, tensor by tensor in chunks of rows, adds the LoRA delta in
float32 and casts back to the base dtype, and streams the result into HF-named shards whose headers
are written first (every shape and dtype is known from the base's headers, so every tensor's place in
its shard is too). Memory stays flat in the model size: a chunk buffer per core, the LoRA factors and
the libraries.

Speed comes from the CPU caches and the cores: the tensors are cut into pieces that every core takes in
turn, and a chunk of a piece is small enough (about 1 MB) to be read, merged, cast and written at its
place in the shard while it stays in the core's cache (numpy's matmul and casts, hashlib and file I/O
release the GIL; scipy's BLAS wrappers do not, so the products go through numpy). Each shard is hashed
by a thread of its own, which follows the shard's written prefix (sha256 is sequential; the rest is
not). Tensors without a LoRA delta
(embedding, norms, a vision or audio tower, anything else) are copied byte for byte. Every other file
of the base (config.json, generation_config.json, tokenizer files, chat template) is copied, except
weights in any format and weight indexes: a base's stale index must never describe the new shards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import itertools
import json
import os
import posixpath
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
from threadpoolctl import threadpool_limits

from worker.merge import mapping, output
from worker.merge.lora import load_lora
from worker.merge.output import FileEntry
from worker.merge.safetensors_io import FLOAT_DTYPES, TensorInfo, encode_header, read_header
from worker.training import models

# Float32 working size of one chunk of rows: it and the chunk's bytes in the base dtype stay in the CPU's
# cache between read, merge, hash and write (bench/merge.py, 4.4 GB base on 2 cores: 16 MB chunks handed
# between threads took 3.4-3.6x cp's time; these chunks, one thread per shard, 2.6x).
CHUNK_BYTES = 1024 * 1024
# The unit of work a core takes: a run of chunks of one tensor (a 1 GB embedding is 32 of them).
PIECE_BYTES = 32 * 1024 * 1024
FLUSH_BYTES = 64 * 1024 * 1024  # a shard's hashed bytes are sent to disk in steps of this size
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
    merger = _Merger(base, loras, alpha / rank, max(CHUNK_BYTES, widest))

    # One BLAS thread per product: the shards are our threads, and the rank-r products are small.
    with output.staging(out_dir) as tmp, threadpool_limits(1, user_api="blas"), _no_gc():
        reporter = _Reporter(progress, total)
        reporter.add(0)
        files = merger.write_shards(tmp, names, headers, groups, reporter)
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


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """The cyclic garbage collector off while the shards are written. Every chunk makes a few small
    objects (views, arrays), which trigger collections; in a process that imported JAX, each full one
    walks millions of objects: 9% of a merge's CPU time went there. The merge makes no cycles."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class _Reporter:
    """Sums the bytes written by the shard threads; calls ``progress`` at most every PROGRESS_EVERY_S,
    and once at the end."""

    def __init__(self, progress: Progress | None, total: int) -> None:
        self.progress = progress
        self.total = total
        self.written = 0
        self.last = 0.0
        self.lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        with self.lock:
            self.written += nbytes
            now = time.monotonic()
            if self.progress is None or now - self.last < PROGRESS_EVERY_S:
                return
            self.last = now
            self.progress(self.written, self.total)

    def done(self) -> None:
        if self.progress is not None:
            self.progress(self.total, self.total)


class _Merger:
    """Writes the shards with every core: the tensors are cut into pieces (a run of chunks of one
    tensor), which the worker threads take in turn, round robin over the shards; a chunk is read into
    the worker's buffer, gets its LoRA delta and is written at its place in its shard, and the buffer
    is reused for the next. Each shard has a thread of its own that hashes the file as its written
    prefix grows (reading it back from the page cache) and fsyncs it once complete."""

    def __init__(self, base: Checkpoint, loras: dict[str, mapping.HFLora], scale: float, chunk: int) -> None:
        self.base = base
        # per merged tensor: A (r, in) and B (out, r) scaled by alpha / r, contiguous float32
        self.factors = {
            name: (np.ascontiguousarray(f.a, np.float32), np.ascontiguousarray(f.b, np.float32) * np.float32(scale))
            for name, f in loras.items()
        }
        self.chunk = chunk
        self.failed = threading.Event()  # a thread failed: the others stop

    def write_shards(
        self, root: Path, names: list[str], headers: list[bytes], groups: list[list[TensorInfo]], report: _Reporter
    ) -> list[FileEntry]:
        shards: list[_Shard] = []
        try:
            for n, h, g in zip(names, headers, groups, strict=True):
                shards.append(_Shard(root / n, h, sum(t.nbytes for t in g)))
            report.add(sum(len(h) for h in headers))
            return self._write(shards, headers, groups, report)
        finally:
            for s in shards:
                s.close()

    def _write(
        self, shards: list[_Shard], headers: list[bytes], groups: list[list[TensorInfo]], report: _Reporter
    ) -> list[FileEntry]:
        pieces = [self._pieces(s, len(h), g) for s, h, g in zip(shards, headers, groups, strict=True)]
        todo = iter([p for batch in itertools.zip_longest(*pieces) for p in batch if p is not None])
        take = threading.Lock()
        workers = len(os.sched_getaffinity(0))
        with ThreadPoolExecutor(workers + len(shards), thread_name_prefix="merge") as pool:
            jobs: list[Future[Any]] = [pool.submit(self._work, todo, take, report) for _ in range(workers)]
            hashes = [pool.submit(s.hash, self.failed) for s in shards]
            wait(jobs + hashes, return_when=FIRST_EXCEPTION)
            if any(j.done() and j.exception() for j in jobs + hashes):
                self.failed.set()
                for s in shards:
                    s.wake()
            for j in jobs:
                j.result()  # the first failure, if any, raises here
            return [h.result() for h in hashes]

    def _pieces(self, shard: _Shard, start: int, tensors: list[TensorInfo]) -> list[_Piece]:
        """``tensors``' bytes in pieces of about PIECE_BYTES (whole rows where a LoRA delta is added),
        each with its place in the shard."""
        pieces = []
        for t in tensors:
            step = PIECE_BYTES
            if t.name in self.factors:
                row = t.nbytes // t.shape[0]
                step = max(1, PIECE_BYTES // row) * row
            for begin in range(0, t.nbytes, step):
                pieces.append(_Piece(shard, t, begin, min(begin + step, t.nbytes), start + begin))
            start += t.nbytes
        return pieces

    def _work(self, todo: Iterator[_Piece], take: threading.Lock, report: _Reporter) -> None:
        buf = bytearray(self.chunk)
        work = np.empty(self.chunk // 4, np.float32)
        opened: dict = {}
        with contextlib.ExitStack() as files:
            while not self.failed.is_set():
                with take:
                    piece = next(todo, None)
                if piece is None:
                    return
                t = piece.tensor
                if t.file not in opened:
                    opened[t.file] = files.enter_context(self.base.fs.open(self.base.path(t.file), "rb"))
                at = piece.out
                for view in self._chunks(opened[t.file], piece, buf, work):
                    if self.failed.is_set():
                        return
                    while view:
                        written = os.pwrite(piece.shard.fd, view, at)
                        view, at = view[written:], at + written
                        report.add(written)
                piece.shard.wrote(piece.out, at)

    def _chunks(self, f, piece: _Piece, buf: bytearray, work: np.ndarray) -> Iterator[memoryview]:
        """The piece's bytes as merged, chunk by chunk, each a view of ``buf`` (valid until the next)."""
        t = piece.tensor
        f.seek(t.offset + piece.start)
        factors = self.factors.get(t.name)
        if factors is None:
            for start in range(piece.start, piece.stop, len(buf)):
                view = memoryview(buf)[: min(len(buf), piece.stop - start)]
                self._read(f, view, t)
                yield view
            return
        dtype = FLOAT_DTYPES[t.dtype]
        in_dim = t.shape[1]
        row = in_dim * dtype.itemsize
        a, b = factors
        rows = max(1, len(buf) // (in_dim * 4))
        stop = piece.stop // row
        for r0 in range(piece.start // row, stop, rows):
            n = min(rows, stop - r0)
            view = memoryview(buf)[: n * row]
            self._read(f, view, t)
            weight = np.frombuffer(buf, dtype, n * in_dim).reshape(n, in_dim)
            delta = work[: n * in_dim].reshape(n, in_dim)
            np.matmul(b[r0 : r0 + n], a, out=delta)
            np.add(weight, delta, out=delta)  # in float32, whatever the base dtype
            np.copyto(weight, delta, casting="unsafe")
            yield view

    def _read(self, f, view: memoryview, t: TensorInfo) -> None:
        done = 0
        while done < len(view):
            n = f.readinto(view[done:])
            if not n:
                raise ValueError(f"{self.base.url}/{t.file}: ends inside tensor {t.name}")
            done += n


@dataclasses.dataclass
class _Piece:
    shard: _Shard
    tensor: TensorInfo
    start: int  # byte range of the tensor
    stop: int
    out: int  # where byte ``start`` goes in the shard


class _Shard:
    """One output file, written piece by piece at any offset by any thread; ``hash`` follows the
    contiguous written prefix."""

    def __init__(self, path: Path, header: bytes, data_bytes: int) -> None:
        self.path = path
        self.size = len(header) + data_bytes
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.pwrite(self.fd, header, 0)
        self.prefix = len(header)  # bytes 0..prefix are written
        self.hashed = 0  # bytes 0..hashed are hashed (and may go to disk)
        self.ahead: dict[int, int] = {}  # start -> end of pieces written beyond the prefix
        self.cond = threading.Condition()

    def wrote(self, start: int, end: int) -> None:
        with self.cond:
            self.ahead[start] = end
            while self.prefix in self.ahead:
                self.prefix = self.ahead.pop(self.prefix)
            self.cond.notify_all()

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def hash(self, failed: threading.Event) -> FileEntry:
        """sha256 of the file, read back as its prefix is written; then fsync() it, so it is on disk while
        the other shards are still being written. The hashed bytes go to disk as the hash proceeds."""
        digest = hashlib.sha256()
        buf = memoryview(bytearray(CHUNK_BYTES))
        done = 0
        more, last = threading.Event(), threading.Event()
        flusher = threading.Thread(target=self._flush_behind, args=(more, last), name=f"flush-{self.path.name}")
        flusher.start()
        try:
            with open(self.path, "rb", buffering=0) as f:
                while done < self.size:
                    with self.cond:
                        while self.prefix == done and not failed.is_set():
                            self.cond.wait()
                        if failed.is_set():
                            raise RuntimeError("stopped: another part of the merge failed")
                        ready = self.prefix
                    while done < ready:
                        n = os.preadv(f.fileno(), [buf[: min(len(buf), ready - done)]], done)
                        digest.update(buf[:n])
                        done += n
                        if done - self.hashed >= FLUSH_BYTES:
                            self.hashed = done
                            more.set()
        finally:
            last.set()
            more.set()
            flusher.join()
        os.fsync(self.fd)
        return FileEntry(self.path.name, self.size, digest.hexdigest())

    def _flush_behind(self, more: threading.Event, last: threading.Event) -> None:
        """fdatasync() the file whenever more of it is hashed, until the hash ends: a disk that buffers
        writes then flushes them while the merge goes on, not all in the final fsync."""
        flushed = 0
        while True:
            more.wait()
            if last.is_set():
                return
            more.clear()
            hashed = self.hashed
            # Linux starts writing the dirty pages back on this advice (and drops them from the page cache
            # once written); fdatasync waits for them and the disk's cache.
            os.posix_fadvise(self.fd, flushed, hashed - flushed, os.POSIX_FADV_DONTNEED)
            os.fdatasync(self.fd)
            flushed = hashed

    def close(self) -> None:
        os.close(self.fd)


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
