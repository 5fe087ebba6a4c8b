"""Merging a really trained LoRA into the tiny model: the merged checkpoint computes what the LoRA
model computes (through Tunix and through transformers), and its files are exactly what they should be."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import ml_dtypes
import numpy as np

from tests.merge.checkpoints import read_tensors, write_sharded
from worker.chat import ChatFormat
from worker.merge import load_lora, merge_lora, verify_merged
from worker.merge import verify as verify_lib
from worker.training import models

VISION = "model.vision_tower.patch_embedder.weight"


def check_manifest(out: Path, result) -> dict:
    """manifest.json lists every other file of ``out`` once, with its real size and sha256."""
    manifest = json.loads((out / "manifest.json").read_text())
    listed = {f["path"]: f for f in manifest["files"]}
    assert sorted(listed) == sorted(p.name for p in out.iterdir() if p.name != "manifest.json")
    for name, entry in listed.items():
        data = (out / name).read_bytes()
        assert entry == {"path": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    assert [f.path for f in result.files] == [f["path"] for f in manifest["files"]]
    assert manifest["total_bytes"] == result.total_bytes == sum(f["size"] for f in manifest["files"])
    return manifest


def greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy decoding over full forward passes (a causal mask hides the not-yet-written tail)."""
    import jax.numpy as jnp
    from flax import nnx

    tokens = np.zeros((1, len(prompt) + steps), np.int32)
    tokens[0, : len(prompt)] = prompt
    mask = jnp.tril(jnp.ones((tokens.shape[1],) * 2, bool))[None]
    forward = nnx.jit(lambda m, t: m(t, None, None, mask)[0])  # one program, not one per op
    for i in range(len(prompt), tokens.shape[1]):
        logits = forward(model, jnp.asarray(tokens))
        tokens[0, i] = int(np.argmax(logits[0, i - 1]))
    return tokens[0, len(prompt) :].tolist()


def chat_prompt(model_dir: str, question: str) -> list[int]:
    from worker.chat import ChatFormat

    return ChatFormat(model_dir).prompt_ids([{"role": "user", "content": question}])


def test_f32_merge_computes_what_the_lora_model_computes(lora_run, lora_model, tmp_path):
    calls = []
    out = tmp_path / "merged"
    result = merge_lora(
        lora_run.base_dir, lora_run.checkpoint, str(out), **lora_run.lora, progress=lambda d, t: calls.append((d, t))
    )

    # files: one model.safetensors (no index), everything else of the base byte for byte, a manifest
    base = Path(lora_run.base_dir)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [p.name for p in base.iterdir() if p.name != "model.safetensors"] + ["model.safetensors", "manifest.json"]
    )
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (base / name).read_bytes(), name
    manifest = check_manifest(out, result)
    assert manifest["kind"] == "merged_model" and manifest["merged_tensors"] == 13  # 7 + 6 (K=V: no v_proj)
    assert (result.tensors, result.merged_tensors) == (29, 13)
    before, after = read_tensors(base), read_tensors(out)
    changed = {n for n in before if before[n] != after[n]}
    assert changed == {n for n in before if n.endswith("proj.weight")}  # norms, scalars, embedding untouched
    # progress: from 0 to the bytes of the shard, in order, ending with (total, total)
    total = (out / "model.safetensors").stat().st_size
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)

    # Tunix: the merged checkpoint vs the base with its LoRA applied by Qwix
    report = verify_merged(
        str(out), lora_run.base_dir, lora_run.checkpoint, **lora_run.lora, target_modules=lora_run.targets
    )
    assert report["passed"], report
    assert report["max_abs_diff"] < 1e-4 and report["argmax_agreement"] == 1.0 and report["dtype"] == "float32"

    config = models.resolve_config(lora_run.base_dir)
    merged_model = models.load_base_model(out, config)
    base_model = models.load_base_model(lora_run.base_dir, config)
    prompts = verify_lib.default_prompts(config.num_embed, 2)
    effect = max(
        float(np.abs(a - b).max())
        for a, b in zip(verify_lib.logits(lora_model, prompts), verify_lib.logits(base_model, prompts), strict=True)
    )
    assert effect > 1.0, "the LoRA barely changes the model: the test would prove nothing"
    for question in ("What is the capital of France?", "Which city is the capital of Japan?"):
        prompt = chat_prompt(lora_run.base_dir, question)
        assert greedy(merged_model, prompt, 8) == greedy(lora_model, prompt, 8), question


def test_merged_weights_are_the_base_plus_the_qwix_delta_in_tunix_layout(lora_run, merged):
    """Checked in Tunix's own layout, as its loader reads the merged HF tensors (independent of the
    mapping the merge uses): W' = W + einsum(A, B) * alpha / r, the product Qwix's LoRA einsum adds;
    every other parameter unchanged."""
    from flax import nnx

    config = models.resolve_config(lora_run.base_dir)
    base = flat(nnx.to_pure_dict(nnx.state(models.load_base_model(lora_run.base_dir, config), nnx.Param)))
    out = flat(nnx.to_pure_dict(nnx.state(models.load_base_model(merged, config), nnx.Param)))
    products = {
        "q_einsum": "dr,rnh->ndh",
        "kv_einsum": "dr,rckh->ckdh",
        "k_einsum": "dr,rkh->kdh",
        "attn_vec_einsum": "nhr,rd->nhd",
    }
    lora = load_lora(lora_run.checkpoint)
    assert len(lora) == 12 and sorted(base) == sorted(out)
    for path, weight in base.items():
        module = path.rsplit("/", 1)[0]
        if module in lora:
            a, b = lora[module]
            product = products.get(module.rsplit("/", 1)[1], "ir,ro->io")
            expected = weight + np.einsum(product, a, b) * (lora_run.alpha / lora_run.rank)
            np.testing.assert_allclose(out[path], expected, rtol=0, atol=1e-6, err_msg=path)
        else:
            assert np.array_equal(out[path], weight), path


def flat(tree, prefix: str = "") -> dict[str, np.ndarray]:
    if not isinstance(tree, dict):
        return {prefix: np.asarray(tree)}
    return {k: v for key, sub in tree.items() for k, v in flat(sub, f"{prefix}/{key}" if prefix else str(key)).items()}


def test_transformers_loads_the_merge_and_matches_the_lora_model(lora_run, lora_model, merged):
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == "Gemma4ForConditionalGeneration"  # the release's layout, as tiny-gemma4's
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    config = models.resolve_config(lora_run.base_dir)
    # text tokens only: transformers' Gemma4ForConditionalGeneration treats the media placeholders apart
    special = set(ChatFormat(lora_run.base_dir).added.values())
    rng = np.random.default_rng(0)
    prompts = [[2, *(int(t) for t in rng.permutation(config.num_embed) if t not in special)][:20] for _ in range(2)]
    expected = np.stack(verify_lib.logits(lora_model, prompts))
    with torch.no_grad():
        got = model(torch.tensor(prompts)).logits.numpy()
    assert np.abs(got - expected).max() < 1e-4


def test_bf16_multimodal_base_in_shards_with_a_vision_tower(lora_run, tmp_path):
    """Google's layout (model.language_model.*), bfloat16, 3 shards + index, a vision tensor; the merge
    is written in shards of its own, with a fresh index and nothing stale from the base."""
    from worker.training import tiny

    mm = tiny.create_tiny_gemma4(tmp_path / "mm", dtype="bfloat16", layout="multimodal")
    vision = np.random.default_rng(3).standard_normal((48, 64)).astype(ml_dtypes.bfloat16)
    base = write_sharded(mm, tmp_path / "base", 3, {VISION: vision})
    (base / "pytorch_model.bin").write_bytes(b"unmerged weights in another format")  # must not be carried over
    out = tmp_path / "merged"
    result = merge_lora(str(base), lora_run.checkpoint, str(out), **lora_run.lora, shard_size=100_000)

    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) >= 3 and shards == [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)
    ]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    before, after = read_tensors(base), read_tensors(out)
    assert sorted(index["weight_map"]) == sorted(after) == sorted(before)  # every tensor, exactly once
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(len(b) for b in after.values())
    assert not (out / "model.safetensors").exists() and not (out / "pytorch_model.bin").exists()
    assert not list(out.glob("*.tmp*")) and not list(tmp_path.glob(".merged.tmp-*"))
    check_manifest(out, result)
    assert (out / "config.json").read_bytes() == (base / "config.json").read_bytes()

    assert after[VISION] == before[VISION] == vision.tobytes()
    changed = {n for n in before if before[n] != after[n]}
    assert changed == {n for n in before if n.startswith("model.language_model.layers.") and n.endswith("proj.weight")}
    assert result.merged_tensors == 13 and result.tensors == 30

    report = verify_merged(str(out), str(base), lora_run.checkpoint, **lora_run.lora, target_modules=lora_run.targets)
    assert report["passed"], report
    assert report["dtype"] == "bfloat16" and report["tolerance"] > 1e-4
    assert report["argmax_agreement"] >= 0.95

    # the same base merged into one file: no index at all (the base's would describe files that are gone)
    single = tmp_path / "single"
    merge_lora(str(base), lora_run.checkpoint, str(single), **lora_run.lora)
    assert sorted(p.name for p in single.glob("*.safetensors*")) == ["model.safetensors"]
    assert read_tensors(single) == after


def test_a_url_base_gives_the_same_bytes(lora_run, merged, tmp_path):
    """The base is opened through fsspec: a file:// URL merges to the same files (and merging is
    deterministic)."""
    out = tmp_path / "again"
    result = merge_lora("file://" + lora_run.base_dir, lora_run.checkpoint, str(out), **lora_run.lora)
    first = json.loads((merged / "manifest.json").read_text())["files"]
    assert [(f.path, f.size, f.sha256) for f in result.files] == [(f["path"], f["size"], f["sha256"]) for f in first]


def test_the_float32_bound_scales_with_the_logits():
    """A real run (the demo data, 300 steps at learning rate 0.01, rank 16) merged exactly, yet its merge
    was refused: its logits reach 8.8 and the two float32 summation orders differ there by 2.5e-4, over a
    fixed bound of 1e-4. The bound is now a share of the largest logit: that merge passes, and what a
    mis-mapped or missing LoRA does (differences of the order of the logits) is still refused."""
    assert verify_lib.tolerance_for("float32", 8.81) > 2.5e-4
    assert verify_lib.tolerance_for("float32", 8.81) < 0.01  # far below a LoRA's whole effect (> 1 on the tiny model)
    assert verify_lib.tolerance_for("float32", 2.0) > 2e-5  # what the trained tiny LoRA measures at its logits
    assert verify_lib.tolerance_for("bfloat16", 8.0) == 1.0  # unchanged: 2^-3 of the largest logit
