"""Checkpoints the tests make themselves, written from published documentation, not by the code under
test: a Gemma 4 checkpoint laid out like Google's release, and tokenizers with Gemma 3's and ChatML's
chat formats. Random weights; tokenizers trained on a few sentences.

Sources for the Gemma 4 files: Google's Gemma 4 prompt-formatting page (turns, the native system
turn, the thinking switch and channel), the file set and ``tokenizer_config.json`` keys of the
``google/gemma-4-*-it`` repositories (the named special tokens: ``sot_token`` ``<|turn>`` ...), and the
``chat_template.jinja`` they ship. Not confirmed, so chosen as transformers' Gemma 4 code expects:
the special tokens' ids (the release's are 0-4 and 105/106 for the turn markers in a 262,144 vocabulary;
here they are packed at the start of a small one), and ``generation_config.json``'s eos list beyond
``<eos>`` and ``<turn|>``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

SENTENCES = [
    "What is the capital of France? The capital of France is Paris.",
    "What is the capital of Peru? The capital of Peru is Lima.",
    "Which city is the capital of Chile? The capital of Chile is Santiago.",
    "Be brief. Answer in one sentence. Name a colour. Blue. Hello! How are you today?",
    "Let me think about it step by step: first the question, then the answer.",
    "Once upon a time there was a small model that learned to answer questions.",
] * 20

# Gemma 4's special tokens by the release's tokenizer_config.json keys
GEMMA4_NAMED = {
    "sot_token": "<|turn>",
    "eot_token": "<turn|>",
    "soc_token": "<|channel>",
    "eoc_token": "<channel|>",
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
GEMMA4_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", *GEMMA4_NAMED.values(), "<|video|>"]

# Gemma 4's template as Google publishes the format: <bos>; a native system turn (opened with <|think|>
# at its top when enable_thinking is on); <|turn>{role}\n{content}<turn|>\n with "model" for the
# assistant; thoughts (<|channel>...<channel|>) stripped from earlier model turns; generation prompt
# <|turn>model\n. Text contents only (the release also renders tools and image/audio parts).
GEMMA4_TEMPLATE = """{%- macro strip_thinking(text) -%}
{%- set ns = namespace(result='') -%}
{%- for part in text.split('<channel|>') -%}
{%- if '<|channel>' in part -%}{%- set ns.result = ns.result + part.split('<|channel>')[0] -%}
{%- else -%}{%- set ns.result = ns.result + part -%}{%- endif -%}
{%- endfor -%}
{{- ns.result | trim -}}
{%- endmacro -%}
{%- set ns = namespace(prev_message_type=None) -%}
{%- set loop_messages = messages -%}
{{ bos_token }}
{%- if (enable_thinking is defined and enable_thinking) or messages[0]['role'] in ['system', 'developer'] -%}
{{- '<|turn>system\\n' -}}
{%- if enable_thinking is defined and enable_thinking -%}{{- '<|think|>' -}}{%- endif -%}
{%- if messages[0]['role'] in ['system', 'developer'] -%}
{{- messages[0]['content'] | trim -}}
{%- set loop_messages = messages[1:] -%}
{%- endif -%}
{{- '<turn|>\\n' -}}
{%- endif %}
{%- for message in loop_messages -%}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
{{- '<|turn>' + role + '\\n' }}
{%- if message['content'] is string -%}
{%- if role == 'model' -%}{{- strip_thinking(message['content']) -}}
{%- else -%}{{- message['content'] | trim -}}{%- endif -%}
{%- endif -%}
{{- '<turn|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|turn>model\\n' -}}{%- endif -%}
"""

# Gemma 3's template (google/gemma-3-*-it): the system turn folded into the first user turn.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    '{%- else -%}{%- set first_user_prefix = "" -%}{%- set loop_messages = messages -%}{%- endif -%}'
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{'<start_of_turn>model\n'}}{%- endif -%}"
)

# ChatML with {% generation %} blocks around what the assistant says (as TRL's and SmolLM's templates mark it)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def gemma_style_tokenizer(specials: list[str], vocab_size: int):
    """A Gemma-style tokenizer (what transformers' GemmaTokenizer builds): BPE with byte fallback over
    <0x00>..<0xFF>, spaces normalised to "▁", no pre-tokenizer split; the specials first."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    learner = Tokenizer(models.BPE(unk_token="<unk>"))
    learner.normalizer = normalizers.Replace(" ", "▁")
    learner.train_from_iterator(
        SENTENCES, trainers.BpeTrainer(vocab_size=vocab_size - len(specials) - 256, show_progress=False)
    )
    learned = learner.get_vocab()
    vocab = {t: i for i, t in enumerate(specials)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for token, _ in sorted(learned.items(), key=lambda kv: kv[1]):
        vocab.setdefault(token, len(vocab))
    merges = json.loads(learner.to_str())["model"]["merges"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    assert all(tok.token_to_id(t) == i for i, t in enumerate(specials))
    return tok


def byte_level_tokenizer(specials: list[str], vocab_size: int):
    """A GPT-2-style byte-level BPE (ChatML models' kind of tokenizer); the specials first."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES, trainer)
    return tok


def gemma4_shapes(text_config: dict) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of the release's text model (``model.language_model.*``), written from the HF
    Gemma 4 layout: K = V global layers have no v_proj; every layer has a layer_scalar."""
    d, f, n = text_config["hidden_size"], text_config["intermediate_size"], text_config["num_attention_heads"]
    p = "model.language_model."
    shapes = {p + "embed_tokens.weight": (text_config["vocab_size"], d), p + "norm.weight": (d,)}
    for i, kind in enumerate(text_config["layer_types"]):
        full = kind == "full_attention"
        h = text_config["global_head_dim"] if full else text_config["head_dim"]
        k = text_config["num_global_key_value_heads"] if full else text_config["num_key_value_heads"]
        layer = f"{p}layers.{i}."
        shapes |= {
            layer + "self_attn.q_proj.weight": (n * h, d),
            layer + "self_attn.k_proj.weight": (k * h, d),
            layer + "self_attn.o_proj.weight": (d, n * h),
            layer + "self_attn.q_norm.weight": (h,),
            layer + "self_attn.k_norm.weight": (h,),
            layer + "mlp.gate_proj.weight": (f, d),
            layer + "mlp.up_proj.weight": (f, d),
            layer + "mlp.down_proj.weight": (d, f),
            layer + "input_layernorm.weight": (d,),
            layer + "post_attention_layernorm.weight": (d,),
            layer + "pre_feedforward_layernorm.weight": (d,),
            layer + "post_feedforward_layernorm.weight": (d,),
            layer + "layer_scalar": (1,),
        }
        if not (full and text_config["attention_k_eq_v"]):
            shapes[layer + "self_attn.v_proj.weight"] = (k * h, d)
    return shapes


def write_gemma4_release(
    dest: Path, *, vocab_size: int = 1280, seed: int = 0, end_of_turn_bias: float = 0.0, extra_tokens: tuple = ()
) -> Path:
    """A text-only Gemma 4 ``-it`` checkpoint with the release's file set, at the tiny-gemma4 preset's
    shape (so it registers under that preset): config.json (Gemma4ForConditionalGeneration +
    text_config), generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
    chat_template.jinja. ``end_of_turn_bias`` > 0 makes ``<turn|>`` likely after a few tokens: every
    embedding gets that much on its first dimension, and ``<turn|>``'s (tied) embedding ten times as
    much, so its logit rises with that dimension. ``extra_tokens``: added (non-special) tokens, as a
    tokenizer's own multi-character pieces."""
    from safetensors.numpy import save_file

    dest.mkdir(parents=True, exist_ok=True)
    from tokenizers import AddedToken

    tok = gemma_style_tokenizer(GEMMA4_SPECIALS, vocab_size - len(extra_tokens))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra_tokens])
    tok.save(str(dest / "tokenizer.json"))
    ids = {t: i for i, t in enumerate(GEMMA4_SPECIALS)}
    _write_json(
        dest / "tokenizer_config.json",
        {
            **GEMMA4_NAMED,
            "backend": "tokenizers",
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "unk_token": "<unk>",
            "mask_token": "<mask>",
            "extra_special_tokens": ["<|video|>"],
            "model_max_length": 1000000000000000019884624838656,
            "padding_side": "left",
            "processor_class": "Gemma4Processor",
            "tokenizer_class": "GemmaTokenizer",
        },
    )
    (dest / "chat_template.jinja").write_text(GEMMA4_TEMPLATE, encoding="utf-8")
    _write_json(
        dest / "generation_config.json",
        {"bos_token_id": 2, "eos_token_id": [1, ids["<turn|>"]], "pad_token_id": 0, "do_sample": True},
    )
    text = {
        "model_type": "gemma4_text",
        "vocab_size": vocab_size,
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
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
        },
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": vocab_size,
        "num_kv_shared_layers": 0,
        "use_double_wide_mlp": False,
        "enable_moe_block": False,
        "tie_word_embeddings": True,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
    }
    _write_json(
        dest / "config.json",
        {
            "architectures": ["Gemma4ForConditionalGeneration"],
            "model_type": "gemma4",
            "text_config": text,
            "vision_config": None,
            "audio_config": None,
            "boi_token_id": ids["<|image>"],
            "eoi_token_id": ids["<image|>"],
            "image_token_id": ids["<|image|>"],
            "video_token_id": ids["<|video|>"],
            "boa_token_id": ids["<|audio>"],
            "eoa_token_index": ids["<audio|>"],
            "audio_token_id": ids["<|audio|>"],
            "tie_word_embeddings": True,
            "dtype": "float32",
        },
    )
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in gemma4_shapes(text).items():
        if name.endswith("norm.weight") or name.endswith("layer_scalar"):
            weights[name] = np.ones(shape, np.float32)
        else:
            weights[name] = rng.normal(0, 0.15 if "embed" in name else 0.02, shape).astype(np.float32)
    embed = weights["model.language_model.embed_tokens.weight"]
    embed[:, 0] += end_of_turn_bias
    embed[ids["<turn|>"], 0] = 10 * end_of_turn_bias
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def write_tokenizer_dir(dest: Path, flavour: str) -> Path:
    """Tokenizer files only, for ``gemma3`` (template in tokenizer_config.json, the older place) or
    ``chatml`` (template in chat_template.jinja)."""
    dest.mkdir(parents=True, exist_ok=True)
    if flavour == "gemma3":
        specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
        tok = gemma_style_tokenizer(specials, 700)
        config = {
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "unk_token": "<unk>",
            "tokenizer_class": "GemmaTokenizer",
            "chat_template": GEMMA3_TEMPLATE,
        }
        generation = {"eos_token_id": [1, 6]}
    elif flavour == "chatml":
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        tok = byte_level_tokenizer(specials, 700)
        config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}
        (dest / "chat_template.jinja").write_text(CHATML_TEMPLATE, encoding="utf-8")
        generation = {"eos_token_id": [2, 0]}
    else:
        raise ValueError(flavour)
    tok.save(str(dest / "tokenizer.json"))
    _write_json(dest / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast", **config})
    _write_json(dest / "generation_config.json", generation)
    return dest


def write_scripted_gemma4(dest: Path, script: list[str]) -> Path:
    """A release-laid-out Gemma 4 checkpoint whose greedy reply to any chat prompt is ``script``: each
    entry one token (a special token's name, or text that is a single token), the last ``<turn|>``.

    The weights make a lookup table of "the next token is a function of this one": every scripted token
    (and the generation prompt's last token) gets an embedding of its own dimension (other tokens' are
    zero); attention writes nothing (o_proj = 0); layer 0's MLP maps each token's dimension to its
    successor's; the post-MLP norm makes that successor dominate the residual, and the tied embedding
    reads it out. (Tokens must not repeat: one successor each.)"""
    import json as _json

    from safetensors.numpy import load_file, save_file
    from tokenizers import Tokenizer

    write_gemma4_release(dest, extra_tokens=("thought\n",))
    tok = Tokenizer.from_file(str(dest / "tokenizer.json"))
    chain = [tok.encode("<|turn>model\n", add_special_tokens=False).ids[-1]]
    for piece in script:
        ids = tok.encode(piece, add_special_tokens=False).ids
        assert len(ids) == 1, f"{piece!r} is {len(ids)} tokens"
        chain += ids
    assert len(set(chain)) == len(chain) and len(chain) < 64, chain
    text = _json.loads((dest / "config.json").read_text())["text_config"]
    weights = {k: np.zeros_like(v) for k, v in load_file(str(dest / "model.safetensors")).items()}
    p = "model.language_model."
    for name in weights:
        if name.endswith("norm.weight") or name.endswith("layer_scalar"):
            weights[name][...] = 1.0
    embed, (gate, up, down) = (
        weights[p + "embed_tokens.weight"],
        (weights[p + f"layers.0.mlp.{m}_proj.weight"] for m in ("gate", "up", "down")),
    )
    assert text["num_hidden_layers"] == 2 and embed.shape[1] == 64
    for j, token in enumerate(chain):
        embed[token, j] = 0.1
        if j + 1 < len(chain):
            gate[j, j] = up[j, j] = 1.0
            down[j + 1, j] = 1.0
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


NEW_TRANSFORMERS = Path(__file__).resolve().parent.parent / ".venv" / "transformers-5.18"


_NEW_CONFIGS: dict[str, dict] = {}  # written by transformers 5.18 so far in this process, by arguments


def configs_by_new_transformers(*arguments: dict) -> list[dict]:
    """The config.json that transformers 5.18's own ``Gemma4TextConfig(**kwargs).save_pretrained``
    writes for each argument set: the global layers' shape as ``per_layer_config``, no
    ``global_head_dim`` or ``num_global_key_value_heads``. That transformers needs a newer safetensors
    than Tunix allows, so it runs in a process of its own from the folder ``make .venv/.installed-dev``
    fills: one process for every set not written yet (importing transformers is most of its time)."""
    import copy
    import os
    import subprocess
    import sys
    import tempfile

    keys = [json.dumps(a, sort_keys=True) for a in arguments]
    missing = [k for k in dict.fromkeys(keys) if k not in _NEW_CONFIGS]
    if missing:
        assert (NEW_TRANSFORMERS / "transformers").is_dir(), (
            f"{NEW_TRANSFORMERS} is missing: run make .venv/.installed-dev"
        )
        script = (
            "import json, sys\n"
            "import transformers\n"
            "assert transformers.__version__ == '5.18.0', transformers.__version__\n"
            "from transformers import Gemma4TextConfig\n"
            "for i, kwargs in enumerate(json.loads(sys.argv[1])):\n"
            "    Gemma4TextConfig(**kwargs).save_pretrained(f'{sys.argv[2]}/{i}')\n"
        )
        with tempfile.TemporaryDirectory() as out:
            env = {**os.environ, "PYTHONPATH": str(NEW_TRANSFORMERS)}
            batch = json.dumps([json.loads(k) for k in missing])
            subprocess.run([sys.executable, "-c", script, batch, out], env=env, check=True, timeout=120)
            for i, key in enumerate(missing):
                _NEW_CONFIGS[key] = json.loads((Path(out) / str(i) / "config.json").read_text())
    return [copy.deepcopy(_NEW_CONFIGS[k]) for k in keys]


def config_by_new_transformers(**kwargs) -> dict:
    """``configs_by_new_transformers`` of one argument set."""
    return configs_by_new_transformers(kwargs)[0]
