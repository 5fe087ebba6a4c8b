"""A checkpoint's chat format, read from its own files: the one implementation of chat rendering,
tokenization, loss masks, stop tokens and reasoning output. Training, the built-in model server and
(through the server) benchmarks and evaluation prompts all use it.

- The template is the checkpoint's own (``chat_template.jinja``, else ``tokenizer_config.json``'s
  ``chat_template``: see ``app.base_models.service.read_chat_template``), rendered in the sandboxed
  Jinja2 environment transformers uses (``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, the
  ``{% generation %}`` tag, ``raise_exception``, ``strftime_now``, ``tojson``) with the tokenizer's
  named special tokens (``bos_token``, ``eos_token``, ...) and the caller's keyword arguments
  (``enable_thinking``, ...). Token ids equal ``AutoTokenizer.apply_chat_template(..., tokenize=True)``.
- Contents never forge a special token: before rendering, every added-token string inside a
  message's content is swapped for a private-use character, and after rendering the text between
  the template's own special tokens is tokenized with special-token parsing off, the swapped strings
  put back as plain text. (transformers would turn a content's ``<turn|>`` into the real token.)
- Loss masks come from the template: its ``{% generation %}`` blocks where it has them; otherwise
  each assistant message's tokens are what rendering the conversation up to that message adds to
  rendering the conversation before it with the generation prompt, up to and including the message's
  last stop token (the end-of-turn the model must learn to emit; the newline after it is not a target).
- Stop tokens: every id of ``generation_config.json``'s ``eos_token_id`` (a list in Gemma 4) and the
  tokenizer's ``eos_token``.
- Reasoning: where the tokenizer names a channel's start and end tokens (Gemma 4's ``soc_token``
  ``<|channel>`` / ``eoc_token`` ``<channel|>`` in ``tokenizer_config.json``), generated text inside a
  channel is the reply's reasoning, its first line (the channel's name, ``thought``) dropped.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.nodes
import numpy as np
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from app.base_models.service import read_chat_template

# transformers' named special tokens (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES), the ones a
# template sees as variables
NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_PLACEHOLDER_BASE = 0x100000  # Supplementary Private Use Area-B: stands in for a content's special-token text


# vLLM's reasoning parsers (``--reasoning-parser``) by the channel tokens a tokenizer_config.json names
VLLM_REASONING_PARSERS: dict[tuple[str | None, str | None], str] = {("<|channel>", "<channel|>"): "gemma4"}


def vllm_reasoning_parser(model_dir: str) -> str | None:
    """The ``--reasoning-parser`` vLLM needs to return a checkpoint's thoughts apart, as the built-in
    server does (None when the checkpoint names no reasoning channel, or its files cannot be read)."""
    import fsspec

    try:
        with fsspec.open(f"{model_dir.rstrip('/')}/tokenizer_config.json", "r", encoding="utf-8") as f:
            config = json.load(f)  # pyright: ignore[reportArgumentType] (fsspec.open gives one file here)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    return VLLM_REASONING_PARSERS.get((_token_text(config.get("soc_token")), _token_text(config.get("eoc_token"))))


class ChatTemplateError(ValueError):
    """The template could not render a conversation; the message is the template's own."""


class _GenerationTracker(Extension):
    """``{% generation %}...{% endgeneration %}``: records the character span of each block, as
    transformers' AssistantTracker does (the text rendered so far is the blocks generated so far)."""

    tags = {"generation"}

    def __init__(self, environment) -> None:
        super().__init__(environment)
        environment.extend(track_generation=self.track)
        self._blocks: list[str] | None = None
        self._spans: list[tuple[int, int]] | None = None

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_generation", []), [], [], body).set_lineno(lineno)

    def _generation(self, caller) -> str:
        rv = caller()
        if self._blocks is not None and self._spans is not None:
            start = sum(len(b) for b in self._blocks)
            self._spans.append((start, start + len(rv)))
        return rv

    @contextmanager
    def track(self, blocks: list[str], spans: list[tuple[int, int]]):
        self._blocks, self._spans = blocks, spans
        try:
            yield
        finally:
            self._blocks = self._spans = None


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_template(source: str) -> jinja2.Template:
    """The template in transformers' environment (a new environment each: the tracker holds state)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTracker, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the chat template does not parse: {exc} (line {exc.lineno})") from exc


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    value = json.loads(path.read_text(encoding="utf-8"))
    return value if isinstance(value, dict) else {}


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # an AddedToken written out
        return value.get("content")
    return value if isinstance(value, str) else None


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else [v for v in value if isinstance(v, int)]


class ChatFormat:
    """A checkpoint directory's tokenizer, chat template, stop tokens and reasoning channel."""

    def __init__(self, model_dir: str | os.PathLike) -> None:
        from tokenizers import Tokenizer

        self.model_dir = Path(model_dir)
        path = self.model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{self.model_dir}: no tokenizer.json")
        self._tok = Tokenizer.from_file(str(path))
        self._tok.encode_special_tokens = True  # plain text never turns into special tokens
        config = _read_json(self.model_dir / "tokenizer_config.json")
        self.special_tokens = {k: t for k in NAMED_TOKENS if (t := _token_text(config.get(k)))}
        self.template_source = read_chat_template(str(self.model_dir))
        self._template = compile_template(self.template_source) if self.template_source else None
        self.vocab_size = self._tok.get_vocab_size()
        # every added token (special or not) is split out of rendered text, as transformers does
        self.added = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()}
        self._added_re = (
            re.compile("|".join(re.escape(t) for t in sorted(self.added, key=len, reverse=True)))
            if self.added
            else None
        )

        def token_id(key: str, default: str | None) -> int | None:
            name = self.special_tokens.get(key, default if key not in config else None)
            if name is None:
                return None
            i = self._tok.token_to_id(name)
            if i is None:
                raise ValueError(f"{self.model_dir}: the tokenizer has no {name!r} token ({key})")
            return i

        self.bos_id = token_id("bos_token", "<bos>")  # None: the tokenizer names none (ChatML models)
        eos_id, pad_id = token_id("eos_token", "<eos>"), token_id("pad_token", "<pad>")
        if eos_id is None or pad_id is None:
            raise ValueError(f"{self.model_dir}: tokenizer_config.json names no eos_token or pad_token")
        self.eos_id, self.pad_id = eos_id, pad_id
        generation = _read_json(self.model_dir / "generation_config.json")
        eos = generation.get("eos_token_id")
        if eos is None:
            model_config = _read_json(self.model_dir / "config.json")
            eos = (model_config.get("text_config") or {}).get("eos_token_id", model_config.get("eos_token_id"))
        self.stop_ids = frozenset([self.eos_id, *_ids(eos)])
        soc, eoc = _token_text(config.get("soc_token")), _token_text(config.get("eoc_token"))
        self.channel_ids = (
            (self._tok.token_to_id(soc), self._tok.token_to_id(eoc))
            if soc and eoc and self._tok.token_to_id(soc) is not None and self._tok.token_to_id(eoc) is not None
            else None
        )

    @property
    def bos(self) -> list[int]:
        """What a plain-text prompt starts with: ``[bos_id]``, or nothing when the tokenizer has none."""
        return [] if self.bos_id is None else [self.bos_id]

    @property
    def has_template(self) -> bool:
        return self._template is not None

    # -- plain text ----------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Text as text: no <bos>, and special-token strings in it stay text."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -- rendering -----------------------------------------------------------------------------

    def _escape(self, messages: list[dict]) -> tuple[list[dict], dict[str, str]]:
        """Messages with every added-token string in their contents swapped for a placeholder."""
        table: dict[str, str] = {}
        if self._added_re is None:
            return messages, {}

        def swap(m: re.Match) -> str:
            text = m.group(0)
            if text not in table:
                table[text] = chr(_PLACEHOLDER_BASE + len(table))
            return table[text]

        out = []
        for message in messages:
            message = dict(message)
            for key in ("content", "reasoning_content"):
                if isinstance(message.get(key), str):
                    message[key] = self._added_re.sub(swap, message[key])
            out.append(message)
        return out, {v: k for k, v in table.items()}

    def _render(
        self, messages: list[dict], add_generation_prompt: bool, kwargs: dict, spans: list | None = None
    ) -> str:
        if self._template is None:
            raise ChatTemplateError(f"{self.model_dir} has no chat template")
        variables = {**self.special_tokens, **kwargs}
        try:
            if spans is None:
                return self._template.render(
                    messages=messages, add_generation_prompt=add_generation_prompt, **variables
                )
            blocks: list[str] = []
            # added to the environment by _GenerationTracker (Environment.extend)
            with self._template.environment.track_generation(blocks, spans):  # pyright: ignore[reportAttributeAccessIssue]
                for block in self._template.generate(
                    messages=messages, add_generation_prompt=add_generation_prompt, **variables
                ):
                    blocks.append(block)
            return "".join(blocks)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(str(exc)) from exc
        except (TypeError, KeyError, AttributeError, IndexError, ValueError) as exc:
            raise ChatTemplateError(f"{type(exc).__name__}: {exc}") from exc

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False, **kwargs) -> str:
        """The text the template renders (as ``apply_chat_template(..., tokenize=False)``)."""
        return self._render(messages, add_generation_prompt, kwargs)

    def _tokenize_rendered(self, text: str, table: dict[str, str]) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of rendered text, and each token's character span in ``text``: the template's special
        tokens by id, the text between them with special-token parsing off (placeholders put back)."""
        ids: list[int] = []
        spans: list[tuple[int, int]] = []

        def plain(start: int, end: int) -> None:
            if start == end:
                return
            piece = text[start:end]
            restored, where = [], []  # where[k]: position in text of restored character k
            for k, ch in enumerate(piece):
                original = table.get(ch, ch)
                restored.append(original)
                where += [start + k] * len(original)
            where.append(end)
            enc = self._tok.encode("".join(restored), add_special_tokens=False)
            ids.extend(enc.ids)
            for a, b in enc.offsets:
                spans.append((where[a], where[b - 1] + 1 if b > a else where[a]))

        at = 0
        if self._added_re is not None:
            for m in self._added_re.finditer(text):
                plain(at, m.start())
                ids.append(self.added[m.group(0)])
                spans.append((m.start(), m.end()))
                at = m.end()
        plain(at, len(text))
        return ids, spans

    def prompt_ids(self, messages: list[dict], **kwargs) -> list[int]:
        """A conversation's tokens with the generation prompt: what a chat request decodes from."""
        escaped, table = self._escape(messages)
        return self._tokenize_rendered(self._render(escaped, True, kwargs), table)[0]

    def tokenize(
        self, messages: list[dict], *, assistant_only_loss: bool = True, add_generation_prompt: bool = False, **kwargs
    ) -> tuple[np.ndarray, np.ndarray]:
        """(token ids int32, loss mask bool) of one normalised record: a conversation, or a ``text``
        record (``<bos> text <eos>``, no template). The mask follows Tunix: ``mask[t]`` says token t is
        a training target; never the first token."""
        if len(messages) == 1 and messages[0]["role"] == "text":
            ids = [*self.bos, *self.encode(messages[0]["content"]), self.eos_id]
            return np.asarray(ids, np.int32), np.asarray([False] + [True] * (len(ids) - 1), bool)
        escaped, table = self._escape(messages)
        generation: list[tuple[int, int]] | None = (
            [] if assistant_only_loss and _GENERATION_TAG.search(self.template_source or "") else None
        )
        text = self._render(escaped, add_generation_prompt, kwargs, generation)
        ids, token_spans = self._tokenize_rendered(text, table)
        mask = np.zeros(len(ids), bool)
        if not assistant_only_loss:
            mask[1:] = True
        else:
            targets = generation if generation is not None else list(self._assistant_spans(escaped, text, kwargs))
            starts = np.asarray([a for a, _ in token_spans])
            ends = np.asarray([b for _, b in token_spans])
            for a, b in targets:
                hit = np.flatnonzero((ends > a) & (starts < b))
                if generation is None:  # up to and including the message's last stop token
                    stops = [k for k in hit if ids[k] in self.stop_ids]
                    if stops:
                        hit = hit[hit <= stops[-1]]
                mask[hit] = True
            mask[0] = False
        return np.asarray(ids, np.int32), mask

    def _assistant_spans(self, messages: list[dict], text: str, kwargs: dict) -> Iterator[tuple[int, int]]:
        """Each assistant message's characters in ``text``: rendering up to it, less rendering before
        it with the generation prompt."""
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._render(messages[:i], True, kwargs)
            upto = self._render(messages[: i + 1], False, kwargs)
            if not text.startswith(upto):
                raise ChatTemplateError(
                    f"the template renders message {i + 1} differently once later messages follow it, so its "
                    "tokens cannot be told apart; add {% generation %} blocks to the template"
                )
            start = len(os.path.commonprefix([before, upto]))
            yield start, len(upto)

    # -- generated text ------------------------------------------------------------------------

    def reply_parser(self, reasoning: bool = True) -> ReplyParser:
        """A parser of generated tokens; ``reasoning=False``: all text is content (completions)."""
        return ReplyParser(self, self.channel_ids if reasoning else None)


class ReplyParser:
    """Splits generated tokens into the reply's reasoning (inside the reasoning channel, its name line
    dropped) and its content; both as growing text, special tokens skipped."""

    def __init__(self, fmt: ChatFormat, channel: tuple[int, int] | None) -> None:
        self.fmt = fmt
        self.channel = channel
        self.reasoning_ids: list[int] = []
        self.content_ids: list[int] = []
        self._in_channel = False

    def add(self, token: int) -> str | None:
        """Take a token: ``"reasoning"`` or ``"content"``, the part it went to (None: a channel marker)."""
        if self.channel is not None and token == self.channel[0]:
            self._in_channel = True
            return None
        if self.channel is not None and token == self.channel[1]:
            self._in_channel = False
            return None
        if self._in_channel:
            self.reasoning_ids.append(token)
            return "reasoning"
        self.content_ids.append(token)
        return "content"

    def reasoning(self) -> str | None:
        """The reasoning so far, past its channel's name line; None until that line is complete."""
        text = self.fmt.decode(self.reasoning_ids, skip_special_tokens=True)
        _, newline, rest = text.partition("\n")
        return rest if newline else None

    def content(self) -> str:
        return self.fmt.decode(self.content_ids, skip_special_tokens=True)
