"""LoRA merge benchmark: wall time against `cp -r` of the same bytes, and peak RSS, at two model sizes.

    .venv/bin/python bench/merge.py [--layers 8,26] [--rank 16] [--repeat 3] [--out DIR] [--tmp-dir DIR] [--no-tunix]

For each size it writes a synthetic Gemma 4-shaped base into a temporary directory: the real Gemma 4
structure (5 sliding : 1 global layers, K = V global layers with their own head size and KV heads, the
262,144-token vocabulary) at width 2048, random bfloat16 weights written chunk by chunk as one
``model.safetensors`` (under 5 GB, as transformers would save it), plus a rank-16 LoRA on all seven
projections written with Orbax in the structure the trainer saves. The layer count sets the size:
8 layers is ~2.1 GB, 26 layers ~4.4 GB; the largest tensor (the embedding, 1.07 GB) is the same in
both, so a flat peak RSS shows memory does not grow with the model. Then, each in a fresh
subprocess after a ``sync``:

  * ``cp -r`` of the base directory and a ``sync`` (the floor: the same bytes read and written to
    disk, nothing computed),
  * ``merge_lora`` into 2 GB shards, its peak RSS from ``ru_maxrss``. The merge returns with its
    files on disk (it fsyncs them before renaming the output into place), so it is compared with
    cp + sync; cp alone, whose bytes are still in the page cache when it returns, is shown too,
  * Tunix's own ``safetensors_saver.save_lora_merged_model_as_safetensors`` on the same base, with
    Tunix's Gemma 3 callbacks (the closest it has: there is no Gemma 4 wrapper); it needs the LoRA model
    in memory, so it loads it first (through Tunix's loader and Qwix, as ``verify_merged`` does) and
    its time and peak RSS are taken over the save alone (peak reset with /proc/self/clear_refs).

Goals: merge wall time <= 2.0x cp + sync; merge peak RSS <= 2x the largest tensor + 300 MB. The script
reports; it does not assert. The generated files are deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

GOAL_RATIO = 2.0
GOAL_RSS_EXTRA_MB = 300
MB = 1024 * 1024
VOCAB = 262_144
SHARD_SIZE = 2 * 10**9
ALPHA = 32.0
WIDTH = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_attention_heads": 8,
    "head_dim": 256,
    "num_key_value_heads": 4,
    "global_head_dim": 512,
    "num_global_key_value_heads": 2,
    "attention_k_eq_v": True,
    "sliding_window": 1024,
    "final_logit_softcapping": 30.0,
}

# ---------------------------------------------------------------------------------------------
# the synthetic model


def synthetic_config(layers: int) -> dict:
    """A bfloat16 Gemma4ForCausalLM config.json: Gemma 4 31B's structure at width 2048."""
    from worker.training import tiny

    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    return {**tiny.tiny_config_json(VOCAB, "bfloat16"), **WIDTH, "num_hidden_layers": layers, "layer_types": types}


def write_base(dest: Path, config: dict, seed: int = 0) -> dict:
    """config.json, generation_config.json and one model.safetensors of random bfloat16 weights,
    generated and written 16 MB at a time."""
    import ml_dtypes

    from worker.merge.safetensors_io import TensorInfo, encode_header
    from worker.training import tiny

    dest.mkdir(parents=True)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    (dest / "generation_config.json").write_text(json.dumps({"bos_token_id": 2, "eos_token_id": 1}))
    shapes = tiny.hf_tensor_shapes(config)
    infos = [TensorInfo(n, "BF16", s, "", 0, int(np.prod(s)) * 2) for n, s in shapes.items()]
    rng = np.random.default_rng(seed)
    chunk = 8 * MB  # values
    with open(dest / "model.safetensors", "wb") as f:
        f.write(encode_header(infos, {"format": "pt"}))
        for t in infos:
            left = t.nbytes // 2
            while left:
                n = min(chunk, left)
                f.write((rng.standard_normal(n, np.float32) * 0.02).astype(ml_dtypes.bfloat16).tobytes())
                left -= n
    return {"bytes": sum(t.nbytes for t in infos), "tensors": len(infos), "largest": max(t.nbytes for t in infos)}


def write_lora(step_dir: Path, config: dict, rank: int, seed: int = 1) -> int:
    """``<step_dir>/model_params``: a random rank-``rank`` LoRA on every projection, saved by Orbax in the
    structure Tunix's trainer saves (``layers/<i>/<attn|mlp>/<module>/<w|kernel>_lora_<a|b>/value``)."""
    import orbax.checkpoint as ocp

    from worker.merge.mapping import projections
    from worker.training import models

    cfg = models.model_config_from_hf(config)
    rng = np.random.default_rng(seed)
    d, f, n = cfg.embed_dim, cfg.hidden_dim, cfg.num_heads
    tree: dict = {}
    count = 0
    for module in projections(cfg):
        layer, kind, name = int(module.split("/")[1]), module.split("/")[2], module.split("/")[3]
        glob = config["layer_types"][layer] == "full_attention"
        h = cfg.global_key_size if glob else cfg.head_dim
        k = cfg.num_global_kv_heads if glob else cfg.num_kv_heads
        a_shape, b_shape = {
            "q_einsum": ((d, rank), (rank, n, h)),
            "kv_einsum": ((d, rank), (rank, 2, k, h)),
            "k_einsum": ((d, rank), (rank, k, h)),
            "attn_vec_einsum": ((n, h, rank), (rank, d)),
            "gate_proj": ((d, rank), (rank, f)),
            "up_proj": ((d, rank), (rank, f)),
            "down_proj": ((f, rank), (rank, d)),
        }[name]
        w = "kernel" if kind == "mlp" else "w"
        node = tree.setdefault("layers", {}).setdefault(str(layer), {}).setdefault(kind, {}).setdefault(name, {})
        node[f"{w}_lora_a"] = {"value": (rng.standard_normal(a_shape, np.float32) * 0.02)}
        node[f"{w}_lora_b"] = {"value": (rng.standard_normal(b_shape, np.float32) * 0.01)}
        count += int(np.prod(a_shape) + np.prod(b_shape))
    step_dir.mkdir(parents=True)
    ocp.PyTreeCheckpointer().save(step_dir / "model_params", tree)
    return count


# ---------------------------------------------------------------------------------------------
# child processes


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _rss_now_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB


def _child_merge(base: str, ckpt: str, out: str, rank: int) -> dict:
    from worker.merge import merge_lora

    rss_import = _rss_now_mb()
    calls = []
    t0 = time.perf_counter()
    result = merge_lora(
        base, ckpt, out, rank=rank, alpha=ALPHA, shard_size=SHARD_SIZE, progress=lambda done, total: calls.append(done)
    )
    return {
        "seconds": time.perf_counter() - t0,
        "peak_rss_mb": _peak_rss_mb(),
        "rss_after_import_mb": rss_import,
        "files": [f.path for f in result.files],
        "progress_calls": len(calls),
    }


def _child_tunix(base: str, ckpt: str, out: str, rank: int) -> dict:
    """Tunix's merged-safetensors saver with its Gemma 3 callbacks (k/v split of the fused kv LoRA,
    HF names, transposes), on the LoRA model it needs in memory."""
    from tunix.models import safetensors_saver
    from tunix.models.gemma3 import params as gemma3

    from worker.merge import verify
    from worker.training import models

    t0 = time.perf_counter()
    model = verify.lora_model(
        base, ckpt, rank=rank, alpha=ALPHA, target_modules=models.HF_TARGET_MODULES, dtype="bfloat16"
    )
    load_s = time.perf_counter() - t0
    rss_model = _rss_now_mb()
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak-RSS mark: measure the save alone
        f.write("5")
    error = None
    t0 = time.perf_counter()
    try:
        safetensors_saver.save_lora_merged_model_as_safetensors(
            local_model_path=base,
            output_dir=out,
            lora_model=model,
            rank=rank,
            alpha=ALPHA,
            state_key_transform_fn=gemma3._gemma3_state_key_to_safetensors_key,
            custom_layer_extractor_fn=gemma3._extract_gemma3_lora_layers,
            transpose_rules=gemma3._GEMMA3_HUGGINGFACE_TRANSPOSE_RULES,
        )
    except Exception as exc:  # reported, not raised: the point is what it does
        error = f"{type(exc).__name__}: {str(exc)[:300]}"
    seconds = time.perf_counter() - t0
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))
    return {"seconds": seconds, "peak_rss_mb": hwm, "rss_with_model_mb": rss_model, "load_s": load_s, "error": error}


def run_child(mode: str, *args: str) -> dict:
    subprocess.run(["sync"], check=True)
    out = subprocess.run(
        [sys.executable, __file__, f"--_child-{mode}", *args], capture_output=True, text=True, cwd=ROOT
    )
    if out.returncode:
        raise RuntimeError(f"{mode} child failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def sync() -> float:
    """Flush dirty pages to disk; its duration is what writing the last output to disk still took."""
    t0 = time.perf_counter()
    subprocess.run(["sync"], check=True)
    return time.perf_counter() - t0


def time_cp(src: Path, dst: Path) -> dict:
    sync()
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    return {"seconds": time.perf_counter() - t0, "flush_s": sync()}


def check_merge(base: Path, out: Path) -> str:
    """A spot check that the merge wrote what it should: same tensor names and shapes, the index
    covers every tensor once, an untouched tensor byte-identical."""
    from worker.merge.merge import open_checkpoint

    a, b = open_checkpoint(str(base)), open_checkpoint(str(out))
    index_file = out / "model.safetensors.index.json"
    if index_file.exists():
        index = json.loads(index_file.read_text())["weight_map"]
    else:
        index = dict.fromkeys(b.shapes, "model.safetensors")
    ok = a.shapes == b.shapes and set(index) == set(b.shapes)
    with open(base / "model.safetensors", "rb") as f, open(out / index["model.norm.weight"], "rb") as g:
        src = next(t for t in a.tensors if t.name == "model.norm.weight")
        dst = next(t for t in b.tensors if t.name == "model.norm.weight")
        f.seek(src.offset)
        g.seek(dst.offset)
        ok = ok and f.read(src.nbytes) == g.read(dst.nbytes)
    return "ok" if ok else "MISMATCH"


# ---------------------------------------------------------------------------------------------


def bench_size(tmp: Path, layers: int, rank: int, repeat: int, tunix: bool) -> dict:
    root = tmp / f"l{layers}"
    config = synthetic_config(layers)
    t0 = time.perf_counter()
    info = write_base(root / "base", config)
    lora_params = write_lora(root / "run" / "checkpoints" / "1", config, rank)
    print(
        f"{layers} layers: wrote {info['bytes'] / 1e9:.2f} GB base ({info['tensors']} tensors, largest "
        f"{info['largest'] / MB:.0f} MB) + rank-{rank} LoRA ({lora_params / 1e6:.1f}M params) in "
        f"{time.perf_counter() - t0:.0f}s",
        flush=True,
    )
    base, ckpt = root / "base", root / "run" / "checkpoints" / "1"
    cps, merges = [], []
    for i in range(repeat):
        cps.append(time_cp(base, root / "cp"))
        shutil.rmtree(root / "cp")
        merges.append(run_child("merge", str(base), str(ckpt), str(root / "merged"), str(rank)))
        merges[-1]["flush_s"] = sync()
        check = check_merge(base, root / "merged")
        shutil.rmtree(root / "merged")
        print(
            f"  try {i + 1}: cp {cps[-1]['seconds']:.1f}s (+{cps[-1]['flush_s']:.1f}s to disk), "
            f"merge {merges[-1]['seconds']:.1f}s (+{merges[-1]['flush_s']:.1f}s to disk), {check}",
            flush=True,
        )
    result = {
        "layers": layers,
        "bytes": info["bytes"],
        "largest_tensor_bytes": info["largest"],
        "lora_params": lora_params,
        "cp_s": min(c["seconds"] for c in cps),
        "merge_s": min(m["seconds"] for m in merges),
        "cp_to_disk_s": min(c["seconds"] + c["flush_s"] for c in cps),
        "merge_to_disk_s": min(m["seconds"] + m["flush_s"] for m in merges),
        "merge_peak_rss_mb": max(m["peak_rss_mb"] for m in merges),
        "merge_rss_after_import_mb": merges[0]["rss_after_import_mb"],
        "merge_files": merges[0]["files"],
        "progress_calls": merges[0]["progress_calls"],
        "check": check,
    }
    if tunix:
        result["tunix"] = run_child("tunix", str(base), str(ckpt), str(root / "tunix-merged"), str(rank))
        shutil.rmtree(root / "tunix-merged", ignore_errors=True)
        print(f"  tunix: {result['tunix']}", flush=True)
    shutil.rmtree(root)
    return result


def print_table(results: list[dict]) -> None:
    head = (
        f"{'size GB':>7} {'cp+sync s':>9} {'merge s':>7} {'ratio':>5} {'cp alone s':>10} {'ratio':>5} "
        f"{'peak RSS MB':>11} {'goal RSS MB':>11} {'RSS@import':>10} {'tunix s':>7} {'/cp':>5} "
        f"{'tunix RSS MB':>12}  goals"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        ratio = r["merge_to_disk_s"] / r["cp_to_disk_s"]
        goal_rss = 2 * r["largest_tensor_bytes"] / MB + GOAL_RSS_EXTRA_MB
        goals = [
            "time ok" if ratio <= GOAL_RATIO else f"time > {GOAL_RATIO}x",
            "rss ok" if r["merge_peak_rss_mb"] <= goal_rss else "rss over",
        ]
        t = r.get("tunix")
        tunix = (
            f"{t['seconds']:7.1f} {t['seconds'] / r['cp_s']:5.1f} {t['peak_rss_mb']:12.0f}"
            if t and not t["error"]
            else f"{'failed' if t else '-':>7} {'':>5} {'':>12}"
        )
        print(
            f"{r['bytes'] / 1e9:7.2f} {r['cp_to_disk_s']:9.1f} {r['merge_to_disk_s']:7.1f} {ratio:5.2f} "
            f"{r['cp_s']:10.1f} {r['merge_to_disk_s'] / r['cp_s']:5.2f} "
            f"{r['merge_peak_rss_mb']:11.0f} {goal_rss:11.0f} {r['merge_rss_after_import_mb']:10.0f} {tunix}  "
            f"{', '.join(goals)}"
        )
    if len(results) >= 2:
        a, b = results[0], results[-1]
        print(
            f"merge peak RSS {a['bytes'] / 1e9:.1f} GB -> {b['bytes'] / 1e9:.1f} GB: "
            f"{b['merge_peak_rss_mb'] - a['merge_peak_rss_mb']:+.0f} MB"
        )
    for r in results:
        t = r.get("tunix")
        if t:
            print(
                f"tunix at {r['bytes'] / 1e9:.1f} GB: LoRA model loaded in {t['load_s']:.0f}s, RSS with the model "
                f"{t['rss_with_model_mb']:.0f} MB before the save" + (f"; error: {t['error']}" if t["error"] else "")
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="8,26", help="layer counts of the synthetic models (8: ~2.1 GB, 26: ~4.4 GB)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement; the fastest is reported")
    ap.add_argument("--no-tunix", action="store_true", help="skip Tunix's own saver")
    ap.add_argument("--out", type=Path, default=None, help="write merge.json into this directory")
    ap.add_argument("--tmp-dir", type=Path, default=None, help="where to write the models (default: system temp)")
    ap.add_argument("--_child-merge", dest="child_merge", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--_child-tunix", dest="child_tunix", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child_merge:
        base, ckpt, out, rank = args.child_merge
        print(json.dumps(_child_merge(base, ckpt, out, int(rank))))
        return 0
    if args.child_tunix:
        base, ckpt, out, rank = args.child_tunix
        print(json.dumps(_child_tunix(base, ckpt, out, int(rank))))
        return 0

    tmp = Path(tempfile.mkdtemp(prefix="tunedeck-bench-merge-", dir=args.tmp_dir))
    try:
        results = [bench_size(tmp, int(n), args.rank, args.repeat, not args.no_tunix) for n in args.layers.split(",")]
        print()
        print_table(results)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "merge.json").write_text(json.dumps(results, indent=2))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
