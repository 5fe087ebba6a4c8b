"""Base models a run can start from: presets with the architecture facts that validation and the
pre-flight estimate need. The worker maps the same preset names to Tunix model configs.

Figures: Gemma 4 31B from its published config; `tiny-gemma4` is the small model with the 31B's
structure (sliding + global layers, GQA, K=V global layers) that a worker makes on first start.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    num_layers: int
    d_model: int
    ffn_dim: int
    num_heads: int
    head_dim: int
    num_kv_heads: int
    global_head_dim: int
    num_global_kv_heads: int
    global_every: int  # one global layer per this many layers (the rest slide)
    vocab_size: int

    def params(self) -> int:
        """Text parameters: embeddings (tied) + attention + MLP + norms, per the Gemma 4 layout."""
        n_global = self.num_layers // self.global_every
        n_sliding = self.num_layers - n_global
        d = self.d_model
        sliding_attn = d * self.num_heads * self.head_dim * 2 + 2 * d * self.num_kv_heads * self.head_dim
        # Global layers: K = V (one projection), their own head dim.
        global_attn = (
            d * self.num_heads * self.global_head_dim * 2 + d * self.num_global_kv_heads * self.global_head_dim
        )
        mlp = 3 * d * self.ffn_dim
        norms = 4 * d
        return self.vocab_size * d + n_sliding * (sliding_attn + mlp + norms) + n_global * (global_attn + mlp + norms)


@dataclass(frozen=True)
class BaseModel:
    name: str
    description: str
    arch: Architecture
    local: bool = False  # made on this machine (no download)


BASE_MODELS: dict[str, BaseModel] = {
    m.name: m
    for m in (
        BaseModel(
            "tiny-gemma4",
            "A tiny Gemma 4 with the 31B's structure and random weights, made locally (CPU demo)",
            Architecture(
                num_layers=2,
                d_model=64,
                ffn_dim=256,
                num_heads=8,
                head_dim=16,
                num_kv_heads=4,
                global_head_dim=32,
                num_global_kv_heads=2,
                global_every=2,
                vocab_size=1280,
            ),
            local=True,
        ),
        BaseModel(
            "gemma-4-31b",
            "Gemma 4 31B (dense): 60 layers, 5 sliding : 1 global",
            Architecture(
                num_layers=60,
                d_model=5376,
                ffn_dim=21504,
                num_heads=32,
                head_dim=256,
                num_kv_heads=16,
                global_head_dim=512,
                num_global_kv_heads=4,
                global_every=6,
                vocab_size=262144,
            ),
        ),
    )
}

HF_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_params(arch: Architecture, rank: int, targets: tuple[str, ...]) -> int:
    """Trainable LoRA parameters: r x (in + out) per targeted projection."""
    n_global = arch.num_layers // arch.global_every
    n_sliding = arch.num_layers - n_global
    d, r = arch.d_model, rank

    def per_layer(head_dim: int, kv_heads: int, k_eq_v: bool) -> int:
        # Tunix fuses K and V into one einsum on sliding layers (A: d x r, B: r x 2 x K x H) and has
        # only K on global K=V layers; either HF name targets that one module.
        kv_out = (1 if k_eq_v else 2) * kv_heads * head_dim
        sizes = {
            "q_proj": d + arch.num_heads * head_dim,
            "kv": d + kv_out,
            "o_proj": arch.num_heads * head_dim + d,
            "gate_proj": d + arch.ffn_dim,
            "up_proj": d + arch.ffn_dim,
            "down_proj": arch.ffn_dim + d,
        }
        modules = {"kv" if t in ("k_proj", "v_proj") else t for t in targets}
        return r * sum(sizes[m] for m in modules)

    return n_sliding * per_layer(arch.head_dim, arch.num_kv_heads, False) + n_global * per_layer(
        arch.global_head_dim, arch.num_global_kv_heads, True
    )
