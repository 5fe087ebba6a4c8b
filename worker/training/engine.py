"""The trainer: one LoRA (or QLoRA) fine-tune of a Gemma 4 checkpoint with Tunix + Qwix.

``train(spec, reporter)`` loads the HF base checkpoint through Tunix's safetensors loader, applies
Qwix LoRA to the target projections, trains with Tunix's ``PeftTrainer`` and writes Orbax
checkpoints (LoRA params + optimizer state) under ``<output_dir>/checkpoints/<step>``. Calling it
again on the same ``output_dir`` resumes from the latest checkpoint.

How it talks to Tunix (0.1.7), and why:

- Per-step metrics come from a small ``PeftTrainer`` subclass whose train step also returns the
  loss and gradient norm as its aux output (``create_train_step_fn`` / ``_post_process_train_step``,
  Tunix's documented override points). Step k is reported once step k+1 has been dispatched (reading
  the newest loss would make the host wait for the device every step), and at once before a
  checkpoint, an evaluation and the end, so a checkpoint's row carries its own step's loss.
- "Step k was dispatched" is observed where the trainer calls ``checkpoint_manager.save(k)`` (it does
  so after every optimizer step and lets the save policy decide): the engine wraps Tunix's checkpoint
  manager, reports metrics there, and reports checkpoints it actually saved, with the steps Orbax
  still keeps (``max_to_keep`` prunes older ones).
- Checkpoints land at exactly the configured steps: Orbax's default policy (what Tunix uses when no
  options are given) saves at most every 180 s, and ``CheckpointManagerOptions(save_interval_steps=N)``
  alone still adds Orbax's ``InitialSavePolicy`` (a save at the first step of a fresh run). So the
  options carry an explicit ``save_decision_policy`` (every N steps, plus preemption), synchronous
  saves (a reported checkpoint is on disk), and ``max_to_keep``. Tunix saves the last step on close.
- Eval loss comes from ``TrainingHooks.on_eval_step_end`` (it gets the SUM of the batch losses; the
  engine divides by the batches counted in ``on_eval_step_start``, which is Tunix's own eval metric).
- Stop/cancel: the training iterator polls ``reporter.should_stop()`` before each optimizer step and
  ends when told to; Tunix then closes normally, which saves the last dispatched step's checkpoint:
  the run stops at exactly that step.
- Resume: Tunix restores the latest checkpoint when the trainer is built and skips the batches
  already trained (it pulls them from the iterator and drops them; the engine hands it cheap
  placeholders for those). The data order is a pure function of the seed, so the same batches follow.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import qwix
from flax import nnx
from jax.interpreters import pxla
from jax.sharding import NamedSharding, PartitionSpec
from tunix.sft import hooks as tunix_hooks
from tunix.sft import peft_trainer
from tunix.utils import mesh as mesh_lib

from app.runs import estimate
from worker.chat import ChatFormat
from worker.training import data, models, perf
from worker.training import loss as loss_lib

PHASES = ("loading", "compiling", "training", "evaluating", "checkpointing")
LR_SCHEDULES = ("constant", "cosine", "linear")
REMAT = {"none": models.RematConfig.NONE, "block": models.RematConfig.BLOCK, "decoder": models.RematConfig.DECODER}
DTYPES = ("float32", "bfloat16")
QUANTIZATION = ("nf4", "int8")  # accepted names; refused for now, see validate_spec
GRAD_CLIP_NORM = 1.0


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    """Everything a run needs, already validated by the app."""

    base_model_dir: str
    preset: str | None
    dataset_path: str
    dataset_filename: str
    file_type: str
    fmt: str
    validation_path: str | None
    validation_filename: str | None
    validation_fraction: float
    output_dir: str
    lora_rank: int
    lora_alpha: float
    lora_dropout: float
    target_modules: tuple[str, ...]
    learning_rate: float
    lr_schedule: str
    warmup_steps: int
    epochs: int | None
    max_steps: int | None
    batch_size: int  # rows per micro-batch (global, over all devices)
    grad_accum_steps: int  # micro-batches per optimizer step
    max_seq_len: int
    packing: bool
    assistant_only_loss: bool
    seed: int
    eval_every_steps: int
    checkpoint_every_steps: int
    checkpoints_kept: int
    mesh_fsdp: int
    mesh_tp: int
    remat: str
    dtype: str
    quantization: str | None
    enable_thinking: bool = False  # the chat template's switch, for data with thinking (Gemma 4: <|think|>)
    loss_chunk_tokens: int | None = None  # None: chunked only where the logits are large (loss.py)
    # Replicas of the model (the mesh's dp axis): the weights are copied to each, not sharded over them,
    # and each step's gradients are summed across replicas as one flat buffer (see `replica_train_step`).
    mesh_dp: int = 1


class Reporter(Protocol):
    """How the engine talks to the outside (the DB, in the worker)."""

    def phase(self, name: str) -> None: ...

    def metrics(self, step: int, values: dict[str, float]) -> None: ...

    def checkpoint(self, step: int, path: str, kept: list[int]) -> None: ...  # kept: the steps still on disk

    def log(self, line: str) -> None: ...

    def held_out(self, lines: list[int]) -> None: ...  # the training file's records kept for validation

    def should_stop(self) -> bool: ...


@dataclasses.dataclass
class TrainResult:
    final_step: int
    stopped_early: bool
    resumed_from_step: int | None
    metrics: dict


# -- setup helpers -----------------------------------------------------------------------------


def configure_compilation_cache() -> str:
    """Point JAX's persistent compilation cache at ``$TUNEDECK_JAX_CACHE_DIR`` (default
    ``~/.cache/tunedeck/jax``), caching every compiled program (also the small eager ones that
    LoRA application and the first forward pass compile, a few seconds per run otherwise)."""
    from jax.experimental.compilation_cache import compilation_cache

    path = os.environ.get("TUNEDECK_JAX_CACHE_DIR") or os.path.expanduser("~/.cache/tunedeck/jax")
    os.makedirs(path, exist_ok=True)
    if jax.config.jax_compilation_cache_dir != path:  # pyright: ignore[reportAttributeAccessIssue] (set dynamically)
        jax.config.update("jax_compilation_cache_dir", path)
        compilation_cache.reset_cache()
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


def validate_spec(spec: TrainSpec) -> None:
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ValueError(message)

    need(spec.lr_schedule in LR_SCHEDULES, f"lr_schedule must be one of {LR_SCHEDULES}, got {spec.lr_schedule!r}")
    need(spec.remat in REMAT, f"remat must be one of {tuple(REMAT)}, got {spec.remat!r}")
    need(spec.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {spec.dtype!r}")
    need(
        spec.quantization in (None, *QUANTIZATION),
        f"quantization must be None, 'nf4' or 'int8', got {spec.quantization!r}",
    )
    need(spec.lora_rank >= 1 and spec.lora_alpha > 0, "lora_rank must be >= 1 and lora_alpha > 0")
    need(0 <= spec.lora_dropout < 1, "lora_dropout must be in [0, 1)")
    need(spec.learning_rate > 0 and spec.warmup_steps >= 0, "learning_rate must be > 0 and warmup_steps >= 0")
    need(spec.batch_size >= 1 and spec.grad_accum_steps >= 1, "batch_size and grad_accum_steps must be >= 1")
    need(spec.max_seq_len >= 8, "max_seq_len must be >= 8")
    need(spec.epochs is None or spec.epochs >= 1, "epochs must be >= 1")
    need(spec.max_steps is None or spec.max_steps >= 1, "max_steps must be >= 1")
    need(spec.eval_every_steps >= 1 and spec.checkpoint_every_steps >= 1, "eval/checkpoint intervals must be >= 1")
    need(spec.checkpoints_kept >= 1, "checkpoints_kept must be >= 1")
    need(spec.mesh_dp >= 1 and spec.mesh_fsdp >= 1 and spec.mesh_tp >= 1, "mesh_dp, mesh_fsdp and mesh_tp must be >= 1")
    need(0 <= spec.validation_fraction < 1, "validation_fraction must be in [0, 1)")
    # Rows split over replicas, then over fsdp within each; one process alone may leave fsdp uneven
    # (Tunix then replicates the batch), a slice's processes each feed their own rows and may not.
    split = spec.mesh_dp * spec.mesh_fsdp if spec.mesh_dp > 1 or jax.process_count() > 1 else 1
    need(
        spec.batch_size % split == 0,
        f"the micro-batch ({spec.batch_size} rows) must divide over "
        f"mesh_dp={spec.mesh_dp} x mesh_fsdp={spec.mesh_fsdp}",
    )
    models.lora_module_path(spec.target_modules)  # raises on unknown names
    if spec.quantization is not None:
        raise NotImplementedError(
            f"QLoRA ({spec.quantization}) is not available with Tunix 0.1.7's Gemma 4: its Einsum layers cast the "
            "weight (jnp.astype) before the einsum, which Qwix's quantized weights (ptq.WithAux) do not support, so "
            "the first forward pass fails. Train with quantization=None (LoRA on a bfloat16 base) instead."
        )


def make_mesh(fsdp: int, tp: int, dp: int = 1) -> jax.sharding.Mesh:
    """A (dp, fsdp, tp) mesh over the first dp*fsdp*tp devices, with Auto axis types (Tunix's Gemma 4
    embedding lookup fails under jax.make_mesh's default Explicit axes). The model's sharding names
    only fsdp and tp: its weights are copied to each of the dp replicas."""
    n = dp * fsdp * tp
    devices = jax.devices()
    shape = estimate.mesh_name(dp, fsdp, tp)
    if n > len(devices):
        raise ValueError(f"mesh {shape} needs {n} devices; this host has {len(devices)}")
    if jax.process_count() > 1 and n != len(devices):
        raise ValueError(
            f"mesh {shape} is {n} devices; a slice's run uses all of its "
            f"{len(devices)} ({jax.process_count()} hosts x {jax.local_device_count()})"
        )
    return mesh_lib.create_mesh((dp, fsdp, tp), ("dp", "fsdp", "tp"), devices=devices[:n])


def check_mesh(config: models.ModelConfig, fsdp: int, tp: int) -> None:
    """Every sharded weight axis must divide evenly (JAX places no uneven shards)."""
    counts = {
        "attention heads": config.num_heads,
        "KV heads": config.num_kv_heads,
        "global KV heads": config.num_global_kv_heads or config.num_kv_heads,
        "vocabulary": config.num_embed,
        "MLP width": config.hidden_dim,
    }
    bad = [f"{k} ({v})" for k, v in counts.items() if v % tp]
    if bad:
        raise ValueError(f"mesh_tp={tp} must divide the model's {', '.join(bad)}")
    if config.embed_dim % fsdp:
        raise ValueError(f"mesh_fsdp={fsdp} must divide the model width ({config.embed_dim})")


def lr_at(count, *, kind: str, peak, warmup, total, xp=np):
    """Learning rate of the optimizer update number ``count`` (0-based; optax's schedule argument).

    Linear warmup reaching ``peak`` at update ``warmup`` (never 0), then constant, linear or cosine
    decay that ends one step short of 0 at update ``total``. ``peak``, ``warmup`` and ``total`` may be
    traced values (the optimizer keeps them in its state): no branch depends on them."""
    step = count + 1
    warm = xp.where(warmup > 0, xp.minimum(1.0, step / xp.maximum(warmup, 1)), 1.0)
    if kind == "constant":
        return peak * warm
    progress = xp.clip((step - warmup) / xp.maximum(1, total - warmup + 1), 0.0, 1.0)
    if kind == "linear":
        decay = 1.0 - progress
    else:
        decay = 0.5 * (1.0 + xp.cos(math.pi * progress))
    return peak * warm * decay


class ScheduleState(NamedTuple):
    updates: jax.Array  # made so far
    hyperparams: dict[str, jax.Array]  # peak, warmup, total; learning_rate: the last update's


def scale_by_schedule(kind: str, peak: float, warmup: int, total: int) -> optax.GradientTransformation:
    """Scale updates by ``lr_at(count)``, with the schedule's figures held in the state as arrays, so that
    runs differing only in learning rate, warmup or length run the same compiled train step (found in
    the persistent cache) instead of each compiling its own with the figures as constants."""

    def init(params):
        del params
        figures = {"peak": peak, "warmup": warmup, "total": total, "learning_rate": 0.0}
        return ScheduleState(jnp.zeros([], jnp.int32), {k: jnp.asarray(v, jnp.float32) for k, v in figures.items()})

    def update(updates, state, params=None):
        del params
        hp = state.hyperparams
        lr = lr_at(state.updates, kind=kind, peak=hp["peak"], warmup=hp["warmup"], total=hp["total"], xp=jnp)
        updates = jax.tree.map(lambda u: (lr * u).astype(u.dtype), updates)
        return updates, ScheduleState(state.updates + 1, {**hp, "learning_rate": lr})

    return optax.GradientTransformation(init, update)


def make_optimizer(spec: TrainSpec, total_steps: int) -> optax.GradientTransformation:
    """Clipped AdamW (no weight decay) at the run's schedule: Adam's direction, then ``-lr_at(count)``."""
    return optax.chain(
        optax.clip_by_global_norm(GRAD_CLIP_NORM),
        optax.scale_by_adam(),
        optax.scale(-1.0),
        scale_by_schedule(spec.lr_schedule, spec.learning_rate, spec.warmup_steps, total_steps),
    )


def apply_lora(model, spec: TrainSpec, remat: models.RematConfig):
    """Qwix LoRA on the target projections, applied with remat off (Qwix creates no LoRA params
    under remat), then remat set on every module's config. Returns (model, trainable params)."""
    kwargs: dict[str, Any] = {"dropout": spec.lora_dropout} if spec.lora_dropout > 0 else {}
    provider = qwix.LoraProvider(
        module_path=models.lora_module_path(spec.target_modules), rank=spec.lora_rank, alpha=spec.lora_alpha, **kwargs
    )
    inputs = model.get_model_input()
    lora_model = qwix.apply_lora_to_model(model, provider, rngs=nnx.Rngs(spec.seed), skip_nnx_init=True, **inputs)
    # Qwix creates the LoRA params on a first call, which it would run eagerly: each op compiled on its
    # own (about 170 programs, seconds of every run's start). The same call through nnx.jit is one
    # program, and sets the same values (Qwix's set-up and clean-up around the call, as it does them).
    lora_model.set_attributes(qwix_rngs=nnx.Rngs(spec.seed), disable_quant_stats_update=True)
    nnx.jit(lambda m, kw: m(**kw))(lora_model, inputs)
    lora_model.set_attributes(qwix_rngs=None, disable_quant_stats_update=False)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(lora_model, nnx.LoRAParam)))
    if n_params == 0:
        raise RuntimeError(f"Qwix created no LoRA parameters for target modules {spec.target_modules}")
    if spec.dtype != "float32":  # LoRA params inherit the base dtype; keep float32 master weights
        state = nnx.state(lora_model, nnx.LoRAParam)
        nnx.update(lora_model, jax.tree.map(lambda x: x.astype(jnp.float32), state))
    if spec.lora_dropout > 0:  # Qwix unsets its rngs after init; dropout needs a stream
        lora_model.set_attributes(qwix_rngs=nnx.Rngs(dropout=spec.seed + 1))
    for _, module in nnx.iter_modules(lora_model):  # pyright: ignore[reportArgumentType] (Qwix types it as linen's)
        config = getattr(module, "config", None)
        if isinstance(config, models.ModelConfig):
            config.remat_config = remat
    return lora_model, n_params


def make_trainer(model, spec: TrainSpec, config: models.ModelConfig, total_steps: int, checkpoint_dir: str | None):
    """The run's ``PeftTrainer`` (see ``_Trainer``) with its optimizer, checkpoint policy and loss:
    Tunix's default loss, or ``loss.chunked_loss_fn`` where the run's ``loss_chunk_tokens`` asks for
    it (by default when one micro-batch's f32 logits per device would exceed 256 MiB)."""
    policy = ocp.checkpoint_managers.AnySavePolicy(
        [
            ocp.checkpoint_managers.FixedIntervalPolicy(spec.checkpoint_every_steps),
            ocp.checkpoint_managers.PreemptionCheckpointingPolicy(),
        ]
    )
    training_config = peft_trainer.TrainingConfig(
        eval_every_n_steps=spec.eval_every_steps,
        max_steps=total_steps,
        gradient_accumulation_steps=spec.grad_accum_steps if spec.grad_accum_steps > 1 else None,
        checkpoint_root_directory=checkpoint_dir,
        checkpointing_options=ocp.CheckpointManagerOptions(
            save_decision_policy=policy,
            max_to_keep=spec.checkpoints_kept,
            enable_async_checkpointing=False,
        ),
        # the batch's rows over the replicas, then over fsdp within each (a spec entry may name two axes)
        data_sharding_axis=(("dp", "fsdp"),),  # pyright: ignore[reportArgumentType] (typed as names only)
        pbar_description=None,
    )
    trainer = _Trainer(model, make_optimizer(spec, total_steps), training_config)
    trainer.step_outputs = []
    trainer.replicas = spec.mesh_dp
    tokens_per_device = spec.batch_size * spec.max_seq_len // (spec.mesh_dp * spec.mesh_fsdp)
    trainer.loss_chunk_tokens = estimate.loss_chunk(spec.loss_chunk_tokens, tokens_per_device, config.num_embed)
    if trainer.loss_chunk_tokens:
        trainer.with_loss_fn(loss_lib.chunked_loss_fn(trainer.loss_chunk_tokens))
    return trainer


# -- the trainer and its hooks -----------------------------------------------------------------


class _Trainer(peft_trainer.PeftTrainer):
    """PeftTrainer whose train step also hands back the loss and the gradient norm as aux; with
    replicas, the step is `replica_train_step`."""

    step_outputs: list
    loss_chunk_tokens: int | None = None
    global_rows: int | None = None  # the rows of a micro-batch as the step sees it: all processes' together
    replicas: int = 1

    def create_train_step_fn(self):
        base = super().create_train_step_fn() if self.replicas == 1 else self.replica_train_step

        def train_step(model, optimizer, inputs):
            self.global_rows = jax.tree.leaves(inputs)[0].shape[0]  # when traced: the global array's shape
            loss, _, grad_norm = base(model, optimizer, inputs)
            return loss, {"loss": loss, "grad_norm": grad_norm}, grad_norm

        return train_step

    def _post_process_train_step(self, aux) -> None:
        self.step_outputs.append(aux)

    def replica_train_step(self, model, optimizer, inputs):
        """Tunix's train step (same loss, same update) over ``replicas`` copies of the model, each of its
        rows weighing what it weighs in Tunix's loss over the whole batch.

        Each replica computes the gradients of its own rows (``per_replica``: no collective between
        replicas inside), weighted by the tokens it scored; their sum over the replicas, divided by the
        tokens in all, is the gradient of the mean over the whole batch, which is what Tunix's loss takes.

        Where each replica is one device, every gradient, the weighted losses and the token counts are
        concatenated and summed across replicas as one flat buffer: one all-reduce a step. Left to XLA,
        the sum is one all-reduce per LoRA array (a tuple of them at best), and gloo, the collectives of
        CPU hosts, pays its latency once per array: dozens a step (bench/slice.py). Where a replica
        spans devices (fsdp or tp within it), its gradients are sharded over them, and concatenating
        them would gather and permute each one first: each array is summed on its own there."""
        batches, tokens = by_replica(self.gen_model_input_fn(inputs), self.replicas)
        grad_fn = nnx.value_and_grad(self.loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))
        losses, grads = per_replica(model, batches, grad_fn)
        mesh = pxla.thread_resources.env.physical_mesh
        if mesh.shape["fsdp"] * mesh.shape["tp"] == 1:
            r = self.replicas
            leaves, treedef = jax.tree.flatten(grads)
            columns = [tokens[:, None] * g.reshape(r, -1).astype(jnp.float32) for g in leaves]
            summed = jnp.sum(jnp.concatenate([*columns, (tokens * losses)[:, None], tokens[:, None]], axis=1), axis=0)
            total = summed[-1] + 1e-8
            sizes = np.cumsum([math.prod(g.shape[1:]) for g in leaves])[:-1]
            pieces = jnp.split(summed[:-2] / total, sizes)
            grads = jax.tree.unflatten(
                treedef, [p.reshape(g.shape[1:]).astype(g.dtype) for p, g in zip(pieces, leaves, strict=True)]
            )
            loss = summed[-2] / total
        else:
            total = jnp.sum(tokens) + 1e-8
            grads = jax.tree.map(
                lambda g: (jnp.tensordot(tokens, g.astype(jnp.float32), axes=1) / total).astype(g.dtype), grads
            )
            loss = jnp.sum(tokens * losses) / total
        grad_norm = optax.global_norm(grads)
        optimizer.update(model, grads)
        return loss, None, grad_norm

    def create_eval_step_fn(self):  # pyright: ignore[reportIncompatibleMethodOverride] (Tunix's own step returns (loss, aux), not its annotation)
        return super().create_eval_step_fn() if self.replicas == 1 else self.replica_eval_step

    def replica_eval_step(self, model, inputs):
        """Tunix's eval step over the replicas: each scores its own rows (left to Tunix's step, the model's
        activation shardings, which name fsdp and tp only, would gather the whole batch onto every
        replica on a TPU or GPU), and the losses are weighted by the tokens each scored."""
        batches, tokens = by_replica(self.gen_model_input_fn(inputs), self.replicas)
        losses = per_replica(model, batches, self.eval_loss_fn)
        return jnp.sum(tokens * losses) / (jnp.sum(tokens) + 1e-8), None


def by_replica(inputs: dict, replicas: int) -> tuple[dict, jax.Array]:
    """A micro-batch's model inputs split by replica, (B, ...) -> (R, B / R, ...) with replica i's rows on
    the mesh's dp axis, and the tokens each replica scores (its loss's normalizer: ``input_mask[:, 1:]``)."""
    mesh = pxla.thread_resources.env.physical_mesh

    def split(x):
        x = x.reshape(replicas, x.shape[0] // replicas, *x.shape[1:])
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec("dp", "fsdp")))

    batches = jax.tree.map(split, inputs)
    return batches, jnp.sum(batches["input_mask"][:, :, 1:], axis=(1, 2)).astype(jnp.float32)


def per_replica(model, batches: dict, fn):
    """``fn(copy, **batch)`` for each replica's rows (``batches``: arrays of shape (R, rows, ...), R on the
    mesh's dp axis), through ``jax.vmap``: the weights shared, no collective between replicas. Each
    replica's random keys get its index folded in (its own dropout masks); the random counts the copies
    advance are written back to ``model``. Returns ``fn``'s outputs stacked by replica."""
    graphdef, keys, counts, rest = nnx.split(model, nnx.RngKey, nnx.RngCount, ...)
    replicas = jax.tree.leaves(batches)[0].shape[0]

    def replica(keys, counts, rest, index, batch):
        # Every state goes in as an argument: nnx refuses to change a Variable of an outer trace.
        keys = jax.tree.map(lambda k: jax.random.fold_in(k, index), keys)
        copy = nnx.merge(graphdef, keys, counts, rest)
        return fn(copy, **batch), nnx.state(copy, nnx.RngCount)

    out, new_counts = jax.vmap(replica, in_axes=(None, None, None, 0, 0), out_axes=(0, None), spmd_axis_name="dp")(
        keys, counts, rest, jnp.arange(replicas), batches
    )
    nnx.update(model, new_counts)
    return out


class _Checkpoints:
    """Wraps Tunix's CheckpointManager: its ``save(step)``, called after every optimizer step, is
    where the run learns that a step ended."""

    def __init__(self, inner, run: _Run) -> None:
        self._inner = inner
        self._run = run

    def latest_step(self):
        return self._inner.latest_step()

    def maybe_restore(self, *args, **kwargs):
        return self._inner.maybe_restore(*args, **kwargs)

    def save(self, step, model, optimizer=None, save_only_lora_params=False, force=False, custom_metadata=None):
        orbax_manager = self._inner._checkpoint_manager
        saving = step > 0 and orbax_manager is not None and (force or orbax_manager.should_save(step))
        self._run.step_ended(step, flush=saving)  # a checkpoint carries its step's metrics: report them first
        if not saving:
            return False
        self._run.reporter.phase("checkpointing")
        t = time.perf_counter()
        saved = self._inner.save(
            step,
            model,
            optimizer,
            save_only_lora_params=save_only_lora_params,
            force=force,
            custom_metadata=custom_metadata,
        )
        if saved:
            assert orbax_manager is not None, "a save goes through Orbax's manager"
            orbax_manager.wait_until_finished()
            path = str(Path(self._run.checkpoint_dir) / str(step))
            self._run.reporter.log(f"checkpoint at step {step}: {path} ({time.perf_counter() - t:.2f} s)")
            self._run.reporter.checkpoint(step, path, sorted(orbax_manager.all_steps()))
        if not force:  # force: the final save, when Tunix closes
            self._run.back_to_training()
        return saved

    def close(self):
        self._inner.close()


class _Hooks(tunix_hooks.TrainingHooks):
    def __init__(self, run: _Run) -> None:
        self.run = run
        self.eval_batches = 0

    def on_train_start(self, train_ctx):
        pass

    def on_train_end(self, train_ctx):
        pass

    def on_train_step_start(self, train_ctx):
        pass

    def on_train_step_end(self, train_ctx, train_step, train_loss):
        pass  # one step late in Tunix; metrics are reported by _Checkpoints.save instead

    def on_eval_step_start(self, train_ctx):
        if self.eval_batches == 0:
            self.run.flush()
            self.run.reporter.phase("evaluating")
            self.run.eval_started = time.perf_counter()
        self.eval_batches += 1

    def on_eval_step_end(self, train_ctx, eval_loss):
        loss = float(jax.device_get(eval_loss)) / max(1, self.eval_batches)
        step = train_ctx.train_steps
        self.eval_batches = 0
        self.run.last_eval_loss = loss
        self.run.reporter.metrics(step, {"eval_loss": loss})
        self.run.reporter.log(
            f"eval at step {step}: loss {loss:.4f} ({time.perf_counter() - self.run.eval_started:.2f} s)"
        )
        self.run.back_to_training()


class _EvalSet:
    """The validation batches; empty on its first pass when resuming (Tunix evaluates before the
    first step, which a resumed run already reported)."""

    def __init__(self, batches: list, skip_first_pass: bool) -> None:
        self.batches = batches
        self.skip = skip_first_pass

    def __bool__(self) -> bool:
        return bool(self.batches)

    def __iter__(self):
        if self.skip:
            self.skip = False
            return iter(())
        return iter(self.batches)


def local_rows(batch):
    """This process's rows of a global batch. On a slice every process builds the same global batch (the
    order is a pure function of the seed) and feeds only its own block of rows: Tunix assembles the global
    array with ``jax.make_array_from_process_local_data``, process by process in device order."""
    count = jax.process_count()
    if count == 1:
        return batch
    return jax.tree.map(lambda x: np.split(x, count)[jax.process_index()], batch)


def stop_everywhere(reporter: Reporter) -> bool:
    """Whether to stop before the next step: process 0 asks its reporter and every process gets its answer
    (a collective, so that all the processes of a slice stop at the same step)."""
    stop = reporter.should_stop() if jax.process_index() == 0 else False
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        stop = bool(multihost_utils.broadcast_one_to_all(np.asarray(stop)))
    return stop


class _Run:
    """State shared by the training iterator and the hooks."""

    def __init__(self, spec: TrainSpec, reporter: Reporter, total_steps: int, pad_id: int) -> None:
        self.spec = spec
        self.reporter = reporter
        self.total_steps = total_steps
        self.pad_id = pad_id
        self.checkpoint_dir = str(Path(spec.output_dir) / "checkpoints")
        self.trainer: _Trainer | None = None
        self.step_tokens = 0
        self.step_started: float | None = None  # when the step's clock started: the previous step's end
        self.last_reported = 0
        self.last_dispatched = 0
        self.pending: list[tuple[int, list, int]] = []  # dispatched steps not reported yet
        self.first_step: int | None = None
        self.stopped_early = False
        self.last_loss: float | None = None
        self.last_eval_loss: float | None = None
        self.eval_started = 0.0
        self.tokens_total = 0
        self.train_time = 0.0
        self.chips = 1
        self.flops_per_token = 0.0
        self.peak_flops: float | None = None  # per chip; None where unknown (CPU): no MFU then
        self.compile_clock = perf.CompileClock()

    def measure(self, model, config: models.ModelConfig, mesh: jax.sharding.Mesh) -> None:
        self.chips = mesh.devices.size
        self.flops_per_token = perf.flops_per_token(model, config, self.spec.max_seq_len)
        self.peak_flops = perf.peak_flops(mesh.devices.flat[0])

    def back_to_training(self) -> None:
        """After an evaluation or a checkpoint: their time is not the next step's."""
        self.reporter.phase("training" if self.last_reported > (self.first_step or 0) else "compiling")
        self.step_started = time.perf_counter()

    def batches(self, train: data.Batches, start_micro: int) -> Iterator:
        """Exactly total_steps * grad_accum micro-batches; the first ``start_micro`` (already trained,
        dropped by Tunix) are placeholders. Stops early when the reporter says so."""
        accum = self.spec.grad_accum_steps
        placeholder = local_rows(train.make_batch([]))
        n = self.total_steps * accum
        micro = 0
        epoch = 0
        while micro < n:
            rows = train.rows(epoch)
            for b in range(0, len(rows), train.batch_size):
                if micro >= n:
                    return
                if micro < start_micro:
                    micro += 1
                    yield placeholder
                    continue
                if micro % accum == 0:
                    if stop_everywhere(self.reporter):
                        self.stopped_early = True
                        self.reporter.log(f"stop requested: stopping after step {micro // accum}")
                        return
                    self.step_tokens = 0
                    if self.step_started is None:
                        self.step_started = time.perf_counter()
                batch = train.make_batch(rows[b : b + train.batch_size])
                self.step_tokens += data.count_tokens(batch, self.pad_id)[0]  # the global batch's
                micro += 1
                yield local_rows(batch)
            epoch += 1

    def step_ended(self, step: int, *, flush: bool = False) -> None:
        """Step ``step`` was dispatched. Its metrics are reported when the next step has been
        dispatched too (reading a loss waits for its step; waiting on the newest one would stall
        the pipeline, as Tunix's own metrics avoid too), or at once with ``flush``: before a
        checkpoint, an evaluation, and at the end."""
        trainer = self.trainer
        assert trainer is not None, "steps end once the trainer is made"
        outputs, trainer.step_outputs = trainer.step_outputs, []
        if step > self.last_dispatched and outputs:
            self.last_dispatched = step
            self.pending.append((step, outputs, self.step_tokens))
        while len(self.pending) > (0 if flush else 1):
            self._report(*self.pending.pop(0))

    def flush(self) -> None:
        while self.pending:
            self._report(*self.pending.pop(0))

    def _report(self, step: int, outputs: list, tokens: int) -> None:
        """Wait for the step's loss, time it, emit its metrics."""
        fetched = jax.device_get([(o["loss"], o["grad_norm"]) for o in outputs])
        losses = [float(loss) for loss, _ in fetched]
        norms = [float(norm) for _, norm in fetched]
        # Wall time since the previous step ended (everything between steps counts), so that
        # tokens/s and steps/s are what the run really gets.
        now = time.perf_counter()
        elapsed = now - (self.step_started or now)
        self.step_started = now
        loss = float(np.mean(losses))
        values = {
            "loss": loss,
            "perplexity": float(math.exp(min(loss, 80.0))),
            "grad_norm": float(np.mean(norms)),
            "learning_rate": float(
                lr_at(
                    step - 1,
                    kind=self.spec.lr_schedule,
                    peak=self.spec.learning_rate,
                    warmup=self.spec.warmup_steps,
                    total=self.total_steps,
                )
            ),
            "step_time_s": elapsed,
            "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
            "host_rss_gb": perf.host_peak_rss_gb(),
        }
        values["tokens_per_s_per_chip"] = values["tokens_per_s"] / self.chips
        if self.peak_flops:
            values["mfu"] = values["tokens_per_s_per_chip"] * self.flops_per_token / self.peak_flops
        device_gb = perf.device_memory_gb()
        if device_gb is not None:
            values["memory_gb"] = device_gb
        first = self.last_reported == (self.first_step or 0)
        self.last_reported = step
        self.last_loss = loss
        self.tokens_total += tokens
        self.train_time += elapsed
        self.reporter.metrics(step, values)
        if first:
            self.reporter.log(
                f"first step (includes compiling the train step): {elapsed:.2f} s; "
                f"JAX compile time so far: {self.compile_clock.seconds:.2f} s"
            )
            self.reporter.phase("training")


# -- the entry point ---------------------------------------------------------------------------


def _load_data(spec: TrainSpec, tok: ChatFormat, reporter: Reporter):
    template_kwargs = {"enable_thinking": True} if spec.enable_thinking else {}
    train_ds = data.tokenize_file(
        tok,
        spec.dataset_path,
        spec.dataset_filename,
        file_type=spec.file_type,
        fmt=spec.fmt,
        max_seq_len=spec.max_seq_len,
        assistant_only_loss=spec.assistant_only_loss,
        template_kwargs=template_kwargs,
    )
    reporter.log(f"training file: {train_ds.stats}")
    if spec.validation_path:
        val_ds = data.tokenize_file(
            tok,
            spec.validation_path,
            spec.validation_filename or os.path.basename(spec.validation_path),
            file_type=None,
            fmt=None,
            max_seq_len=spec.max_seq_len,
            assistant_only_loss=spec.assistant_only_loss,
            template_kwargs=template_kwargs,
        )
        reporter.log(f"validation file: {val_ds.stats}")
    else:
        train_ds, val_ds = data.split_validation(train_ds, spec.validation_fraction, spec.seed)
        assert val_ds.lines is not None, "tokenize_file numbers its examples"
        reporter.held_out(sorted(set(val_ds.lines.tolist())))  # what an evaluation of this run may ask
    if len(train_ds) == 0:
        raise ValueError("the training data has no usable examples (all records invalid or without a target)")
    return train_ds, val_ds


def _total_steps(spec: TrainSpec, train: data.Batches) -> int:
    accum = spec.grad_accum_steps
    if spec.epochs is None and spec.max_steps is not None:
        return spec.max_steps
    micro = sum(train.batches_in_epoch(e) for e in range(spec.epochs or 1))
    steps = math.ceil(micro / accum)
    return min(steps, spec.max_steps) if spec.max_steps is not None else steps


def train(spec: TrainSpec, reporter: Reporter) -> TrainResult:
    """Run (or resume) one training; see the module docstring. Raises on bad input or failure."""
    t_start = time.perf_counter()
    validate_spec(spec)
    reporter.phase("loading")
    cache_dir = configure_compilation_cache()
    config = models.resolve_config(spec.base_model_dir, spec.preset)
    check_mesh(config, spec.mesh_fsdp, spec.mesh_tp)
    tok = ChatFormat(spec.base_model_dir)
    if tok.bos_id is None:
        raise ValueError("the base model's tokenizer names no bos_token: training needs one to start each example")
    if tok.vocab_size > config.num_embed:
        raise ValueError(f"the tokenizer has {tok.vocab_size} tokens but the model only {config.num_embed}")

    t = time.perf_counter()
    train_ds, val_ds = _load_data(spec, tok, reporter)
    train_batches = data.Batches(train_ds, spec.batch_size, spec.max_seq_len, spec.packing, tok.pad_id, spec.seed)
    eval_batches = []
    if len(val_ds):
        val_batches = data.Batches(val_ds, spec.batch_size, spec.max_seq_len, spec.packing, tok.pad_id, shuffle=False)
        eval_batches = [local_rows(b) for b in val_batches.epoch(0)]
    total_steps = _total_steps(spec, train_batches)
    reporter.log(
        f"data: {len(train_ds)} train / {len(val_ds)} validation examples, "
        f"{train_batches.batches_in_epoch(0)} batches of {spec.batch_size}x{spec.max_seq_len} per epoch "
        f"({'packed' if spec.packing else 'padded'}), {total_steps} steps ({time.perf_counter() - t:.2f} s)"
    )

    mesh = make_mesh(spec.mesh_fsdp, spec.mesh_tp, spec.mesh_dp)
    reporter.log(
        f"mesh: {estimate.mesh_name(spec.mesh_dp, spec.mesh_fsdp, spec.mesh_tp)} over {mesh.devices.size} devices"
        + (f" ({spec.mesh_dp} replicas: one gradient sum a step)" if spec.mesh_dp > 1 else "")
    )
    if jax.process_count() > 1:
        reporter.log(
            f"slice: jax.process_count() == {jax.process_count()} (this is process {jax.process_index()}), "
            f"{jax.device_count()} devices ({jax.local_device_count()} per host); each process feeds "
            f"{spec.batch_size // jax.process_count()} of the {spec.batch_size} rows of every micro-batch"
        )
    run = _Run(spec, reporter, total_steps, tok.pad_id)
    # `with mesh:`, deprecated in JAX, not jax.set_mesh: Tunix's trainer reads the mesh from
    # pxla.thread_resources, which only the former sets (checked on JAX 0.10).
    with mesh:
        t = time.perf_counter()
        model = models.load_base_model(spec.base_model_dir, config, mesh=mesh, dtype=spec.dtype)
        reporter.log(f"loaded base model ({config.num_layers} layers, {spec.dtype}) in {time.perf_counter() - t:.2f} s")
        t = time.perf_counter()
        model, n_lora = apply_lora(model, spec, REMAT[spec.remat])
        reporter.log(
            f"applied LoRA r={spec.lora_rank} alpha={spec.lora_alpha} to {', '.join(spec.target_modules)}"
            ": "
            f"{n_lora:,} trainable params in {time.perf_counter() - t:.2f} s"
        )

        run.measure(model, config, mesh)
        trainer = make_trainer(model, spec, config, total_steps, run.checkpoint_dir)
        if trainer.loss_chunk_tokens:
            reporter.log(f"loss computed {trainer.loss_chunk_tokens} tokens at a time (chunked loss)")
        run.trainer = trainer
        resumed = trainer.train_steps or None
        run.first_step = run.last_reported = run.last_dispatched = trainer.train_steps
        if resumed:
            reporter.log(f"resumed from the checkpoint at step {resumed}")
        # the methods of Tunix's CheckpointManager that PeftTrainer calls, wrapped
        trainer.checkpoint_manager = _Checkpoints(trainer.checkpoint_manager, run)  # pyright: ignore[reportAttributeAccessIssue]
        trainer.with_training_hooks(_Hooks(run))
        trainer.with_gen_model_input_fn(data.model_inputs_fn(tok.pad_id, tok.bos[0]))

        eval_set = _EvalSet(eval_batches, skip_first_pass=bool(resumed))
        if trainer.train_steps < total_steps:
            reporter.phase("compiling")
            trainer.train(run.batches(train_batches, trainer.iter_steps), eval_set if eval_set else None)
            run.flush()
        else:
            reporter.log(f"nothing to do: already at step {trainer.train_steps} of {total_steps}")
            trainer.close()
        final_step = trainer.train_steps

    steps_run = final_step - (resumed or 0)
    metrics = {
        "steps": steps_run,
        "total_steps": total_steps,
        "loss": run.last_loss,
        "eval_loss": run.last_eval_loss,
        "tokens": run.tokens_total,
        "train_time_s": run.train_time,
        "wall_time_s": time.perf_counter() - t_start,
        "trainable_params": n_lora,
        "global_batch_rows": trainer.global_rows,
        "train_examples": len(train_ds),
        "validation_examples": len(val_ds),
        "compilation_cache_dir": cache_dir,
    }
    reporter.log(
        f"done at step {final_step}/{total_steps}{' (stopped early)' if run.stopped_early else ''}: "
        f"{steps_run} steps, last loss {run.last_loss}, {metrics['wall_time_s']:.1f} s"
    )
    return TrainResult(
        final_step=final_step, stopped_early=run.stopped_early, resumed_from_step=resumed, metrics=metrics
    )
