"""The data pipeline: dataset file -> Gemma chat format -> tokens + loss mask -> static-shape batches.

- Records come from :func:`app.datasets.validation.iter_conversations` (valid records only, already
  normalised to ``[{"role", "content"}, ...]``).
- Conversations are rendered exactly like Gemma's chat template (see ``tiny.GEMMA_CHAT_TEMPLATE``):
  ``<bos>``, a system turn folded into the first user turn (``system + "\\n\\n" + user``), turns as
  ``<start_of_turn>{user|model}\\n{content.strip()}<end_of_turn>\\n``. Turn markers are inserted by
  id and contents are tokenized with special-token parsing OFF, so text that happens to contain
  ``<bos>`` or ``<end_of_turn>`` can never forge a marker. The token ids equal those of
  ``tokenizer.apply_chat_template`` (each stretch between markers is tokenized as one piece).
- Loss mask (Tunix's convention: ``input_mask[t]`` says token t is a training target): with
  ``assistant_only_loss`` only the model turns' content tokens and their ``<end_of_turn>`` count;
  otherwise every token after ``<bos>``. ``text`` records are ``<bos> text <eos>``, all counted.
- Each example is truncated to ``max_seq_len``; examples left with no target token are dropped.
- Static shapes: ``packing=True`` concatenates whole examples into rows of ``max_seq_len`` (never
  splitting one); ``packing=False`` pads each example to ``max_seq_len``. Pad id fills, mask 0.
- Packed examples do not see each other: every example starts with ``<bos>`` (and no content can
  produce that id), so :func:`model_inputs_fn` derives per-example positions and a block-diagonal
  causal attention mask from the tokens alone. (Tunix's Gemma 4 ignores ``segment_ids``; the explicit
  attention mask does the job.)
- Deterministic: the validation split and every epoch's order are functions of the seed only, so a
  resumed run replays the same batches (Tunix skips the ones already trained).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from app.datasets.validation import iter_conversations

# -- tokenizer ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    """Gemma's turn markup."""

    turn_start: str = "<start_of_turn>"
    turn_end: str = "<end_of_turn>"
    user_role: str = "user"
    model_role: str = "model"


GEMMA = ChatFormat()


def _token_name(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class ChatTokenizer:
    """A ``tokenizer.json`` (HF ``tokenizers``) plus the special ids the chat format needs."""

    def __init__(self, model_dir: str | os.PathLike, chat_format: ChatFormat = GEMMA) -> None:
        from tokenizers import Tokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir}: no tokenizer.json")
        self._tok = Tokenizer.from_file(str(path))
        self._tok.encode_special_tokens = True  # contents never turn into special tokens
        config = {}
        if (model_dir / "tokenizer_config.json").is_file():
            config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
        self.format = chat_format

        def token_id(name: str) -> int:
            i = self._tok.token_to_id(name)
            if i is None:
                raise ValueError(f"{model_dir}: the tokenizer has no {name!r} token (Gemma chat format expected)")
            return i

        self.pad_id = token_id(_token_name(config.get("pad_token")) or "<pad>")
        self.eos_id = token_id(_token_name(config.get("eos_token")) or "<eos>")
        self.bos_id = token_id(_token_name(config.get("bos_token")) or "<bos>")
        self.turn_start_id = token_id(chat_format.turn_start)
        self.turn_end_id = token_id(chat_format.turn_end)
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def render_chat(messages: list[dict]) -> str:
    """The text Gemma's chat template renders for a conversation (for tests and debugging)."""
    f = GEMMA
    out = ["<bos>"]
    for role, content in chat_turns(messages):
        out.append(f"{f.turn_start}{role}\n{content}{f.turn_end}\n")
    return "".join(out)


def chat_turns(messages: list[dict]) -> list[tuple[str, str]]:
    """(Gemma role, rendered content) per turn, system folded into the first user turn."""
    prefix = ""
    turns = []
    for i, m in enumerate(messages):
        role, content = m["role"], m["content"]
        if role == "system" and i == 0:
            prefix = content + "\n\n"
            continue
        gemma_role = GEMMA.model_role if role == "assistant" else GEMMA.user_role
        text = content.strip()
        if prefix and gemma_role == GEMMA.user_role:
            text, prefix = prefix + text, ""
        turns.append((gemma_role, text))
    return turns


def tokenize_conversation(
    tok: ChatTokenizer, messages: list[dict], *, assistant_only_loss: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """(token ids int32, loss mask bool) of one normalised record (chat turns or a ``text`` record)."""
    if len(messages) == 1 and messages[0]["role"] == "text":
        ids = [tok.bos_id, *tok.encode(messages[0]["content"]), tok.eos_id]
        mask = [False] + [True] * (len(ids) - 1)
        return np.asarray(ids, np.int32), np.asarray(mask, bool)
    ids = [tok.bos_id]
    mask = [False]
    newline = tok.encode("\n")
    for role, content in chat_turns(messages):
        header = role + "\n"
        piece, offsets = tok.encode_with_offsets(header + content)
        target = role == tok.format.model_role or not assistant_only_loss
        ids.append(tok.turn_start_id)
        mask.append(not assistant_only_loss)
        ids += piece
        # a token is content (a target) when it ends past the "role\n" header
        mask += [target and end > len(header) if assistant_only_loss else True for _, end in offsets]
        ids.append(tok.turn_end_id)
        mask.append(target)
        ids += newline
        mask += [not assistant_only_loss] * len(newline)
    return np.asarray(ids, np.int32), np.asarray(mask, bool)


# -- tokenized datasets ------------------------------------------------------------------------


@dataclasses.dataclass
class TokenizedDataset:
    """Examples stored flat: example i is ``tokens[offsets[i]:offsets[i+1]]`` (and its mask)."""

    tokens: np.ndarray  # int32
    mask: np.ndarray  # bool
    offsets: np.ndarray  # int64, len = n + 1
    stats: dict = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.tokens[a:b], self.mask[a:b]

    def subset(self, indices: Sequence[int]) -> TokenizedDataset:
        parts = [self.example(int(i)) for i in indices]
        lengths = np.array([len(t) for t, _ in parts], np.int64)
        return TokenizedDataset(
            tokens=np.concatenate([t for t, _ in parts]) if parts else np.zeros(0, np.int32),
            mask=np.concatenate([m for _, m in parts]) if parts else np.zeros(0, bool),
            offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            stats={"examples": len(parts)},
        )

    @classmethod
    def from_examples(cls, examples: list[tuple[np.ndarray, np.ndarray]], stats: dict | None = None):
        lengths = np.array([len(t) for t, _ in examples], np.int64)
        return cls(
            tokens=np.concatenate([t for t, _ in examples]).astype(np.int32) if examples else np.zeros(0, np.int32),
            mask=np.concatenate([m for _, m in examples]).astype(bool) if examples else np.zeros(0, bool),
            offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            stats=stats or {},
        )


def tokenize_file(
    tok: ChatTokenizer,
    path: str | os.PathLike,
    filename: str,
    *,
    file_type: str | None,
    fmt: str | None,
    max_seq_len: int,
    assistant_only_loss: bool = True,
) -> TokenizedDataset:
    """Tokenize every valid record of a dataset file (streamed), truncating each to ``max_seq_len``."""
    examples = []
    records = truncated = dropped = 0
    for messages in iter_conversations(path, filename, file_type=file_type, fmt=fmt):
        records += 1
        ids, mask = tokenize_conversation(tok, messages, assistant_only_loss=assistant_only_loss)
        if len(ids) > max_seq_len:
            truncated += 1
            ids, mask = ids[:max_seq_len], mask[:max_seq_len]
        if not mask[1:].any():
            dropped += 1  # nothing left to learn from (e.g. the answer was cut off)
            continue
        examples.append((ids, mask))
    stats = {"records": records, "examples": len(examples), "truncated": truncated, "dropped_no_target": dropped}
    return TokenizedDataset.from_examples(examples, stats)


def split_validation(ds: TokenizedDataset, fraction: float, seed: int) -> tuple[TokenizedDataset, TokenizedDataset]:
    """(train, validation): a seeded random ``fraction`` of the examples (at least one when the
    fraction is positive and there are two or more examples) goes to validation."""
    n = len(ds)
    if not 0 <= fraction < 1:
        raise ValueError(f"validation_fraction must be in [0, 1), got {fraction}")
    n_val = min(n - 1, max(1, round(n * fraction))) if fraction > 0 and n >= 2 else 0
    order = np.random.default_rng([seed, 0x5EED]).permutation(n)
    val = np.sort(order[:n_val])
    train = np.sort(order[n_val:])
    return ds.subset(train), ds.subset(val)


# -- rows and batches --------------------------------------------------------------------------


def pack(lengths: np.ndarray, order: Sequence[int], max_seq_len: int) -> list[list[int]]:
    """Greedy in-order packing: example indices per row, each row's total length <= max_seq_len."""
    rows: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i in order:
        n = int(lengths[i])
        if current and used + n > max_seq_len:
            rows.append(current)
            current, used = [], 0
        current.append(int(i))
        used += n
    if current:
        rows.append(current)
    return rows


@dataclasses.dataclass
class Batches:
    """Static-shape batches over a tokenized dataset.

    Rows of ``max_seq_len`` tokens (packed or padded), ``batch_size`` rows per batch; a short last
    batch of an epoch is filled with empty rows (all pad, mask 0). Training order is reshuffled every
    epoch (seeded); ``shuffle=False`` keeps file order (validation).
    """

    ds: TokenizedDataset
    batch_size: int
    max_seq_len: int
    packing: bool
    pad_id: int
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        if len(self.ds) == 0:
            raise ValueError("the dataset has no usable examples")
        if self.batch_size < 1 or self.max_seq_len < 2:
            raise ValueError("batch_size must be >= 1 and max_seq_len >= 2")
        self._rows_cache: dict[int, list[list[int]]] = {}

    def rows(self, epoch: int) -> list[list[int]]:
        """Example indices of each row in this epoch."""
        if epoch not in self._rows_cache:
            n = len(self.ds)
            order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            if self.packing:
                rows = pack(self.ds.lengths, order, self.max_seq_len)
            else:
                rows = [[int(i)] for i in order]
            self._rows_cache = {epoch: rows}  # keep one epoch
        return self._rows_cache[epoch]

    def batches_in_epoch(self, epoch: int) -> int:
        return math.ceil(len(self.rows(epoch)) / self.batch_size)

    def make_batch(self, rows: list[list[int]]):
        """A ``TrainingInput`` of shape (batch_size, max_seq_len) from up to batch_size rows."""
        from tunix.sft.peft_trainer import TrainingInput

        tokens = np.full((self.batch_size, self.max_seq_len), self.pad_id, np.int32)
        mask = np.zeros((self.batch_size, self.max_seq_len), bool)
        for r, row in enumerate(rows):
            at = 0
            for i in row:
                t, m = self.ds.example(i)
                tokens[r, at : at + len(t)] = t
                mask[r, at : at + len(t)] = m
                at += len(t)
        return TrainingInput(input_tokens=tokens, input_mask=mask)

    def epoch(self, epoch: int) -> Iterator:
        rows = self.rows(epoch)
        for b in range(0, len(rows), self.batch_size):
            yield self.make_batch(rows[b : b + self.batch_size])

    def stream(self, n_batches: int, start_epoch: int = 0) -> Iterator:
        """Exactly ``n_batches`` batches, epoch after epoch."""
        epoch = start_epoch
        left = n_batches
        while left > 0:
            for batch in self.epoch(epoch):
                yield batch
                left -= 1
                if left == 0:
                    return
            epoch += 1


def count_tokens(batch, pad_id: int) -> tuple[int, int]:
    """(non-pad tokens, loss target tokens) of a TrainingInput."""
    tokens = np.asarray(batch.input_tokens)
    mask = np.asarray(batch.input_mask)
    return int((tokens != pad_id).sum()), int(mask[:, 1:].sum())


def model_inputs_fn(pad_id: int, bos_id: int):
    """Tunix ``gen_model_input_fn``: positions restart at every ``<bos>`` and attention is causal
    within an example (block-diagonal over packed examples), never to or from padding."""
    import jax
    import jax.numpy as jnp

    def gen(x) -> dict:
        tokens = x.input_tokens
        valid = tokens != pad_id
        idx = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
        is_start = tokens == bos_id
        start = jax.lax.cummax(jnp.where(is_start, idx, 0), axis=1)
        positions = jnp.where(valid, idx - start, 0)
        segment = jnp.cumsum(is_start.astype(jnp.int32), axis=1)
        same = segment[:, :, None] == segment[:, None, :]
        causal = idx[:, :, None] >= idx[:, None, :]
        attention_mask = same & causal & valid[:, None, :] & valid[:, :, None]
        return {
            "input_tokens": tokens,
            "input_mask": x.input_mask,
            "positions": positions,
            "attention_mask": attention_mask,
        }

    return gen
