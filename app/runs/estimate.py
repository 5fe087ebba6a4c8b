"""Pre-flight estimate for a run on a pool: parameters, memory per chip, time and cost.

Time: LoRA training costs ~4 FLOPs per base parameter per token (forward 2N, backward through
activations 2N; no weight gradients for the frozen base), at an assumed 40% MFU.

Memory: what XLA itself reports for the engine's compiled train step (``memory_analysis()``:
arguments + outputs - donated + temporaries), measured with ``worker/training/memory.py`` on CPU
(jax 0.10.2, Tunix 0.1.7, Qwix LoRA on all projections; ``bench/memory.py`` prints the table and a
test holds every row to within 25%). Per chip, with B rows of T tokens per chip in one micro-batch:

- arguments: the base weights, the f32 LoRA weights and Adam's two moments (12 bytes per LoRA
  parameter);
- outputs not written in place: ``nnx.jit`` hands back the model's whole state, so XLA allocates a
  second copy of the weights (only the optimizer is donated) plus the new LoRA weights;
- temporaries, the terms that grow with the batch:
  - logits and loss: Tunix's default loss holds ~5 f32 copies of the (B, T, V) logits at its peak
    (logits, softcap, log-softmax, one-hot and their cotangents: 20 bytes per token per vocabulary
    entry, measured at V = 1,280, 4,096 and 32,768 to within 1%); 1 MiB per copy per token at
    Gemma 4's 262,144. The chunked loss (``worker/training/loss.py``) holds them for one chunk;
  - attention scores: the non-flash path builds full (B, N, T, T) f32 scores on every layer, the
    sliding window being a mask; the backward of one layer holds ~7 copies of them at once (measured
    on 2- and 4-layer models; no more with more layers, nor less with remat);
  - per layer and token, what the backward keeps: ~7 MLP-width, ~12 model-width and ~7.5 query-width
    (heads x head_dim) values without remat; ``block`` remat keeps one MLP-width copy less, ``decoder``
    ~2.6 model-width copies more (XLA's CPU scheduler recomputes early, so remat saves little in
    these measurements; TPU compiles may keep less, which makes the estimate conservative there);
  - the LoRA gradients (f32).
"""

from dataclasses import asdict, dataclass, field

from app.base_models.presets import Architecture, BaseModel, lora_params
from app.pools.models import ACCELERATORS, GiB, Pool
from app.runs.models import RunConfig

ASSUMED_MFU = 0.4
USABLE = 0.9  # of a chip's memory, for what the estimate leaves out (XLA's code, fragmentation, host buffers)

# Measured coefficients (see the module docstring and bench/memory.py).
LOGITS_BYTES_PER_TOKEN_AND_ENTRY = 20  # default loss: ~5 f32 copies of the logits
# chunked loss: one chunk's logits and their recomputation in the backward (~3 f32 copies, measured at V = 262,144
# with 256-token chunks) plus an f32 copy of the tied embedding for the chunk's matmul, counted here
CHUNK_BYTES_PER_TOKEN_AND_ENTRY = 12
SCORE_COPIES = 7  # f32 (B, N, T, T) attention scores alive at once in one layer's backward
# Values kept per layer and token: (x MLP width, x model width, x query width), by remat setting.
KEPT_PER_LAYER = {"none": (7.0, 12.0, 7.5), "block": (6.0, 12.0, 7.5), "decoder": (7.0, 14.6, 7.7)}
# The engine chunks the loss (`loss_chunk_tokens` None) when a micro-batch's f32 logits on a device
# would take more than this many bytes, by this many tokens.
AUTO_LOGITS_BYTES = 256 * 1024**2
AUTO_CHUNK_TOKENS = 1024
FIT_GRID_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384, 32768)


def loss_chunk(setting: int | None, tokens_per_chip: int, vocab: int) -> int | None:
    """The loss chunk the engine uses (None: Tunix's default loss). ``setting`` is the run's
    ``loss_chunk_tokens``: 0 never chunks, N > 0 always chunks by N, None chunks by AUTO_CHUNK_TOKENS
    when a micro-batch's f32 logits per device exceed AUTO_LOGITS_BYTES."""
    if setting == 0:
        return None
    if setting is not None:
        return setting
    return AUTO_CHUNK_TOKENS if tokens_per_chip * vocab * 4 > AUTO_LOGITS_BYTES else None


@dataclass
class Memory:
    """Bytes per chip of one train step, by part."""

    weights: float
    lora_and_optimizer: float
    outputs: float  # the step's outputs not written over a donated input
    logits: float
    attention: float
    layers: float  # what the layers keep for the backward
    lora_grads: float

    @property
    def temp(self) -> float:
        return self.logits + self.attention + self.layers + self.lora_grads

    @property
    def total(self) -> float:
        return self.weights + self.lora_and_optimizer + self.outputs + self.temp


def step_memory(
    arch: Architecture,
    *,
    batch_per_chip: float,
    seq_len: int,
    remat: str,
    dtype: str,
    lora: int,
    chips: int = 1,
    tp: int = 1,
    weight_bytes: float | None = None,
    chunk: int | None = None,
    replicas: int = 1,
) -> Memory:
    """The memory model of the train step for one micro-batch of ``batch_per_chip`` rows per chip, the
    weights split over ``chips`` (one replica's); with replicas of one chip each, the step also concatenates
    every LoRA gradient into the one buffer it sums across them: one more f32 copy (XLA's temporaries grew by
    1.2 copies with replicas, measured on the tiny model at LoRA rank 256, where the LoRA weights dominate)."""
    act_bytes = 2 if dtype == "bfloat16" else 4
    if weight_bytes is None:
        weight_bytes = act_bytes
    tokens = batch_per_chip * seq_len
    weights = arch.params() * weight_bytes / chips
    if chunk:
        # one chunk's logits, plus the final hidden state and its gradient for every token
        logits = CHUNK_BYTES_PER_TOKEN_AND_ENTRY * min(chunk, tokens) * arch.vocab_size / tp
        logits += 2 * tokens * arch.d_model * act_bytes
    else:
        logits = LOGITS_BYTES_PER_TOKEN_AND_ENTRY * tokens * arch.vocab_size / tp
    heads = arch.num_heads / tp
    attention = SCORE_COPIES * batch_per_chip * heads * seq_len * seq_len * 4
    f, d, q = KEPT_PER_LAYER[remat]
    kept = 0.0
    for is_global, ffn in arch.layers():
        width_q = arch.num_heads * (arch.global_head_dim if is_global else arch.head_dim)
        kept += f * ffn / tp + d * arch.d_model + q * width_q / tp
    layers = kept * tokens * act_bytes
    return Memory(
        weights=weights,
        lora_and_optimizer=12 * lora / chips,
        outputs=weights + 4 * lora / chips,
        logits=logits,
        attention=attention,
        layers=layers,
        lora_grads=(8 if replicas > 1 and chips == 1 else 4) * lora / chips,
    )


@dataclass
class Estimate:
    params: int
    lora_params: int
    mesh: str
    weights_gib_per_chip: float
    lora_and_optimizer_gib_per_chip: float
    activations_gib_per_chip: float
    activations_gib_per_chip_with_remat: float
    total_gib_per_chip: float
    chip_memory_gib: float
    fits: bool
    warning: str | None
    tokens: int | None
    seconds: float | None
    cost_usd: float | None
    # Added with the XLA-grounded model (the fields above keep their meaning):
    outputs_gib_per_chip: float = 0.0  # the step's second copy of the weights (see the module docstring)
    logits_gib_per_chip: float = 0.0
    attention_gib_per_chip: float = 0.0
    loss_chunk_tokens: int | None = None  # the chunk the engine will use; None: Tunix's default loss
    activations_gib_per_chip_by_remat: dict = field(default_factory=dict)
    usable_gib_per_chip: float = 0.0
    lower: str | None = None  # where it does not fit: the request field to lower (e.g. "config.max_seq_len")
    # The settings that fit on this pool with this mesh and loss setting: {batch_size, max_seq_len, remat}
    # (batch_size per optimizer step without gradient accumulation).
    fitting: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def mesh_name(dp: int, fsdp: int, tp: int) -> str:
    """How a mesh is shown (the estimate, the engine's events and errors): dp only where there are replicas."""
    return f"dp={dp} x fsdp={fsdp} x tp={tp}" if dp > 1 else f"fsdp={fsdp} x tp={tp}"


def estimate(
    base: BaseModel, config: RunConfig, pool: Pool, fsdp: int, tp: int, dataset_tokens: int | None, *, dp: int = 1
) -> Estimate:
    """Per chip of a (dp, fsdp, tp) mesh: each of the dp replicas holds the weights over its fsdp x tp chips."""
    arch = base.arch
    shards = fsdp * tp  # what one replica's weights are split over
    chips = dp * shards
    params = arch.params()
    lora = lora_params(arch, config.lora_rank, tuple(config.target_modules))
    weight_bytes = {"float32": 4, "bfloat16": 2}[config.dtype]
    if config.quantization == "nf4":
        weight_bytes = 0.5
    elif config.quantization == "int8":
        weight_bytes = 1
    micro = config.batch_size // config.grad_accum_steps
    per_chip_batch = micro / (dp * fsdp)
    # As the engine decides (worker/training/engine.py make_trainer): tokens of a micro-batch per data shard.
    chunk = loss_chunk(config.loss_chunk_tokens, micro * config.max_seq_len // (dp * fsdp), arch.vocab_size)

    def memory(
        remat: str, batch: float = per_chip_batch, seq: int = config.max_seq_len, chunk: int | None = chunk
    ) -> Memory:
        return step_memory(
            arch,
            batch_per_chip=batch,
            seq_len=seq,
            remat=remat,
            dtype=config.dtype,
            lora=lora,
            chips=shards,
            tp=tp,
            weight_bytes=weight_bytes,
            chunk=chunk,
            replicas=dp,
        )

    chip = ACCELERATORS.get(pool.accelerator, ACCELERATORS["cpu"])
    by_remat = {r: memory(r) for r in KEPT_PER_LAYER}
    fitting = []
    for rows in (1, 2, 4, 8):
        for seq in FIT_GRID_LENGTHS:
            for remat in KEPT_PER_LAYER:
                m = memory(remat, rows, seq, loss_chunk(config.loss_chunk_tokens, rows * seq, arch.vocab_size))
                if m.total <= USABLE * chip.memory:
                    fitting.append({"batch_size": rows * dp * fsdp, "max_seq_len": seq, "remat": remat})
    mem = by_remat[config.remat]
    usable = USABLE * chip.memory
    total = mem.total
    fits = total <= usable
    warning = lower = None
    if not fits:
        lower, hint = _what_to_lower(config, by_remat, memory, usable, per_chip_batch, dp)
        warning = (
            f"needs ~{total / GiB:.1f} GiB per chip but a {pool.accelerator} chip has {chip.memory / GiB:.0f} GiB "
            f"({usable / GiB:.0f} GiB usable): {hint}"
        )
    tokens = seconds = cost = None
    if dataset_tokens:
        tokens = dataset_tokens * (config.epochs or 1)
        if config.max_steps:
            tokens = config.max_steps * config.batch_size * config.max_seq_len
        seconds = 4 * params * tokens / (chip.peak_flops * chips * ASSUMED_MFU)
        cost = seconds / 3600 * chips * pool.price_per_chip_hour
    remat_for_display = config.remat if config.remat != "none" else "block"

    def activations(m: Memory) -> float:
        return round(m.temp / GiB, 3)

    return Estimate(
        params=params,
        lora_params=lora,
        mesh=mesh_name(dp, fsdp, tp),
        weights_gib_per_chip=round(mem.weights / GiB, 3),
        lora_and_optimizer_gib_per_chip=round(mem.lora_and_optimizer / GiB, 3),
        activations_gib_per_chip=activations(by_remat["none"]),
        activations_gib_per_chip_with_remat=activations(by_remat[remat_for_display]),
        total_gib_per_chip=round(total / GiB, 3),
        chip_memory_gib=round(chip.memory / GiB, 2),
        fits=fits,
        warning=warning,
        tokens=tokens,
        seconds=seconds,
        cost_usd=cost,
        outputs_gib_per_chip=round(mem.outputs / GiB, 3),
        logits_gib_per_chip=round(mem.logits / GiB, 3),
        attention_gib_per_chip=round(mem.attention / GiB, 3),
        loss_chunk_tokens=chunk,
        activations_gib_per_chip_by_remat={r: activations(m) for r, m in by_remat.items()},
        usable_gib_per_chip=round(usable / GiB, 3),
        lower=lower,
        fitting=fitting,
    )


def _what_to_lower(
    config: RunConfig, by_remat: dict, memory, usable: float, per_chip_batch: float, dp: int
) -> tuple[str, str]:
    """(the request field to lower, a hint) for a run that does not fit."""
    best = min(by_remat, key=lambda r: by_remat[r].total)
    if config.remat != best and by_remat[best].total <= usable:
        return "config.remat", f"set remat to {best!r}"
    if per_chip_batch > 1 and memory(config.remat, batch=1).total <= usable:
        return (
            "config.batch_size",
            "lower batch_size (or raise grad_accum_steps) to one row per data-parallel chip",
        )
    seq = config.max_seq_len
    while seq > 8 and memory(config.remat, batch=min(per_chip_batch, 1), seq=seq).total > usable:
        seq //= 2
    if memory(config.remat, batch=min(per_chip_batch, 1), seq=seq).total <= usable:
        which = "batch_size and max_seq_len" if per_chip_batch > 1 else "max_seq_len"
        field = "config.batch_size" if per_chip_batch > 1 and seq == config.max_seq_len else "config.max_seq_len"
        return field, f"lower {which} (~{seq} tokens per row fits), or use more chips (mesh_tp splits the heads)"
    if dp > 1:
        return "config.mesh_dp", "lower mesh_dp: each of its replicas holds all the weights over fsdp x tp chips"
    return "pool", "the weights alone do not fit: use a pool with more chips or memory"
