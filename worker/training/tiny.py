"""`tiny-gemma4`: a Gemma 4 shaped base model made locally, in Hugging Face layout.

Nothing can be downloaded here, so the CPU demo, the tests and CI train on this: a real HF
checkpoint with the file set of Google's ``google/gemma-4-*-it`` repositories (``config.json`` of a
``Gemma4ForConditionalGeneration`` with a ``text_config``, ``generation_config.json`` whose stop ids
include end-of-turn, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json`` naming the
release's special tokens, ``chat_template.jinja`` in Gemma 4's format) and the same structure as
Gemma 4 31B (sliding + global layers, GQA, global layers with their own head size, fewer KV heads
and K = V) at toy size, random weights, and a byte-level BPE tokenizer trained on a small bundled
English corpus. It loads through Tunix's safetensors loader and, by construction, through
transformers' Gemma 4 classes (no missing or unexpected keys).

Only numpy, safetensors and tokenizers are used: no JAX import.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from worker.training import corpus

# Special tokens with the names and roles of Google's Gemma 4 release (its tokenizer_config.json names
# each one: sot/eot = turn start/end, soc/eoc = channel start/end, ...). The release's ids differ (its
# vocabulary is 262,144: e.g. <|turn> 105, <turn|> 106); here they are 0..len-1, in this order.
PAD, EOS, BOS, UNK, MASK = "<pad>", "<eos>", "<bos>", "<unk>", "<mask>"
TURN_START, TURN_END = "<|turn>", "<turn|>"
CHANNEL_START, CHANNEL_END = "<|channel>", "<channel|>"
NAMED_TOKENS = {  # tokenizer_config.json key -> token, as in the release
    "sot_token": TURN_START,
    "eot_token": TURN_END,
    "soc_token": CHANNEL_START,
    "eoc_token": CHANNEL_END,
    "think_token": "<|think|>",
    "escape_token": '<|"|>',
    "stc_token": "<|tool_call>",
    "etc_token": "<tool_call|>",
    "std_token": "<|tool>",
    "etd_token": "<tool|>",
    "str_token": "<|tool_response>",
    "etr_token": "<tool_response|>",
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "image_token": "<|image|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
    "audio_token": "<|audio|>",
}
VIDEO = "<|video|>"  # the release lists it under extra_special_tokens
SPECIAL_TOKENS = (PAD, EOS, BOS, UNK, MASK, *NAMED_TOKENS.values(), VIDEO)

TOKENIZER_VOCAB_SIZE = 1280  # BPE target (the corpus supports ~1330 at min_frequency 2); a multiple of 64

# Gemma 4's chat template, written from Google's published format and the structure of the
# chat_template.jinja shipped in the google/gemma-4-*-it repositories: <bos>; a native system turn
# (also opened, with <|think|> at its top, when enable_thinking is set); turns as
# <|turn>{system|user|model}\n{content}<turn|>\n with contents trimmed and earlier thoughts
# (<|channel>...<channel|>) stripped from model turns; the generation prompt <|turn>model\n.
# Left out: the release's tool declarations, tool calls/responses and image/audio/video parts (no tiny
# test uses them). Not confirmed: a later revision of the release's template is reported to add an
# empty thought channel (<|channel>thought\n<channel|>) to the generation prompt when thinking is off;
# this one follows the revision whose text could be read.
GEMMA4_CHAT_TEMPLATE = """\
{%- macro strip_thinking(text) -%}
    {%- set ns = namespace(result='') -%}
    {%- for part in text.split('<channel|>') -%}
        {%- if '<|channel>' in part -%}
            {%- set ns.result = ns.result + part.split('<|channel>')[0] -%}
        {%- else -%}
            {%- set ns.result = ns.result + part -%}
        {%- endif -%}
    {%- endfor -%}
    {{- ns.result | trim -}}
{%- endmacro -%}

{%- set loop_messages = messages -%}
{{ bos_token }}
{%- if (enable_thinking is defined and enable_thinking) or messages[0]['role'] in ['system', 'developer'] -%}
    {{- '<|turn>system\n' -}}
    {%- if enable_thinking is defined and enable_thinking -%}
        {{- '<|think|>' -}}
    {%- endif -%}
    {%- if messages[0]['role'] in ['system', 'developer'] -%}
        {{- messages[0]['content'] | trim -}}
        {%- set loop_messages = messages[1:] -%}
    {%- endif -%}
    {{- '<turn|>\n' -}}
{%- endif %}

{%- for message in loop_messages -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{- '<|turn>' + role + '\n' }}
    {%- if role == 'model' -%}
        {{- strip_thinking(message['content']) -}}
    {%- else -%}
        {{- message['content'] | trim -}}
    {%- endif -%}
    {{- '<turn|>\n' -}}
{%- endfor -%}

{%- if add_generation_prompt -%}
    {{- '<|turn>model\n' -}}
{%- endif -%}
"""

# The architecture: Gemma 4 31B's structure at toy size (tp=2 divides every head count).
TINY_ARCH = {
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "layer_types": ["sliding_attention", "full_attention"],
    "num_attention_heads": 8,
    "head_dim": 16,
    "num_key_value_heads": 4,
    "global_head_dim": 32,
    "num_global_key_value_heads": 2,
    "attention_k_eq_v": True,
    "sliding_window": 32,
    "final_logit_softcapping": 30.0,
}

# Random-weight scales. Projections are N(0, 0.02); every Gemma 4 sublayer output goes through an
# RMSNorm with unit weight, so their scale barely matters. The tied embedding is larger: the
# logits are final_norm(x) . embedding and LoRA cannot change the embedding or the final norm, so
# with a 0.02 embedding no prediction could be more confident than ~exp(1.3)/vocab (0.15: the
# first loss is ~8 = ln(vocab) + 1, and the demo task falls to ~2 within a few hundred steps).
PROJ_STD = 0.02
EMBED_STD = 0.15


def tiny_config_json(vocab_size: int, dtype: str = "float32") -> dict:
    """The tiny model's config.json (a text-only Gemma 4 causal LM)."""
    return {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "vocab_size": vocab_size,
        **TINY_ARCH,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
        },
        "hidden_size_per_layer_input": 0,  # no per-layer embeddings (the E2B/E4B feature; 31B has none)
        "vocab_size_per_layer_input": vocab_size,
        "num_kv_shared_layers": 0,
        "use_double_wide_mlp": False,
        "enable_moe_block": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": PROJ_STD,
        "tie_word_embeddings": True,
        "use_cache": True,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
        "dtype": dtype,
    }


def hf_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the HF ``Gemma4ForCausalLM`` state dict for a dense, text-only config
    without per-layer embeddings or KV sharing (lm_head is tied, so not stored)."""
    d = config["hidden_size"]
    f = config["intermediate_size"]
    n = config["num_attention_heads"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], d)}
    for i, kind in enumerate(config["layer_types"]):
        sliding = kind == "sliding_attention"
        h = config["head_dim"] if sliding else config["global_head_dim"]
        k_eq_v = config.get("attention_k_eq_v", False) and not sliding
        k = config["num_global_key_value_heads"] if k_eq_v else config["num_key_value_heads"]
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (n * h, d)
        shapes[p + "self_attn.k_proj.weight"] = (k * h, d)
        if not k_eq_v:
            shapes[p + "self_attn.v_proj.weight"] = (k * h, d)
        shapes[p + "self_attn.o_proj.weight"] = (d, n * h)
        shapes[p + "self_attn.q_norm.weight"] = (h,)
        shapes[p + "self_attn.k_norm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (f, d)
        shapes[p + "mlp.up_proj.weight"] = (f, d)
        shapes[p + "mlp.down_proj.weight"] = (d, f)
        for norm in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            shapes[p + norm + ".weight"] = (d,)
        shapes[p + "layer_scalar"] = (1,)
    shapes["model.norm.weight"] = (d,)
    return shapes


def _random_weights(config: dict, seed: int, dtype: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in hf_tensor_shapes(config).items():
        if name.endswith("norm.weight") or name.endswith("layer_scalar"):
            value = np.ones(shape, np.float32)
        elif name == "model.embed_tokens.weight":
            value = rng.normal(0.0, EMBED_STD, shape).astype(np.float32)
        else:
            value = rng.normal(0.0, PROJ_STD, shape).astype(np.float32)
        out[name] = value
    if dtype == "bfloat16":
        import ml_dtypes

        out = {k: v.astype(ml_dtypes.bfloat16) for k, v in out.items()}
    elif dtype != "float32":
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    return out


def build_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE):
    """A byte-level BPE (``tokenizers.Tokenizer``) trained on the bundled corpus; special tokens
    get ids 0.. in SPECIAL_TOKENS order; encoding adds <bos> like Gemma's tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus.corpus_lines(), trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, SPECIAL_TOKENS.index(BOS))]
    )
    return tok


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tokenizer_files(dest: Path, tok) -> None:
    """The release's tokenizer files: tokenizer.json, tokenizer_config.json (its keys: the named special
    tokens, no template) and chat_template.jinja. The release ships no special_tokens_map.json
    (transformers 5 no longer writes one); nor does this."""
    tok.save(str(dest / "tokenizer.json"))
    _write_json(
        dest / "tokenizer_config.json",
        {
            **NAMED_TOKENS,
            "backend": "tokenizers",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "unk_token": UNK,
            "mask_token": MASK,
            "extra_special_tokens": [VIDEO],
            "model_max_length": 1000000000000000019884624838656,
            "padding_side": "left",
            # The release names "GemmaTokenizer", a SentencePiece-style BPE with byte fallback that
            # transformers rebuilds around its vocabulary; this tokenizer is a byte-level BPE trained on
            # the bundled corpus (so the demo's words are single tokens), read from tokenizer.json as is.
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )
    (dest / "chat_template.jinja").write_text(GEMMA4_CHAT_TEMPLATE, encoding="utf-8")


def multimodal_config_json(text_config: dict) -> dict:
    """The same model as a text-only ``Gemma4ForConditionalGeneration``, the layout of Google's released
    Gemma 4 checkpoints: tensors under ``model.language_model.``, a ``text_config``, the media tokens'
    ids (here the tiny vocabulary's), no vision or audio tower."""
    keep = ("pad_token_id", "eos_token_id", "bos_token_id", "tie_word_embeddings", "dtype")
    ids = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    return {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": {k: v for k, v in text_config.items() if k != "architectures"},
        "vision_config": None,
        "audio_config": None,
        "boi_token_id": ids[NAMED_TOKENS["boi_token"]],
        "eoi_token_id": ids[NAMED_TOKENS["eoi_token"]],
        "image_token_id": ids[NAMED_TOKENS["image_token"]],
        "video_token_id": ids[VIDEO],
        "boa_token_id": ids[NAMED_TOKENS["boa_token"]],
        "eoa_token_index": ids[NAMED_TOKENS["eoa_token"]],  # sic: transformers' name
        "audio_token_id": ids[NAMED_TOKENS["audio_token"]],
        **{k: text_config[k] for k in keep},
    }


def create_tiny_gemma4(
    dest: str | os.PathLike, *, seed: int = 0, dtype: str = "float32", layout: str = "multimodal"
) -> Path:
    """Write the tiny-gemma4 checkpoint to ``dest`` and return it; if ``dest`` exists, return it unchanged.

    ``layout="multimodal"`` (default): the file set and layout of Google's own Gemma 4 ``-it`` checkpoints,
    a text-only ``Gemma4ForConditionalGeneration`` (``model_type`` ``gemma4`` with a ``text_config``,
    tensors named ``model.language_model.*``). ``layout="causal_lm"``: the same weights as
    ``Gemma4ForCausalLM`` (``model_type`` ``gemma4_text``, tensors named ``model.*``), as a text-only
    fine-tune saved by transformers is laid out.

    Everything is written into a temporary directory beside ``dest`` and renamed at the end, so a
    crash leaves nothing half-made (only a ``.<name>.tmp-*`` directory, which is not ``dest``).
    """
    from safetensors.numpy import save_file

    if layout not in ("causal_lm", "multimodal"):
        raise ValueError(f"layout must be 'causal_lm' or 'multimodal', got {layout!r}")
    dest = Path(dest)
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        tok = build_tokenizer()
        vocab_size = -(-tok.get_vocab_size() // 64) * 64  # a multiple of 64: shards evenly over tp
        config = tiny_config_json(vocab_size, dtype)
        weights = _random_weights(config, seed, dtype)
        if layout == "multimodal":
            weights = {"model.language_model." + k.removeprefix("model."): v for k, v in weights.items()}
            config = multimodal_config_json(config)
        write_tokenizer_files(tmp, tok)
        _write_json(tmp / "config.json", config)
        _write_json(
            tmp / "generation_config.json",
            {
                "bos_token_id": SPECIAL_TOKENS.index(BOS),
                # as the release: end of sequence and end of turn both stop generation
                "eos_token_id": [SPECIAL_TOKENS.index(EOS), SPECIAL_TOKENS.index(TURN_END)],
                "pad_token_id": SPECIAL_TOKENS.index(PAD),
            },
        )
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        try:
            os.rename(tmp, dest)
        except OSError:
            if not dest.exists():  # not a lost race with another writer
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest
