"""Training performance figures: model FLOPs per token, MFU against the accelerator's peak, memory.

MFU here is *model* FLOPs utilisation in the PaLM sense: the FLOPs the model needs per token, not
what the hardware executed (remat's recompute is not counted). For a LoRA fine-tune the base weights
are frozen, so a token costs the forward matmuls (2 FLOPs per weight), the backward pass to the
activations (2 per weight, no weight gradients), the LoRA adapters' full forward + backward
(6 per LoRA weight), and attention scores (forward, and twice that backward).
"""

from __future__ import annotations

import resource

import jax
import numpy as np
from flax import nnx

from worker.training import models

# Dense bf16 peak per chip (FLOP/s), from the vendors' published figures. An accelerator missing
# here (and the CPU) gets no MFU: a made-up peak would be worse than none.
PEAK_FLOPS: dict[str, float] = {
    "tpu v4": 275e12,
    "tpu v5 lite": 197e12,  # v5e
    "tpu v5e": 197e12,
    "tpu v5p": 459e12,
    "tpu v5": 459e12,
    "tpu v6 lite": 918e12,  # v6e (Trillium)
    "tpu v6e": 918e12,
    "tpu7x": 2307e12,
    "nvidia h100": 989e12,
    "nvidia h200": 989e12,
    "nvidia gh200": 989e12,
    "nvidia b200": 2250e12,
    "nvidia a100": 312e12,
    "nvidia l4": 121e12,
}


def peak_flops(device) -> float | None:
    """The bf16 peak of one chip, by JAX's ``device_kind``; the longest matching prefix wins."""
    kind = device.device_kind.lower()
    matches = [k for k in PEAK_FLOPS if kind.startswith(k)]
    return PEAK_FLOPS[max(matches, key=len)] if matches else None


def _attended(seq_len: int, window: int | None) -> float:
    """Mean number of positions a causal query attends to over a sequence of ``seq_len``."""
    pos = np.arange(1, seq_len + 1)
    return float(np.minimum(pos, window).mean()) if window else (seq_len + 1) / 2


def flops_per_token(model, config: models.ModelConfig, seq_len: int) -> float:
    """Model FLOPs to train one token of a LoRA model (see the module docstring)."""
    base = lora = 0
    for _, leaf in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = leaf.get_value() if hasattr(leaf, "get_value") else leaf.value
        if isinstance(leaf, nnx.LoRAParam):
            lora += value.size
        elif value.ndim >= 2:  # matmul weights; the tied embedding counts once, as the output projection
            base += value.size
    attn = 0.0
    pattern = config.attention_pattern or models.gemma4.GEMMA4_ATTENTION_PATTERN  # Tunix's when unset
    for layer in range(config.num_layers):
        kind = pattern[layer % len(pattern)]
        is_global = kind == models.AttentionType.GLOBAL
        head_dim = config.global_key_size if is_global and config.global_key_size else config.head_dim
        window = None if is_global else config.sliding_window_size
        attn += 4 * config.num_heads * head_dim * _attended(seq_len, window)  # QK^T and AV
    return 4.0 * base + 6.0 * lora + 3.0 * attn


def device_memory_gb() -> float | None:
    """Peak accelerator memory in use on the busiest local chip, in GB (None where JAX can't tell, e.g. CPU)."""
    peaks = []
    for d in jax.local_devices():
        stats = d.memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            peaks.append(stats["peak_bytes_in_use"])
    return max(peaks) / 1e9 if peaks else None


def host_peak_rss_gb() -> float:
    """This process's peak resident memory, in GB (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


class CompileClock:
    """Seconds this process has spent compiling with JAX so far (tracing, lowering, XLA compile or
    loading the executable from the persistent cache), from JAX's own monitoring events."""

    EVENTS = (
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/jaxpr_to_mlir_module_duration",
        "/jax/core/compile/backend_compile_duration",
    )

    def __init__(self) -> None:
        self.seconds = 0.0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration_secs: float, **_) -> None:
        if event in self.EVENTS:
            self.seconds += duration_secs
