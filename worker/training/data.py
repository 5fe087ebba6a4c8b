"""The data pipeline: dataset file -> the checkpoint's chat format -> tokens + loss mask -> static-shape batches.

- Records come from :func:`app.datasets.validation.iter_numbered_conversations` (valid records only,
  already normalised to ``[{"role", "content"}, ...]``, with their line numbers).
- Each record is tokenized by :class:`worker.chat.ChatFormat` with the base model's own chat template
  (the loss mask from the template too: see that module); ``text`` records are ``<bos> text <eos>``,
  all counted. A record the template cannot render fails the run with its line and the template's
  message.
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
import math
import os
from collections.abc import Iterator, Sequence

import numpy as np

from app.datasets.validation import iter_numbered_conversations
from worker.chat import ChatFormat, ChatTemplateError

# -- tokenized datasets ------------------------------------------------------------------------


@dataclasses.dataclass
class TokenizedDataset:
    """Examples stored flat: example i is ``tokens[offsets[i]:offsets[i+1]]`` (and its mask)."""

    tokens: np.ndarray  # int32
    mask: np.ndarray  # bool
    offsets: np.ndarray  # int64, len = n + 1
    stats: dict = dataclasses.field(default_factory=dict)
    lines: np.ndarray | None = None  # int64: each example's record, by its line number in the file

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.tokens[a:b], self.mask[a:b]

    def subset(self, indices: Sequence[int] | np.ndarray) -> TokenizedDataset:
        parts = [self.example(int(i)) for i in indices]
        lengths = np.array([len(t) for t, _ in parts], np.int64)
        return TokenizedDataset(
            tokens=np.concatenate([t for t, _ in parts]) if parts else np.zeros(0, np.int32),
            mask=np.concatenate([m for _, m in parts]) if parts else np.zeros(0, bool),
            offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            stats={"examples": len(parts)},
            lines=None if self.lines is None else self.lines[np.asarray(indices, np.int64)],
        )

    @classmethod
    def from_examples(
        cls,
        examples: list[tuple[np.ndarray, np.ndarray]],
        stats: dict | None = None,
        lines: Sequence[int] | None = None,
    ):
        lengths = np.array([len(t) for t, _ in examples], np.int64)
        return cls(
            tokens=np.concatenate([t for t, _ in examples]).astype(np.int32) if examples else np.zeros(0, np.int32),
            mask=np.concatenate([m for _, m in examples]).astype(bool) if examples else np.zeros(0, bool),
            offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            stats=stats or {},
            lines=None if lines is None else np.asarray(lines, np.int64),
        )


def tokenize_file(
    chat: ChatFormat,
    path: str | os.PathLike,
    filename: str,
    *,
    file_type: str | None,
    fmt: str | None,
    max_seq_len: int,
    assistant_only_loss: bool = True,
    template_kwargs: dict | None = None,
) -> TokenizedDataset:
    """Tokenize every valid record of a dataset file (streamed), truncating each to ``max_seq_len``.
    ``template_kwargs`` go to the chat template (``enable_thinking``). Raises ValueError naming the
    file and line of a record the template cannot render."""
    examples, lines = [], []
    records = truncated = dropped = 0
    for line, messages in iter_numbered_conversations(path, filename, file_type=file_type, fmt=fmt):
        records += 1
        try:
            ids, mask = chat.tokenize(messages, assistant_only_loss=assistant_only_loss, **(template_kwargs or {}))
        except ChatTemplateError as exc:
            raise ValueError(f"{filename} line {line}: the base model's chat template failed: {exc}") from exc
        if len(ids) > max_seq_len:
            truncated += 1
            ids, mask = ids[:max_seq_len], mask[:max_seq_len]
        if not mask[1:].any():
            dropped += 1  # nothing left to learn from (e.g. the answer was cut off)
            continue
        examples.append((ids, mask))
        lines.append(line)
    stats = {"records": records, "examples": len(examples), "truncated": truncated, "dropped_no_target": dropped}
    return TokenizedDataset.from_examples(examples, stats, lines)


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


def pack(lengths: np.ndarray, order: Sequence[int] | np.ndarray, max_seq_len: int) -> list[list[int]]:
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
        # pyright reads no fields in Tunix's flax dataclass (Tunix is not typed)
        return TrainingInput(input_tokens=tokens, input_mask=mask)  # pyright: ignore[reportCallIssue]

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
