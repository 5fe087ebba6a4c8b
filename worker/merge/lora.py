"""Reading the LoRA weights of a training checkpoint, without building the model."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

_SUFFIXES = ("_lora_a", "_lora_b")


class LoraWeights(NamedTuple):
    """One Qwix LoRA pair as Tunix saved it (shapes in ``worker.merge.mapping``)."""

    a: np.ndarray
    b: np.ndarray


def load_lora(checkpoint_dir: str) -> dict[str, LoraWeights]:
    """The LoRA pairs of ``<checkpoint_dir>/model_params`` keyed by Tunix module path
    (``layers/0/attn/q_einsum``), as host numpy arrays.

    ``checkpoint_dir`` is a step directory the trainer wrote (``<output_dir>/checkpoints/<step>``, a
    local path or any URL Orbax reads). The arrays are restored from the checkpoint's own metadata, so
    neither the model nor the training mesh is needed; they are small (r=16 on all projections of
    31B: 118M float32 values)."""
    import jax
    import orbax.checkpoint as ocp
    from etils import epath

    path = epath.Path(checkpoint_dir) / "model_params"
    if not path.exists():
        raise FileNotFoundError(
            f"{checkpoint_dir}: no model_params (expected a training checkpoint, <output_dir>/checkpoints/<step>)"
        )
    handler = ocp.PyTreeCheckpointHandler()
    try:
        tree = handler.metadata(path).tree
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        params = handler.restore(path, args=ocp.args.PyTreeRestore(restore_args=restore_args))
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{path}: not a readable Orbax checkpoint: {exc}") from exc
    finally:
        handler.close()

    halves: dict[str, dict[str, np.ndarray]] = {}
    for keys, value in _leaves(params, ()):
        keys = keys[:-1] if keys[-1] == "value" else keys  # nnx variable state: {"value": array}
        param = keys[-1]
        if not param.endswith(_SUFFIXES):
            raise ValueError(f"{path}: {'/'.join(keys)} is not a LoRA weight (expected only *_lora_a/*_lora_b)")
        module = "/".join(keys[:-1])
        halves.setdefault(module, {})[param[-1]] = np.asarray(value)
    if not halves:
        raise ValueError(f"{path}: the checkpoint holds no LoRA weights")
    out = {}
    for module, pair in sorted(halves.items()):
        if set(pair) != {"a", "b"}:
            raise ValueError(f"{path}: LoRA module {module} has only its {'A' if 'a' in pair else 'B'} matrix")
        out[module] = LoraWeights(pair["a"], pair["b"])
    return out


def _leaves(node, keys: tuple[str, ...]):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, (*keys, str(k)))
    else:
        yield keys, node
