"""Checking a merge: the merged checkpoint, loaded the way training loads a base, must compute what
the base with its LoRA computes.

The reference is built independently of the merge code: the base through Tunix's loader, Qwix LoRA
applied as the engine applies it, and the checkpoint's LoRA values restored by Orbax into that model
(as Tunix's trainer restores them), so a wrong mapping in the merge cannot hide in both sides.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import SimpleNamespace

import numpy as np

from app.base_models import hf_config
from worker.merge import mapping
from worker.merge.merge import Checkpoint, open_checkpoint

# Largest |logit difference| allowed, as a share of the largest logit. float32: the merge only reorders
# float32 sums (W x + B (A x) vs (W + B A) x), an error that grows with the values summed: ~2e-5 on
# logits up to ~8 with a briefly trained tiny LoRA, but 2.5e-4 at logits up to 8.8 after 300 steps at
# learning rate 0.01 (the demo data, rank 16), which merged exactly. 2^-12 of the largest logit (2.1e-3
# there) leaves room for that and stays far below what a missing or mis-mapped LoRA does (its whole
# effect: more than 1 on the tiny model). bfloat16 keeps 8 significant bits: the merged model rounds every
# W + delta to bfloat16 where the LoRA model keeps the delta in float32, and both round every activation,
# so each side is itself off its exact value. On the tiny model (logits up to ~8) the bfloat16 LoRA model
# is 0.40 away from its own float32 computation and the bfloat16 base 0.18 from the float32 base, and
# merged vs LoRA (both bfloat16) differ by up to 0.46, 5.6% of the largest logit. The bound is 2^-3
# (12.5%) of the largest logit: twice that, and still far below what a missing or mis-mapped LoRA does.
RELATIVE_TOLERANCE = {"float32": 2.0**-12, "bfloat16": 2.0**-3}
# Share of prompt positions whose top token must agree; bfloat16 noise can swap two nearly tied tokens.
MIN_ARGMAX_AGREEMENT = {"float32": 1.0, "bfloat16": 0.95}
_DTYPES = {"F32": "float32", "BF16": "bfloat16"}


def tolerance_for(dtype: str, max_abs_logit: float) -> float:
    """The largest |logit difference| a merge in ``dtype`` may show, where the logits reach ``max_abs_logit``."""
    return RELATIVE_TOLERANCE[dtype] * max_abs_logit


def default_prompts(vocab_size: int, bos_id: int, count: int = 4, length: int = 24) -> list[list[int]]:
    """Fixed pseudo-random token ids (seeded), each prompt starting with <bos>."""
    rng = np.random.default_rng(1234)
    low = min(16, vocab_size - 1)  # past the special tokens
    return [[bos_id, *rng.integers(low, vocab_size, length - 1).tolist()] for _ in range(count)]


def weights_dtype(checkpoint: Checkpoint) -> str:
    """The dtype of a checkpoint's text-model weights (its embedding's), as load_base_model names it."""
    name = mapping.text_prefix(checkpoint.shapes, checkpoint.url) + "embed_tokens.weight"
    dtype = next(t.dtype for t in checkpoint.tensors if t.name == name)
    if dtype not in _DTYPES:
        raise ValueError(f"{checkpoint.url}: {name} is {dtype}; verifying needs float32 or bfloat16 weights")
    return _DTYPES[dtype]


def verification_mesh(config):
    """An fsdp mesh over this host's devices, as wide as the model's width allows: the models are spread
    over the host's chips as training spreads them (a 31B merge in bfloat16, 57 GiB, does not fit one
    31.25 GiB v6e chip, but fits eight)."""
    import jax

    from worker.training.engine import make_mesh

    n = jax.local_device_count()
    fsdp = max(d for d in range(1, n + 1) if n % d == 0 and config.embed_dim % d == 0)
    return make_mesh(fsdp, 1)


def per_device_bytes(model) -> int:
    """The bytes of the model's parameters held by its first device (the most any one device holds, with
    even shards)."""
    import jax
    from flax import nnx

    arrays = [x for x in jax.tree.leaves(nnx.state(model)) if isinstance(x, jax.Array)]
    first = arrays[0].addressable_shards[0].device
    return sum(s.data.nbytes for x in arrays for s in x.addressable_shards if s.device == first)


def lora_model(
    base_dir: str,
    checkpoint_dir: str,
    *,
    rank: int,
    alpha: float,
    target_modules: Sequence[str],
    dtype: str,
    mesh=None,
):
    """The base with the checkpoint's LoRA applied by Qwix, as training ran it (over ``mesh``, if given:
    call it inside ``with mesh:``)."""
    import orbax.checkpoint as ocp
    from etils import epath
    from flax import nnx

    from worker.training import engine, models

    config = models.resolve_config(base_dir)
    model = models.load_base_model(base_dir, config, mesh=mesh, dtype=dtype)
    # The LoRA fields of a TrainSpec, which is all engine.apply_lora reads.
    lora = SimpleNamespace(
        target_modules=tuple(target_modules), lora_rank=rank, lora_alpha=alpha, lora_dropout=0.0, seed=0, dtype=dtype
    )
    model, _ = engine.apply_lora(model, lora, models.RematConfig.NONE)  # pyright: ignore[reportArgumentType]
    state = nnx.state(model, nnx.LoRAParam)
    handler = ocp.PyTreeCheckpointHandler()
    try:
        restored = handler.restore(
            epath.Path(checkpoint_dir) / "model_params",
            args=ocp.args.PyTreeRestore(item=state, restore_args=ocp.checkpoint_utils.construct_restore_args(state)),
        )
    finally:
        handler.close()
    nnx.update(model, restored)
    return model


def logits(model, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """Each prompt's logits (length, vocab) as float32, from one padded causal batch."""
    import jax.numpy as jnp
    from flax import nnx

    width = max(len(p) for p in prompts)
    tokens = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p  # right padding: causal attention keeps it out of the real positions
    mask = np.tril(np.ones((width, width), bool))[None].repeat(len(prompts), axis=0)
    # Compiled as one program: run eagerly, each op of the forward pass would compile on its own.
    out, _ = nnx.jit(lambda m, t, a: m(t, None, None, a))(model, jnp.asarray(tokens), jnp.asarray(mask))
    out = np.asarray(out, np.float32)
    return [out[i, : len(p)] for i, p in enumerate(prompts)]


def verify_merged(
    merged_dir: str,
    base_dir: str,
    checkpoint_dir: str,
    *,
    rank: int,
    alpha: float,
    target_modules: Sequence[str],
    prompts: Sequence[Sequence[int]] | None = None,
) -> dict:
    """Compare the logits of the merged checkpoint (through Tunix's loader) with the base + LoRA model's.

    One model is in memory at a time. Returns ``max_abs_diff``, ``argmax_agreement`` (share of
    positions with the same top token), ``tolerance``, ``min_argmax_agreement``, ``passed``, and what
    was compared."""
    from worker.training import models
    from worker.training.engine import configure_compilation_cache

    configure_compilation_cache()  # the same persistent cache as training: the LoRA set-up compiles once
    started = time.perf_counter()
    base = open_checkpoint(base_dir)
    dtype = weights_dtype(open_checkpoint(merged_dir))
    if weights_dtype(base) != dtype:
        raise ValueError(f"{merged_dir} holds {dtype} weights but its base {base_dir} does not")
    config = models.resolve_config(base_dir)
    mesh = verification_mesh(config)
    devices = mesh.devices.size
    if prompts is None:  # a batch that splits evenly over the mesh
        count = -(-max(4, devices) // devices) * devices
        prompts = default_prompts(config.num_embed, hf_config.text_config(base.config).get("bos_token_id", 2), count)
    # `with mesh:` (not jax.set_mesh): Tunix's model reads the mesh from pxla.thread_resources, as in training
    with mesh:
        lora = lora_model(
            base_dir, checkpoint_dir, rank=rank, alpha=alpha, target_modules=target_modules, dtype=dtype, mesh=mesh
        )
        expected = logits(lora, prompts)
        del lora  # one model in memory at a time
        merged = models.load_base_model(merged_dir, config, mesh=mesh, dtype=dtype)
        got = logits(merged, prompts)
        held = per_device_bytes(merged)
        del merged
    diff = max(float(np.abs(a - b).max()) for a, b in zip(expected, got, strict=True))
    same = np.concatenate([a.argmax(-1) == b.argmax(-1) for a, b in zip(expected, got, strict=True)])
    scale = max(float(np.abs(a).max()) for a in expected)
    tolerance = tolerance_for(dtype, scale)
    agreement = float(same.mean())
    return {
        "passed": diff <= tolerance and agreement >= MIN_ARGMAX_AGREEMENT[dtype],
        "max_abs_diff": diff,
        "tolerance": tolerance,
        "argmax_agreement": agreement,
        "min_argmax_agreement": MIN_ARGMAX_AGREEMENT[dtype],
        "max_abs_logit": scale,
        "dtype": dtype,
        "prompts": len(prompts),
        "positions": int(same.size),
        "devices": devices,  # the models were spread over this many devices (fsdp)
        "per_device_bytes": held,  # of the merged model's weights, on each
        "seconds": time.perf_counter() - started,
    }
