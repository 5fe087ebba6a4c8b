"""Where each Tunix LoRA weight goes in a Hugging Face Gemma 4 checkpoint: the one place that knows.

Per layer (layer kinds from config.json through ``models.model_config_from_hf``):

    Tunix module              HF weight (out, in)           LoRA A     LoRA B
    attn/q_einsum             self_attn.q_proj              (D, r)     (r, N, H)
    attn/kv_einsum (sliding)  self_attn.k_proj and v_proj   (D, r)     (r, 2, K, H): [:, 0] K, [:, 1] V
    attn/k_einsum (K=V)       self_attn.k_proj (no v_proj)  (D, r)     (r, K, H)
    attn/attn_vec_einsum      self_attn.o_proj              (N, H, r)  (r, D)
    mlp/{gate,up,down}_proj   mlp.{gate,up,down}_proj       (in, r)    (r, out)

In every case ``delta(out, in) = (A.reshape(-1, r) @ B.reshape(r, -1)).T * alpha / r``, so PEFT's
``lora_A`` is ``A.reshape(-1, r).T`` (r, in) and ``lora_B`` is ``B.reshape(r, -1).T`` (out, r): the merge
and the adapter export share the factors computed here. Shapes are checked against the base's own
tensors, never assumed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
from tunix.models.gemma4 import model as gemma4

from worker.merge.lora import LoraWeights
from worker.training import models

# The text model's tensor prefix: Gemma4ForConditionalGeneration (Google's released layout) first,
# then Gemma4ForCausalLM. A merge keeps whichever the base uses, so config.json and names agree.
TEXT_PREFIXES = ("model.language_model.", "model.")


@dataclasses.dataclass(frozen=True)
class Projection:
    """One HF projection weight that a Tunix LoRA module adapts."""

    module: str  # Tunix module path, as Qwix matches it: "layers/0/attn/kv_einsum"
    hf_module: str  # HF module path under the text prefix: "layers.0.self_attn.v_proj"
    target: str  # HF target-module name: "v_proj"
    part: int | None = None  # the slice of a fused LoRA B (kv_einsum: 0 = K, 1 = V)


def projections(config: models.ModelConfig) -> dict[str, tuple[Projection, ...]]:
    """Tunix LoRA module path -> the HF projections it adapts, for every layer of ``config``."""
    pattern = config.attention_pattern or gemma4.GEMMA4_ATTENTION_PATTERN
    out: dict[str, tuple[Projection, ...]] = {}
    for i in range(config.num_layers):
        attn, mlp, hf = f"layers/{i}/attn/", f"layers/{i}/mlp/", f"layers.{i}."
        out[attn + "q_einsum"] = (Projection(attn + "q_einsum", hf + "self_attn.q_proj", "q_proj"),)
        if config.k_eq_v_global and pattern[i % len(pattern)] == models.AttentionType.GLOBAL:
            out[attn + "k_einsum"] = (Projection(attn + "k_einsum", hf + "self_attn.k_proj", "k_proj"),)
        else:
            out[attn + "kv_einsum"] = (
                Projection(attn + "kv_einsum", hf + "self_attn.k_proj", "k_proj", part=0),
                Projection(attn + "kv_einsum", hf + "self_attn.v_proj", "v_proj", part=1),
            )
        out[attn + "attn_vec_einsum"] = (Projection(attn + "attn_vec_einsum", hf + "self_attn.o_proj", "o_proj"),)
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[mlp + name] = (Projection(mlp + name, hf + "mlp." + name, name),)
    return out


def text_prefix(names: Mapping[str, object], where: str) -> str:
    """The base's text-model tensor prefix, found from where its embedding lives."""
    for prefix in TEXT_PREFIXES:
        if prefix + "embed_tokens.weight" in names:
            return prefix
    raise ValueError(
        f"{where}: no 'model.embed_tokens.weight' or 'model.language_model.embed_tokens.weight' tensor "
        "(expected a Hugging Face Gemma 4 checkpoint)"
    )


@dataclasses.dataclass(frozen=True)
class HFLora:
    """The LoRA factors of one HF weight in PEFT's layout: ``delta = b @ a * alpha / r``."""

    tensor: str  # the base's tensor name: "model.layers.0.self_attn.v_proj.weight"
    module: str  # the Tunix module it comes from
    target: str
    a: np.ndarray  # lora_A (r, in), float32 (a view of the checkpoint's array)
    b: np.ndarray  # lora_B (out, r), float32 (a view)


def to_hf(
    lora: Mapping[str, LoraWeights],
    config: models.ModelConfig,
    shapes: Mapping[str, tuple[int, ...]],
    *,
    rank: int,
    where: str,
) -> list[HFLora]:
    """Every LoRA pair of ``lora`` as factors of the base's HF weights, checked against the base's
    tensor ``shapes`` (name -> shape; ``where`` names the base in errors)."""
    prefix = text_prefix(shapes, where)
    table = projections(config)
    out: list[HFLora] = []
    for module, w in lora.items():
        if module not in table:
            raise ValueError(
                f"LoRA module {module} has no Hugging Face counterpart in {where} "
                f"({config.num_layers} layers, K=V global layers: {config.k_eq_v_global}; wrong base model?)"
            )
        if w.a.shape[-1] != rank or w.b.shape[0] != rank:
            raise ValueError(
                f"LoRA module {module} has rank {w.a.shape[-1]} (A {w.a.shape}, B {w.b.shape}), not {rank}"
            )
        for p in table[module]:
            tensor = prefix + p.hf_module + ".weight"
            if tensor not in shapes:
                raise ValueError(f"LoRA module {module}: the base has no tensor {tensor} ({where})")
            b = w.b if p.part is None else w.b[:, p.part]
            # transposed views, no copies (kept once in memory: 472 MB for r=16 on 31B)
            lora_a = w.a.astype(np.float32, copy=False).reshape(-1, rank).T
            lora_b = b.astype(np.float32, copy=False).reshape(rank, -1).T
            delta = (lora_b.shape[0], lora_a.shape[1])
            if tuple(shapes[tensor]) != delta:
                raise ValueError(
                    f"LoRA module {module} (A {w.a.shape}, B {w.b.shape}) gives a {delta} delta for {tensor}, "
                    f"which is {tuple(shapes[tensor])} in {where}"
                )
            out.append(HFLora(tensor, module, p.target, lora_a, lora_b))
    return out
