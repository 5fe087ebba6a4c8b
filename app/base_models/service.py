"""Base models a run can start from: the presets, and sources in HF layout that admins register.

A source is an absolute local directory or an fsspec URL (``gs://`` through gcsfs): what a TPU host
reads its base model from. Registering one reads its ``config.json`` and lists its files, so a typo
or a missing shard is a 422 naming the field now rather than a failed run later. The web process
never imports JAX: the config is compared with the preset's architecture figures here, and the
worker cross-checks it against Tunix's preset when it loads the model.
"""

from __future__ import annotations

import json
import posixpath

import fsspec
from sqlmodel import Session, select

from app.auth.models import User
from app.base_models import hf_config
from app.base_models.models import BaseModelPublic, RegisteredModel, RegisteredModelCreate
from app.base_models.presets import BASE_MODELS, BaseModel
from app.core.config import get_settings
from app.core.echo import echo
from app.runs.models import Run

BUILTIN_SOURCE = "data dir: models/{name}"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers writes a checkpoint's template since 4.5x


class BaseModelError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def resolve(session: Session, name: str) -> tuple[BaseModel, RegisteredModel | None]:
    """The preset behind a base-model name, and its registered source (None for a preset itself)."""
    if name in BASE_MODELS:
        return BASE_MODELS[name], None
    row = session.get(RegisteredModel, name)
    if row is None:
        known = [*BASE_MODELS, *session.exec(select(RegisteredModel.name)).all()]
        raise BaseModelError("base_model", f"unknown base model {echo(name)}; one of {', '.join(known)}")
    return BASE_MODELS[row.preset], row


def _public(preset: BaseModel, row: RegisteredModel | None) -> BaseModelPublic:
    if row is None:
        return BaseModelPublic(
            name=preset.name,
            preset=preset.name,
            source=BUILTIN_SOURCE.format(name=preset.name),
            description=preset.description,
            builtin=True,
            params=preset.arch.params(),
        )
    return BaseModelPublic(
        name=row.name,
        preset=row.preset,
        source=row.source,
        description=row.description or preset.description,
        builtin=False,
        params=preset.arch.params(),
        created_at=row.created_at,
    )


def list_models(session: Session) -> list[BaseModelPublic]:
    rows = session.exec(select(RegisteredModel).order_by(RegisteredModel.name)).all()
    return [_public(p, None) for p in BASE_MODELS.values()] + [_public(BASE_MODELS[r.preset], r) for r in rows]


def get(session: Session, name: str) -> BaseModelPublic | None:
    try:
        return _public(*resolve(session, name))
    except BaseModelError:
        return None


def _config_mismatches(config: dict, preset: BaseModel) -> list[str]:
    """What in a checkpoint's config.json differs from its preset's structure: the same fields the
    worker compares with Tunix's preset (``worker.training.models.STRUCTURE_FIELDS``), read by the same
    reader. Raises hf_config.ConfigError for a config Tunix cannot load at all."""
    c = hf_config.normalized(config)
    arch = preset.arch
    shared = int(c["num_kv_shared_layers"] or 0)
    per_layer = "per_layer_config" in hf_config.text_config(config)
    checks: list[tuple[str, object, object]] = [
        ("num_hidden_layers", c["num_hidden_layers"], arch.num_layers),
        ("hidden_size", c["hidden_size"], arch.d_model),
        ("intermediate_size", c["intermediate_size"], arch.ffn_dim),
        ("num_attention_heads", c["num_attention_heads"], arch.num_heads),
        ("head_dim", c["head_dim"], arch.head_dim),
        ("num_key_value_heads", c["num_key_value_heads"], arch.num_kv_heads),
        (
            "per_layer_config (the full_attention layers' head_dim)" if per_layer else "global_head_dim",
            c["global_head_dim"],
            arch.global_head_dim,
        ),
        (
            "per_layer_config (the full_attention layers' num_key_value_heads)"
            if per_layer
            else "num_global_key_value_heads",
            c["num_global_key_value_heads"] or c["num_key_value_heads"],
            arch.global_kv_heads,
        ),
        ("layer_types", c["layer_types"], ["full_attention" if g else "sliding_attention" for g, _ in arch.layers()]),
        ("attention_k_eq_v", bool(c["attention_k_eq_v"]), arch.k_eq_v),
        ("hidden_size_per_layer_input", int(c["hidden_size_per_layer_input"] or 0), arch.per_layer_input_dim),
        ("num_kv_shared_layers", shared, arch.kv_shared_layers),
        ("use_double_wide_mlp", bool(c["use_double_wide_mlp"] and shared), arch.double_wide_mlp),
        ("sliding_window", c["sliding_window"], arch.sliding_window),
        ("final_logit_softcapping", c["final_logit_softcapping"], arch.final_logit_softcap),
        ("enable_moe_block", bool(c["enable_moe_block"]), False),
    ]
    if not preset.local:  # the tiny model's vocabulary follows the corpus its tokenizer was made from
        checks.append(("vocab_size", c["vocab_size"], arch.vocab_size))
    return [f"{key} is {_shown(got)}, the preset has {_shown(want)}" for key, got, want in checks if got != want]


def _shown(value: object) -> str:
    if isinstance(value, list) and len(value) > 8:
        return f"[{', '.join(map(repr, value[:6]))}, ... ({len(value)} entries)]"
    return repr(value)


def read_chat_template(source: str) -> str | None:
    """A checkpoint's chat template, where transformers reads it: ``chat_template.jinja``, else
    ``tokenizer_config.json``'s ``chat_template`` (a string, or named templates: the ``default`` one).
    None when it has none. ``source``: a local directory or an fsspec URL."""
    fs, root = fsspec.core.url_to_fs(source)
    path = posixpath.join(root, CHAT_TEMPLATE_FILE)
    if fs.isfile(path):
        with fs.open(path, "r", encoding="utf-8") as f:
            return f.read()
    path = posixpath.join(root, "tokenizer_config.json")
    if not fs.isfile(path):
        return None
    with fs.open(path, "r", encoding="utf-8") as f:
        template = json.load(f).get("chat_template")
    if isinstance(template, list):
        template = next(
            (t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None
        )
    return template if isinstance(template, str) and template.strip() else None


def check_chat_template(session: Session, name: str) -> None:
    """Raise BaseModelError('base_model') when the base model's checkpoint has no chat template (so chat
    data cannot be rendered for it). A preset not on this host yet is not judged (tiny-gemma4 is made
    with one; a missing checkpoint fails the run where it is read)."""
    preset, row = resolve(session, name)
    source = str(get_settings().data_dir / "models" / preset.name) if row is None else row.source
    try:
        fs, root = fsspec.core.url_to_fs(source)
        if not fs.isdir(root):
            return
        template = read_chat_template(source)
    except (OSError, ValueError, ImportError) as exc:
        raise BaseModelError("base_model", f"cannot read the chat template of {name} ({source}): {exc}") from exc
    if template is None:
        raise BaseModelError(
            "base_model",
            f"{name} has no chat template (no chat_template.jinja, and no chat_template in tokenizer_config.json): "
            'it can only train on {"text"} datasets',
        )


def check_source(source: str, preset: BaseModel) -> None:
    """The source holds an HF Gemma 4 checkpoint of the preset's shape; raises BaseModelError('source')."""
    if "://" not in source and not source.startswith("/"):
        raise BaseModelError("source", "use an absolute directory (/models/gemma-4-31b) or a URL (gs://bucket/prefix)")
    try:
        fs, root = fsspec.core.url_to_fs(source)
    except (ImportError, ValueError) as exc:  # e.g. gs:// without gcsfs installed
        raise BaseModelError("source", f"cannot open {source}: {exc}") from exc
    try:
        names = {posixpath.basename(p.rstrip("/")) for p in fs.ls(root, detail=False)}
        if "config.json" not in names:
            raise BaseModelError("source", f"{source} has no config.json: expected a Hugging Face checkpoint directory")
        with fs.open(posixpath.join(root, "config.json"), "rb") as f:
            config = json.load(f)
    except FileNotFoundError as exc:
        raise BaseModelError("source", f"{source} does not exist") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise BaseModelError("source", f"cannot read {source}/config.json: {exc}") from exc
    if not isinstance(config, dict):
        raise BaseModelError("source", f"{source}/config.json is not a JSON object")
    if not any(n.endswith(".safetensors") for n in names):
        raise BaseModelError("source", f"{source} has no *.safetensors weights")
    if not names & set(TOKENIZER_FILES):
        raise BaseModelError("source", f"{source} has no tokenizer ({' or '.join(TOKENIZER_FILES)})")
    model_type = hf_config.text_config(config).get("model_type") or config.get("model_type")
    if model_type not in ("gemma4", "gemma4_text"):
        raise BaseModelError("source", f"{source}/config.json is model_type {model_type!r}, not Gemma 4")
    try:
        wrong = _config_mismatches(config, preset)
    except hf_config.ConfigError as exc:
        raise BaseModelError("source", f"{source}/config.json: {exc}") from exc
    if wrong:
        raise BaseModelError("preset", f"{source}/config.json does not match preset {preset.name}: {'; '.join(wrong)}")


def register(session: Session, user: User, data: RegisteredModelCreate) -> BaseModelPublic:
    if data.name in BASE_MODELS or session.get(RegisteredModel, data.name) is not None:
        raise BaseModelError("name", f"a base model named {echo(data.name)} exists")
    preset = BASE_MODELS.get(data.preset)
    if preset is None:
        raise BaseModelError("preset", f"unknown preset {echo(data.preset)}; one of {', '.join(BASE_MODELS)}")
    source = data.source.rstrip("/") or "/"
    check_source(source, preset)
    row = RegisteredModel(
        name=data.name, preset=data.preset, source=source, description=data.description, created_by=user.id
    )
    session.add(row)
    session.commit()
    return _public(preset, row)


def delete(session: Session, name: str) -> None:
    """Refused (BaseModelError('name')) for a preset, or while runs name the model."""
    if name in BASE_MODELS:
        raise BaseModelError("name", f"{name} is a built-in preset")
    row = session.get(RegisteredModel, name)
    if row is None:
        raise LookupError(name)
    used = session.exec(select(Run.id).where(Run.base_model == name).limit(1)).first()
    if used is not None:
        raise BaseModelError("name", f"runs use {name} (e.g. {used}): delete them first")
    session.delete(row)
    session.commit()
