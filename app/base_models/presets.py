"""Base models a run can start from: presets with the architecture facts that validation and the
pre-flight estimate need. The worker maps the same preset names to Tunix model configs.

Figures: the Gemma 4 presets as Tunix defines them (a test checks every figure against Tunix's
model); `tiny-gemma4` is the small model with the 31B's structure (sliding + global layers, GQA,
K=V global layers) that a worker makes on first start.
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
    num_global_kv_heads: int | None  # None: as num_kv_heads
    global_every: int  # one global layer per this many layers (the rest slide)
    vocab_size: int
    sliding_window: int  # the sliding layers' window (tokens)
    final_logit_softcap: float | None
    k_eq_v: bool = True  # global layers have one projection used as both K and V
    per_layer_input_dim: int = 0  # E2B/E4B: per-layer token embeddings of this width
    kv_shared_layers: int = 0  # E2B/E4B: the last layers reuse earlier layers' KV cache
    double_wide_mlp: bool = False  # ... and then have an MLP twice as wide

    @property
    def global_kv_heads(self) -> int:
        return self.num_global_kv_heads or self.num_kv_heads

    def layers(self) -> list[tuple[bool, int]]:
        """(is_global, MLP width) of every layer."""
        return [
            (
                (i + 1) % self.global_every == 0,
                self.ffn_dim * 2
                if self.double_wide_mlp and i >= self.num_layers - self.kv_shared_layers
                else self.ffn_dim,
            )
            for i in range(self.num_layers)
        ]

    def params(self) -> int:
        """Weights in matrices (embeddings and projections, as Tunix holds them; the output layer is
        tied to the embeddings); norm scales are left out (under 0.01%)."""
        d = self.d_model
        total = self.vocab_size * d
        if self.per_layer_input_dim:
            p = self.per_layer_input_dim
            total += self.vocab_size * self.num_layers * p + d * self.num_layers * p  # embedding + projection
        for is_global, ffn in self.layers():
            head_dim = self.global_head_dim if is_global else self.head_dim
            kv_heads = self.global_kv_heads if is_global else self.num_kv_heads
            kv = (1 if is_global and self.k_eq_v else 2) * kv_heads * head_dim * d
            total += 2 * self.num_heads * head_dim * d + kv + 3 * d * ffn
            if self.per_layer_input_dim:
                total += 2 * d * self.per_layer_input_dim  # per-layer input gate and projection
        return total


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
                sliding_window=32,
                final_logit_softcap=30.0,
            ),
            local=True,
        ),
        BaseModel(
            "gemma-4-e2b",
            "Gemma 4 E2B: 35 layers, 4 sliding : 1 global, per-layer embeddings, KV sharing",
            Architecture(
                num_layers=35,
                d_model=1536,
                ffn_dim=6144,
                num_heads=8,
                head_dim=256,
                num_kv_heads=1,
                global_head_dim=512,
                num_global_kv_heads=None,
                global_every=5,
                vocab_size=262144,
                sliding_window=512,
                final_logit_softcap=30.0,
                k_eq_v=False,
                per_layer_input_dim=256,
                kv_shared_layers=20,
                double_wide_mlp=True,
            ),
        ),
        BaseModel(
            "gemma-4-e4b",
            "Gemma 4 E4B: 42 layers, 5 sliding : 1 global, per-layer embeddings, KV sharing",
            Architecture(
                num_layers=42,
                d_model=2560,
                ffn_dim=10240,
                num_heads=8,
                head_dim=256,
                num_kv_heads=2,
                global_head_dim=512,
                num_global_kv_heads=None,
                global_every=6,
                vocab_size=262144,
                sliding_window=512,
                final_logit_softcap=30.0,
                k_eq_v=False,
                per_layer_input_dim=256,
                kv_shared_layers=18,
            ),
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
                sliding_window=1024,
                final_logit_softcap=30.0,
            ),
        ),
    )
}

HF_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_params(arch: Architecture, rank: int, targets: tuple[str, ...]) -> int:
    """Trainable LoRA parameters: r x (in + out) per targeted projection, as Qwix shapes them on
    Tunix's modules: K and V are one einsum on sliding layers (A: d x r, B: r x 2 x K x H) and one K
    projection on global K=V layers, so either HF name targets that one module."""
    d, r = arch.d_model, rank
    modules = {"kv" if t in ("k_proj", "v_proj") else t for t in targets}
    total = 0
    for is_global, ffn in arch.layers():
        head_dim = arch.global_head_dim if is_global else arch.head_dim
        kv_heads = arch.global_kv_heads if is_global else arch.num_kv_heads
        kv_out = (1 if is_global and arch.k_eq_v else 2) * kv_heads * head_dim
        sizes = {
            "q_proj": d + arch.num_heads * head_dim,
            "kv": d + kv_out,
            "o_proj": arch.num_heads * head_dim + d,
            "gate_proj": d + ffn,
            "up_proj": d + ffn,
            "down_proj": ffn + d,
        }
        total += r * sum(sizes[m] for m in modules)
    return total
