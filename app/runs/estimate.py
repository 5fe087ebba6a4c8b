"""Pre-flight estimate for a run on a pool: parameters, memory per chip, time and cost.

Rules of thumb, stated so they can be checked: LoRA training costs ~4 FLOPs per base parameter per
token (forward 2N, backward through activations 2N; no weight gradients for the frozen base),
at an assumed 40% MFU. Activations kept per token and layer: ~17 x d_model values without remat
(after Korthikanti et al. 2022, attention kept linear by the sliding window), one d_model input
per layer plus one layer's worth with block remat.
"""

from dataclasses import asdict, dataclass

from app.base_models.presets import BaseModel, lora_params
from app.pools.models import Pool
from app.runs.models import RunConfig

GiB = 1024**3
ASSUMED_MFU = 0.4

# Per chip: HBM bytes and peak bf16 FLOP/s (published figures).
ACCELERATORS = {
    "tpu-v5p-8": (95 * GiB, 459e12),
    "tpu-v6e-8": (32 * GiB, 918e12),
    "tpu-v5e-8": (16 * GiB, 197e12),
    "gpu-h100x1": (80 * GiB, 989e12),
    "gpu-h100x2": (80 * GiB, 989e12),
    "gpu-h100x8": (80 * GiB, 989e12),
    "gpu-h200x1": (141 * GiB, 989e12),
    "cpu": (16 * GiB, 1e11),
}


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

    def as_dict(self) -> dict:
        return asdict(self)


def estimate(
    base: BaseModel, config: RunConfig, pool: Pool, fsdp: int, tp: int, dataset_tokens: int | None
) -> Estimate:
    arch = base.arch
    chips = fsdp * tp
    params = arch.params()
    lora = lora_params(arch, config.lora_rank, tuple(config.target_modules))
    weight_bytes = {"float32": 4, "bfloat16": 2}[config.dtype]
    if config.quantization == "nf4":
        weight_bytes = 0.5
    elif config.quantization == "int8":
        weight_bytes = 1
    weights = params * weight_bytes / chips
    lora_state = lora * 4 * 4 / chips  # f32 weights, grads, Adam m and v
    per_chip_batch = config.batch_size / config.grad_accum_steps / fsdp
    tokens_per_chip = per_chip_batch * config.max_seq_len
    act_bytes = 2 if config.dtype == "bfloat16" else 4
    act_full = tokens_per_chip * arch.num_layers * arch.d_model * 17 * act_bytes / tp
    act_remat = (
        tokens_per_chip * arch.num_layers * arch.d_model * act_bytes + tokens_per_chip * arch.d_model * 17 * act_bytes
    )
    act = act_full if config.remat == "none" else act_remat
    hbm, peak = ACCELERATORS.get(pool.accelerator, ACCELERATORS["cpu"])
    total = weights + lora_state + act
    fits = total <= 0.9 * hbm
    warning = None
    if not fits:
        hint = (
            "set remat to 'block'"
            if config.remat == "none" and weights + lora_state + act_remat <= 0.9 * hbm
            else ("lower batch_size or max_seq_len, raise grad_accum_steps, or use more chips")
        )
        warning = f"needs ~{total / GiB:.1f} GiB per chip but a {pool.accelerator} chip has {hbm / GiB:.0f} GiB: {hint}"
    tokens = seconds = cost = None
    if dataset_tokens:
        tokens = dataset_tokens * (config.epochs or 1)
        if config.max_steps:
            tokens = config.max_steps * config.batch_size * config.max_seq_len
        seconds = 4 * params * tokens / (peak * chips * ASSUMED_MFU)
        cost = seconds / 3600 * chips * pool.price_per_chip_hour
    return Estimate(
        params=params,
        lora_params=lora,
        mesh=f"fsdp={fsdp} x tp={tp}",
        weights_gib_per_chip=round(weights / GiB, 3),
        lora_and_optimizer_gib_per_chip=round(lora_state / GiB, 3),
        activations_gib_per_chip=round(act_full / GiB, 3),
        activations_gib_per_chip_with_remat=round(act_remat / GiB, 3),
        total_gib_per_chip=round(total / GiB, 3),
        chip_memory_gib=round(hbm / GiB, 1),
        fits=fits,
        warning=warning,
        tokens=tokens,
        seconds=seconds,
        cost_usd=cost,
    )
