"""Real Tunix + Qwix LoRA training of the tiny model on CPU: learning, metrics, phases, checkpoints,
LoRA application, refused specs, schedules, the chunked loss. Resume and stop: test_engine_resume.py;
a 4-device mesh: test_mesh.py."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import numpy as np
import pytest

from worker.training import engine

ROOT = Path(__file__).resolve().parents[2]
# On CPU there is no known peak (no "mfu") and JAX reports no device memory (no "memory_gb").
TRAIN_KEYS = {
    "loss",
    "perplexity",
    "grad_norm",
    "learning_rate",
    "step_time_s",
    "tokens_per_s",
    "tokens_per_s_per_chip",
    "host_rss_gb",
}


def ckpt_dirs(spec) -> list[int]:
    root = Path(spec.output_dir) / "checkpoints"
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit())


def test_learns_and_reports_every_step(Recorder, make_spec):
    spec = make_spec(
        max_steps=60,
        lr_schedule="cosine",
        warmup_steps=5,
        learning_rate=1e-2,
        eval_every_steps=20,
        checkpoint_every_steps=20,
        checkpoints_kept=2,
    )
    rep = Recorder()
    result = engine.train(spec, rep)

    assert result.final_step == 60 and not result.stopped_early and result.resumed_from_step is None
    assert rep.train_steps == list(range(1, 61))  # every step, once, in order
    for step, values in rep.train_metrics.items():
        assert set(values) == TRAIN_KEYS, step
        assert all(math.isfinite(v) for v in values.values())
        assert values["step_time_s"] > 0 and values["tokens_per_s"] > 0
        assert values["tokens_per_s_per_chip"] == values["tokens_per_s"]  # one CPU device
        assert 0.1 < values["host_rss_gb"] < 16
        assert values["perplexity"] == pytest.approx(math.exp(values["loss"]))
    losses = [rep.train_metrics[s]["loss"] for s in range(1, 61)]
    assert np.mean(losses[-5:]) < 0.7 * losses[0], losses
    lrs = [rep.train_metrics[s]["learning_rate"] for s in range(1, 61)]
    assert lrs[0] == pytest.approx(1e-2 / 5) and max(lrs) == pytest.approx(1e-2) and 0 < lrs[-1] < 1e-3

    # A tenth of the file's examples held out for validation, named by their records' lines.
    (stats,) = [
        ast.literal_eval(e[1].split(": ", 1)[1]) for e in rep.events if e[0] == "log" and "training file" in e[1]
    ]
    (held,) = [e[1] for e in rep.events if e[0] == "held_out"]
    assert len(held) == round(0.1 * stats["examples"]) and held == sorted(set(held))
    assert 1 <= held[0] and held[-1] <= stats["records"]

    evals = rep.eval_losses
    assert sorted(evals) == [0, 20, 40, 60] and evals[60] < 0.75 * evals[0]
    assert rep.checkpoints == [20, 40, 60]
    assert ckpt_dirs(spec) == [40, 60]  # checkpoints_kept=2
    # Each save says which steps are still on disk, so the run's list can drop the pruned ones.
    assert [e[3] for e in rep.events if e[0] == "checkpoint"] == [[20], [20, 40], [40, 60]]
    for step in (40, 60):
        assert {p.name for p in (Path(spec.output_dir) / "checkpoints" / str(step)).iterdir()} >= {
            "model_params",
            "optimizer_state",
        }

    phases = rep.phases
    first = {p: phases.index(p) for p in set(phases)}
    assert first["loading"] < first["compiling"] < first["evaluating"] < first["training"] < first["checkpointing"]
    # metrics for step k come before the checkpoint and the eval at k
    order = [(e[0], e[1]) for e in rep.events if e[0] in ("metrics", "checkpoint")]
    assert order.index(("metrics", 20)) < order.index(("checkpoint", 20))
    assert result.metrics["loss"] == losses[-1] and result.metrics["eval_loss"] == evals[60]
    assert result.metrics["trainable_params"] > 0 and result.metrics["tokens"] > 0
    assert any("applied LoRA" in line for line in rep.logs)


def test_lora_is_applied_by_one_compiled_call_with_qwixs_own_values(make_spec, tiny_model):
    """Qwix creates the LoRA params on a first forward pass. Run eagerly, that pass compiles each op on
    its own (about 170 programs, 6 s of every run's start on a CPU); the engine runs it through nnx.jit,
    and gets the values Qwix's own eager pass gives, to the bit."""
    import jax
    import qwix
    from flax import nnx
    from jax._src import dispatch, monitoring

    from worker.training import models

    spec = make_spec(lora_rank=4)
    config = models.resolve_config(tiny_model, "tiny-gemma4")
    base = models.load_base_model(tiny_model, config)
    lowered = []

    def count(event: str, _seconds: float, **_) -> None:
        if event == dispatch.JAXPR_TO_MLIR_MODULE_EVENT:  # one per program compiled (or read from a cache)
            lowered.append(event)

    jax.clear_caches()
    monitoring.register_event_duration_secs_listener(count)
    try:
        model, _ = engine.apply_lora(base, spec, models.RematConfig.NONE)
    finally:
        monitoring.unregister_event_duration_listener(count)
    assert len(lowered) <= 10, f"{len(lowered)} programs compiled to apply LoRA"

    provider = qwix.LoraProvider(
        module_path=models.lora_module_path(spec.target_modules), rank=spec.lora_rank, alpha=spec.lora_alpha
    )
    reference = qwix.apply_lora_to_model(base, provider, rngs=nnx.Rngs(spec.seed), **base.get_model_input())
    ours, theirs = nnx.state(model, nnx.LoRAParam), nnx.state(reference, nnx.LoRAParam)
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_apply_lora(make_spec, tiny_model):
    """LoRA params on every target (bf16 base -> float32 LoRA), remat set on every module after."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from worker.training import models

    config = models.resolve_config(tiny_model, "tiny-gemma4")
    base = models.load_base_model(tiny_model, config, dtype="bfloat16")
    model, n = engine.apply_lora(base, make_spec(dtype="bfloat16", lora_rank=4), models.RematConfig.BLOCK)
    state = nnx.state(model, nnx.LoRAParam)
    names = {"/".join(str(k.key) for k in path[:-1]) for path, _ in jax.tree_util.tree_leaves_with_path(state)}
    assert names == {
        f"layers/{i}/{m}_lora_{ab}"
        for i, attn in ((0, "attn/kv_einsum/w"), (1, "attn/k_einsum/w"))
        for m in (
            attn,
            "attn/q_einsum/w",
            "attn/attn_vec_einsum/w",
            "mlp/gate_proj/kernel",
            "mlp/up_proj/kernel",
            "mlp/down_proj/kernel",
        )
        for ab in "ab"
    }
    leaves = jax.tree.leaves(state)
    assert n == sum(x.size for x in leaves) == 13056  # rank 4 (26,112 at rank 8)
    assert all(x.dtype == jnp.float32 for x in leaves)
    assert model.layers[0].attn.q_einsum.w[...].dtype == jnp.bfloat16  # the base stays bf16
    configs = [
        m.config for _, m in nnx.iter_modules(model) if isinstance(getattr(m, "config", None), models.ModelConfig)
    ]
    assert len(configs) > 5 and all(c.remat_config == models.RematConfig.BLOCK for c in configs)
    tokens = jnp.ones((2, 8), jnp.int32)
    mask = jnp.tril(jnp.ones((8, 8), bool))[None].repeat(2, axis=0)
    logits, _ = nnx.jit(lambda m, x: m(x, None, None, mask))(model, tokens)
    assert logits.shape == (2, 8, config.num_embed) and bool(jnp.isfinite(logits).all())


def test_bad_specs_are_refused(Recorder, make_spec):
    with pytest.raises(NotImplementedError, match="QLoRA"):
        engine.train(make_spec(quantization="nf4"), Recorder())
    with pytest.raises(ValueError, match="mesh_tp=3"):
        engine.train(make_spec(mesh_tp=3), Recorder())
    with pytest.raises(ValueError, match=r"6 rows\) must divide over mesh_dp=2 x mesh_fsdp=2"):
        engine.train(make_spec(batch_size=6, mesh_dp=2, mesh_fsdp=2), Recorder())
    with pytest.raises(ValueError, match="unknown target"):
        engine.train(make_spec(target_modules=("lm_head",)), Recorder())
    with pytest.raises(ValueError, match="lr_schedule"):
        engine.train(make_spec(lr_schedule="step"), Recorder())


def test_lr_schedules():
    kw = {"peak": 1.0, "warmup": 4, "total": 20}
    const = [engine.lr_at(c, kind="constant", **kw) for c in range(20)]
    assert const[:4] == [0.25, 0.5, 0.75, 1.0] and const[4:] == [1.0] * 16
    for kind in ("linear", "cosine"):
        lrs = [float(engine.lr_at(c, kind=kind, **kw)) for c in range(20)]
        assert lrs[3] == 1.0 and all(a >= b for a, b in zip(lrs[3:], lrs[4:], strict=False)) and 0 < lrs[-1] < 0.1
    assert engine.lr_at(0, kind="cosine", peak=2.0, warmup=0, total=10) == pytest.approx(
        2.0 * 0.5 * (1 + math.cos(math.pi / 11))
    )


def test_runs_differing_in_learning_rate_warmup_or_length_share_one_compiled_update(make_spec):
    """The schedule's peak, warmup and length are data in the optimizer's state, not constants of its
    program: a run with another learning rate or step count (a sweep, the compare view's reruns) finds its
    compiled train step in the persistent cache. Each update is still Adam's, scaled by ``lr_at``, and the
    state holds the learning rate of the last update."""
    import jax
    import jax.numpy as jnp
    import optax

    params = {"w": jnp.ones((4, 4), jnp.float32)}
    grads = {"w": jnp.full((4, 4), 0.5, jnp.float32)}

    def program(spec, total):
        opt = engine.make_optimizer(spec, total)
        return jax.jit(opt.update).lower(grads, opt.init(params), params).as_text()

    for kind in ("constant", "cosine"):
        a = make_spec(lr_schedule=kind, learning_rate=1e-3, warmup_steps=0)
        b = make_spec(lr_schedule=kind, learning_rate=3e-2, warmup_steps=5)
        assert program(a, 30) == program(b, 1000), kind

    spec = make_spec(lr_schedule="cosine", learning_rate=2e-2, warmup_steps=3)
    opt, adam = engine.make_optimizer(spec, 12), optax.adam(1.0)
    state, adam_state = opt.init(params), adam.init(params)
    for count in range(12):
        clipped, _ = optax.clip_by_global_norm(engine.GRAD_CLIP_NORM).update(grads, None)
        direction, adam_state = adam.update(clipped, adam_state)
        updates, state = opt.update(grads, state, params)
        expected = engine.lr_at(count, kind="cosine", peak=2e-2, warmup=3, total=12)
        assert jnp.allclose(updates["w"], expected * direction["w"], rtol=1e-6), count
        assert float(state[-1].hyperparams["learning_rate"]) == pytest.approx(float(expected))


def test_demo_dataset_validates_ready(tmp_path):
    from app.datasets import demo
    from app.datasets.validation import iter_conversations, validate_file

    path = tmp_path / demo.DEMO_FILENAME
    path.write_bytes(demo.demo_dataset_jsonl())
    report = validate_file(path, demo.DEMO_FILENAME)
    assert report.ok and (report.file_type, report.format) == ("jsonl", "chat")
    assert 300 <= report.valid_rows == report.rows <= 400 and report.duplicate_count == 0
    convos = list(iter_conversations(path, demo.DEMO_FILENAME, file_type="jsonl", fmt="chat"))
    assert convos[0][-1]["content"].startswith("The capital of ")
    assert demo.demo_dataset_jsonl() == path.read_bytes()  # deterministic


def test_chunked_loss_trains_like_the_default_loss(Recorder, make_spec, tmp_path):
    """``loss_chunk_tokens`` switches the trainer to the chunked loss: the same losses, step by step."""
    losses = {}
    for chunk in (0, 48):
        spec = make_spec(max_steps=3, output_dir=str(tmp_path / f"run-{chunk}"), loss_chunk_tokens=chunk)
        rep = Recorder()
        engine.train(spec, rep)
        losses[chunk] = [rep.train_metrics[s]["loss"] for s in (1, 2, 3)]
        chunked = [e for e in rep.events if e[0] == "log" and "chunked loss" in e[1]]
        assert len(chunked) == (1 if chunk else 0), rep.events
    np.testing.assert_allclose(losses[48], losses[0], rtol=1e-4)
