"""XLA's own memory figures for the engine's train step (``compiled.memory_analysis()``), no training.

``measure(arch, ...)`` writes a random HF checkpoint of a dense Gemma 4 text model with the given
structure, loads it through Tunix's safetensors loader, applies Qwix LoRA as the engine does, builds
the engine's trainer (its train step: forward, LoRA gradients, optax update) with the engine's loss,
and compiles that step for one micro-batch without running it. Used by ``bench/memory.py`` and the
test that holds ``app.runs.estimate`` to within 25% of XLA.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from worker.training import tiny


@dataclasses.dataclass(frozen=True)
class Measured:
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int

    @property
    def peak_bytes(self) -> int:
        """What the step holds at once: inputs (weights, LoRA, optimizer state, batch), outputs not
        written in place of a donated input, and XLA's temporaries."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


def hf_config(arch: dict, dtype: str = "float32") -> dict:
    """An HF ``Gemma4ForCausalLM`` config.json for ``arch`` (``app.base_models.presets.Architecture``
    fields as a dict; dense models without per-layer embeddings or KV sharing)."""
    n = arch["num_layers"]
    every = arch["global_every"]
    return {
        **tiny.tiny_config_json(arch["vocab_size"], dtype),
        "hidden_size": arch["d_model"],
        "intermediate_size": arch["ffn_dim"],
        "num_hidden_layers": n,
        "layer_types": ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)],
        "num_attention_heads": arch["num_heads"],
        "head_dim": arch["head_dim"],
        "num_key_value_heads": arch["num_kv_heads"],
        "global_head_dim": arch["global_head_dim"],
        "num_global_key_value_heads": arch["num_global_kv_heads"],
        "attention_k_eq_v": arch.get("k_eq_v", True),
        "sliding_window": arch["sliding_window"],
        "final_logit_softcapping": arch["final_logit_softcap"],
    }


def write_checkpoint(dest: Path, config: dict) -> Path:
    import json

    from safetensors.numpy import save_file

    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(config), encoding="utf-8")
    save_file(tiny._random_weights(config, 0, config["dtype"]), str(dest / "model.safetensors"))
    return dest


def _spec(**kw):
    from worker.training import engine

    base: dict[str, Any] = dict(
        base_model_dir="",
        preset=None,
        dataset_path="",
        dataset_filename="",
        file_type="jsonl",
        fmt="chat",
        validation_path=None,
        validation_filename=None,
        validation_fraction=0.0,
        output_dir="",
        lora_rank=16,
        lora_alpha=32.0,
        lora_dropout=0.0,
        target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        learning_rate=1e-3,
        lr_schedule="constant",
        warmup_steps=0,
        epochs=None,
        max_steps=1,
        batch_size=1,
        grad_accum_steps=1,
        max_seq_len=8,
        packing=False,
        assistant_only_loss=True,
        seed=0,
        eval_every_steps=1,
        checkpoint_every_steps=1,
        checkpoints_kept=1,
        mesh_fsdp=1,
        mesh_tp=1,
        remat="none",
        dtype="float32",
        quantization=None,
    )
    base.update(kw)
    return engine.TrainSpec(**base)


def build(checkpoint: Path, **spec_fields):
    """(trainer, spec) for the checkpoint, as the engine builds them (one device)."""
    from worker.training import engine, models

    spec = _spec(base_model_dir=str(checkpoint), **spec_fields)
    config = models.resolve_config(checkpoint)
    mesh = engine.make_mesh(1, 1)
    with mesh:
        model = models.load_base_model(checkpoint, config, mesh=mesh, dtype=spec.dtype)
        model, _ = engine.apply_lora(model, spec, engine.REMAT[spec.remat])
        trainer = engine.make_trainer(model, spec, config, 1, None)
    return trainer, spec, mesh


# LLVM's optimisation of the generated code does not change XLA's buffer assignment (the sizes read
# here), only how long compiling takes.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def lower_step(trainer, spec, mesh, pad_id: int = 0):
    """Trace and lower the trainer's jitted train step for one (batch_size, max_seq_len) micro-batch."""
    from flax import nnx
    from tunix.sft import peft_trainer

    from worker.training import data

    rng = np.random.default_rng(0)
    shape = (spec.batch_size, spec.max_seq_len)
    tokens = rng.integers(3, trainer.model.config.num_embed, shape).astype(np.int32)
    tokens[:, 0] = 2  # <bos>
    batch = peft_trainer.TrainingInput(input_tokens=tokens, input_mask=np.ones(shape, np.int32))  # pyright: ignore[reportCallIssue] (Tunix's untyped dataclass)
    trainer.with_gen_model_input_fn(data.model_inputs_fn(pad_id, 2))
    with mesh:
        step = nnx.jit(trainer.create_train_step_fn(), donate_argnames=("optimizer",))
        return step.lower(trainer.model, trainer.optimizer, batch)


def analyse(lowered, compiler_options: dict | None = None) -> Measured:
    """Compile and read XLA's memory figures."""
    m = lowered.compile(compiler_options).memory_analysis()
    return Measured(
        argument_bytes=int(m.argument_size_in_bytes),
        output_bytes=int(m.output_size_in_bytes),
        alias_bytes=int(m.alias_size_in_bytes),
        temp_bytes=int(m.temp_size_in_bytes),
        code_bytes=int(m.generated_code_size_in_bytes),
    )


def compile_step(trainer, spec, mesh, pad_id: int = 0, compiler_options: dict | None = None) -> Measured:
    """Compile the trainer's jitted train step for one (batch_size, max_seq_len) micro-batch."""
    return analyse(lower_step(trainer, spec, mesh, pad_id), compiler_options)


def set_remat(model, remat: str) -> None:
    """Switch the remat setting of an already built LoRA model (as ``engine.apply_lora`` sets it)."""
    from flax import nnx

    from worker.training import engine, models

    for _, module in nnx.iter_modules(model):
        config = getattr(module, "config", None)
        if isinstance(config, models.ModelConfig):
            config.remat_config = engine.REMAT[remat]


def measure_many(
    arch: dict, settings, *, dtype: str = "float32", compiler_options: dict | None = None, **spec
) -> list[Measured]:
    """XLA's figures for each (batch_size, max_seq_len, remat, loss_chunk_tokens) in ``settings``; the
    model is loaded once (compiling is what takes the time: ~1-5 s a setting for small shapes)."""
    from app.runs import estimate
    from worker.training import engine, loss

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(Path(tmp) / "model", hf_config(arch, dtype))
        trainer, s, mesh = build(ckpt, dtype=dtype, **spec)
        out = []
        for batch_size, max_seq_len, remat, chunk in settings:
            set_remat(trainer.model, remat)
            s = dataclasses.replace(s, batch_size=batch_size, max_seq_len=max_seq_len, remat=remat)
            size = estimate.loss_chunk(chunk, batch_size * max_seq_len, arch["vocab_size"])
            trainer.with_loss_fn(loss.chunked_loss_fn(size) if size else engine.peft_trainer._default_loss_fn)
            out.append(analyse(lower_step(trainer, s, mesh), compiler_options))
        return out


# -- estimate against XLA ----------------------------------------------------------------------

# The rows the test holds to 25%: the tiny model (app preset `tiny-gemma4`), one row of 3 lengths,
# each remat setting, Tunix's default loss.
TINY_ROWS = [(1, t, r, 0) for t in (512, 1024, 2048) for r in ("none", "block", "decoder")]


def compare(arch, settings, measured: list[Measured], *, dtype: str = "float32", lora_rank: int = 16) -> list[dict]:
    """One row per setting: XLA's temp and peak beside ``app.runs.estimate``'s (same arithmetic as a
    run's pre-flight estimate, on one chip)."""
    from app.base_models.presets import HF_TARGET_MODULES, lora_params
    from app.runs import estimate

    lora = lora_params(arch, lora_rank, HF_TARGET_MODULES)
    rows = []
    for (batch, seq, remat, chunk), m in zip(settings, measured, strict=True):
        size = estimate.loss_chunk(chunk, batch * seq, arch.vocab_size)
        est = estimate.step_memory(
            arch, batch_per_chip=batch, seq_len=seq, remat=remat, dtype=dtype, lora=lora, chunk=size
        )
        rows.append(
            {
                "batch": batch,
                "seq": seq,
                "remat": remat,
                "loss_chunk": size,
                "xla_temp": m.temp_bytes,
                "est_temp": est.temp,
                "temp_ratio": est.temp / m.temp_bytes,
                "xla_peak": m.peak_bytes,
                "est_peak": est.total,
                "peak_ratio": est.total / m.peak_bytes,
            }
        )
    return rows


def format_rows(rows: list[dict]) -> str:
    mib = 2**20
    lines = [
        f"{'batch':>5} {'seq':>5} {'remat':>8} {'chunk':>6} {'XLA temp':>10} {'est temp':>10} {'ratio':>6}"
        f" {'XLA peak':>10} {'est peak':>10} {'ratio':>6}"
    ]
    for r in rows:
        lines.append(
            f"{r['batch']:>5} {r['seq']:>5} {r['remat']:>8} {r['loss_chunk'] or '-':>6} "
            f"{r['xla_temp'] / mib:>8.1f}Mi {r['est_temp'] / mib:>8.1f}Mi {r['temp_ratio']:>6.2f} "
            f"{r['xla_peak'] / mib:>8.1f}Mi {r['est_peak'] / mib:>8.1f}Mi {r['peak_ratio']:>6.2f}"
        )
    return "\n".join(lines)
