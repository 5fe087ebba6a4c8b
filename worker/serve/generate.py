"""Text generation for the built-in model server: a merged Hugging Face checkpoint loaded through
Tunix's loader, a KV cache, and continuous batching.

The engine keeps ``max_num_seqs`` rows of KV cache, decoded one step at a time, all rows in one call,
each new token handed to its request as it comes (so replies stream). A request that arrives joins at
the next step: its prompt is prefilled on its own (with the others that arrived with it) and its keys
and values are copied into a free row, so its first token does not wait for the running replies to
end. A row that finishes is free at once; when requests come back for freed rows a few at a time
(through a proxy, say), the engine waits a few milliseconds for the rest of them (JOIN_WAIT_S).

Tunix's Gemma 4 cache writes every row's new token at one shared column (``end_index``). So the rows
share a column counter ``t`` in a logical space of ``L + M`` columns (``L``: max_model_len; ``M``: a
multiple of the sliding window near L / 4): a joining prompt is placed in its row just before ``t``
(``t`` is never below L); when ``t`` reaches L + M, the global layers' caches shift left by M columns and
``t`` goes back by M (a live row spans at most L columns, so none of its columns falls off; the sliding
layers' ring caches are unchanged, M being a multiple of their window). Each row's attention mask
admits only its own columns.

Prompt lengths are rounded up to multiples of PROMPT_BUCKET and joining groups to powers of two, so a
handful of shapes are compiled once each (the common ones at start).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

PROMPT_BUCKET = 64
TOP_LOGPROBS = 20  # the most a request's logprobs may ask (vLLM's --max-logprobs default)
# Rows freed since the last join may be asked for again at once (a client's next request): when fewer
# have come, the engine waits for the rest while they keep coming, JOIN_SETTLE_S apart at most, for
# JOIN_WAIT_S at most, so that a wave is prefilled in one call rather than in one call per straggler.
JOIN_SETTLE_S = 0.002
JOIN_WAIT_S = 0.006
JOIN_RECENT_S = 0.5  # rows freed longer ago than this are not waited for


def sample(logits, keys, counts, temperature, top_p):
    """The next token of each row: greedy where temperature is 0, else nucleus sampling with the row's
    key folded with how many tokens it has sampled, so a seed gives the same reply whatever else runs.

    The draw is over token ids, not over the tokens sorted by probability: logits a rounding apart
    (the same row at another cache column, or beside other rows) could swap places in a sort, and with
    them the noise each token draws, changing the reply."""
    import jax
    import jax.numpy as jnp

    keys = jax.vmap(jax.random.fold_in)(keys, counts)
    logits = logits[:, -1, :].astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1)
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    probs = jax.nn.softmax(jnp.take_along_axis(scaled, order, axis=-1), axis=-1)
    # keep the smallest set reaching top_p (all of them at 1: a cumulative sum may round past 1)
    beyond = (jnp.cumsum(probs, axis=-1) - probs > top_p[:, None]) & (top_p < 1)[:, None]
    cut = jnp.zeros_like(beyond).at[jnp.arange(order.shape[0])[:, None], order].set(beyond)
    sampled = jax.vmap(jax.random.categorical)(keys, jnp.where(cut, -jnp.inf, scaled))
    return jnp.where(temperature > 0, sampled, greedy)


@dataclasses.dataclass
class Request:
    """One generation. ``emit(token_id | None, finish_reason | None)`` is called on the engine thread
    for each new token, then once with the finish reason ("stop" or "length"); a reply that ends at an
    end token gets that token with its "stop" (it is not part of the text)."""

    prompt_ids: list[int]
    max_tokens: int
    emit: Callable[[int | None, str | None], None]
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False  # end-of-sequence and end-of-turn tokens do not end it: only max_tokens does
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    cancelled: bool = False  # the client went away: the row stops at its next step


class Engine:
    """Loads the model, then serves requests on a thread of its own (``submit`` from any thread)."""

    def __init__(
        self, model_dir: str | Path, *, max_num_seqs: int = 16, max_model_len: int = 1024, dtype: str | None = None
    ) -> None:
        import jax
        import jax.numpy as jnp
        from flax import nnx

        from worker.chat import ChatFormat
        from worker.merge.merge import open_checkpoint
        from worker.merge.verify import weights_dtype
        from worker.training import models
        from worker.training.engine import configure_compilation_cache

        configure_compilation_cache()  # the same persistent cache as training: a redeploy compiles nothing
        self.model_dir = Path(model_dir)
        self.tokenizer = ChatFormat(self.model_dir)
        self.stop_ids = self.tokenizer.stop_ids  # generation_config.json's eos ids (end of turn too)
        config = models.resolve_config(self.model_dir)
        dtype = dtype or weights_dtype(open_checkpoint(str(self.model_dir)))
        model = models.load_base_model(self.model_dir, config, dtype=dtype)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        window = config.sliding_window_size or 1
        self.shift = max(1, -(-max_model_len // 4 // window)) * window  # M: a multiple of the window
        self.span = max_model_len + self.shift  # the logical columns: the global layers' cache length
        self.vocab_size = config.num_embed
        self.cache_dtype = jnp.float32 if dtype == "float32" else jnp.bfloat16
        graphdef, state = nnx.split(model)
        self._waiting: queue.Queue[Request] = queue.Queue()
        self.running = 0  # rows with a live request
        self.steps = 0
        self._ended = 0  # requests ended since the last join: as many new ones may be on their way
        self._ended_at = 0.0

        def forward(state, tokens, positions, cache, mask):
            return nnx.merge(graphdef, state)(tokens, positions, cache, mask, decode_only_last_token=True)

        def step(state, tokens, positions, cache, mask, keys, counts, temperature, top_p):
            logits, cache = forward(state, tokens, positions, cache, mask)
            return sample(logits, keys, counts, temperature, top_p), cache

        def step_rows(state, tokens, positions, cache, mask, keys, counts, temperature, top_p):
            """``step`` on the first rows of the cache only (as many as ``tokens`` has): a step costs
            about its rows' worth, so few live requests decode fast."""
            rows = tokens.shape[0]
            head = {name: {k: v[:rows] for k, v in layer.items()} for name, layer in cache.items()}
            out, head = step(state, tokens, positions, head, mask, keys, counts, temperature, top_p)
            return out, {
                name: {
                    "k": layer["k"].at[:rows].set(head[name]["k"]),
                    "v": layer["v"].at[:rows].set(head[name]["v"]),
                    # every row's, not only these rows': it is the shared column t of all of them
                    "end_index": jnp.full_like(layer["end_index"], head[name]["end_index"][0]),
                }
                for name, layer in cache.items()
            }

        def insert(cache, small, rows, t, width):
            """Copy a prefilled group's keys and values (``small``, its prompts at columns 0..width) into
            ``rows`` of the cache at logical columns t - width .. t (rows out of range are dropped)."""
            out = {}
            for name, layer in cache.items():
                big_len, small_len = layer["k"].shape[1], small[name]["k"].shape[1]
                kept = jnp.arange(width - min(small_len, big_len, width), width)
                src, dst = kept % small_len, (t - width + kept) % big_len
                out[name] = dict(layer)
                for kv in ("k", "v"):
                    out[name][kv] = layer[kv].at[rows[:, None], dst[None, :]].set(small[name][kv][:, src], mode="drop")
            return out

        def rebase(cache, shift, span):
            """t reached L + M: the columns of the caches as long as the logical space move M left."""
            out = {}
            for name, layer in cache.items():
                out[name] = dict(layer, end_index=layer["end_index"] - shift)
                if layer["k"].shape[1] == span:
                    out[name]["k"] = jnp.roll(layer["k"], -shift, axis=1)
                    out[name]["v"] = jnp.roll(layer["v"], -shift, axis=1)
            return out

        def score(state, tokens, mask):
            """Each position's log-probability of the token after it, and its TOP_LOGPROBS best."""
            logits, _ = nnx.merge(graphdef, state)(tokens, None, None, mask)
            logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)[:, :-1]
            taken = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
            best, best_ids = jax.lax.top_k(logp, TOP_LOGPROBS)
            return taken, best, best_ids

        self._state = state
        self._score = jax.jit(score)
        self._prefill = jax.jit(step, donate_argnums=(3,))
        self._step = jax.jit(step_rows, donate_argnums=(3,))
        self._insert = jax.jit(insert, donate_argnums=(0,), static_argnums=(4,))
        self._rebase = jax.jit(rebase, donate_argnums=(0,), static_argnums=(1, 2))
        self._init_cache = model.init_cache
        self._jax, self._jnp = jax, jnp
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    def start(self, warm_up: bool = True) -> None:
        """Set up the rows, compile the decode step and the joining of 1, 2, 4, ... short prompts (so no
        early request waits for a compile), then serve."""
        jax, jnp = self._jax, self._jnp
        rows, span = self.max_num_seqs, self.span
        self._cache = self._init_cache(rows, span, self.cache_dtype)
        self._cache = {
            name: dict(layer, end_index=jnp.full_like(layer["end_index"], self.max_model_len))
            for name, layer in self._cache.items()
        }
        self._t = self.max_model_len  # the logical column the next decode step writes
        self._valid = np.zeros((rows, span), bool)  # the columns each row attends to
        self._rows: list[_Row | None] = [None] * rows
        self._keys = jax.random.key_data(jnp.stack([jax.random.key(0)] * rows))
        if warm_up:
            group = 1
            while group <= rows:
                batch = [
                    Request(self.tokenizer.bos or [self.tokenizer.eos_id], 2, lambda token, finish: None)
                    for _ in range(group)
                ]
                self._admit(batch)
                while any(self._rows):
                    self._decode()
                group *= 2
            self._ended = 0
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._waiting.qsize()

    def submit(self, request: Request) -> None:
        if len(request.prompt_ids) + 1 > self.max_model_len:
            raise ValueError(
                f"the prompt is {len(request.prompt_ids)} tokens; this model server's max_model_len is "
                f"{self.max_model_len}"
            )
        self._waiting.put(request)

    def score(self, ids: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The prompt's log-probabilities, from one cache-free forward pass (vLLM's prompt logprobs):
        for each token after the first, its own log-probability given those before it, and the
        TOP_LOGPROBS most likely tokens there (ids and log-probabilities). Safe from any thread."""
        if not 1 < len(ids) <= self.max_model_len:
            raise ValueError(f"the prompt is {len(ids)} tokens; 2 to max_model_len {self.max_model_len} are scored")
        width = min(-(-len(ids) // PROMPT_BUCKET) * PROMPT_BUCKET, self.max_model_len)
        tokens = np.full((1, width), self.tokenizer.pad_id, np.int32)
        tokens[0, : len(ids)] = ids  # right padding: causal attention keeps it out of the real positions
        mask = np.tril(np.ones((width, width), bool))[None]
        taken, best, best_ids = self._score(self._state, tokens, mask)
        n = len(ids) - 1
        return np.asarray(taken)[0, :n], np.asarray(best)[0, :n], np.asarray(best_ids)[0, :n]

    def finish_early(self, request: Request) -> None:
        """The request needs no more tokens (a stop string matched, or its client left)."""
        request.cancelled = True

    # -- the engine thread -------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            joining: list[Request] = []
            try:
                free = self._rows.count(None)
                if free == len(self._rows):  # idle: wait for work
                    joining.append(self._waiting.get())
                while len(joining) < free:
                    try:
                        joining.append(self._waiting.get_nowait())
                    except queue.Empty:
                        break
                recent = time.perf_counter() - self._ended_at < JOIN_RECENT_S
                expect = min(free, self._ended) if recent else 0
                if joining and len(joining) < expect:
                    deadline = time.perf_counter() + JOIN_WAIT_S
                    while len(joining) < expect and (left := deadline - time.perf_counter()) > 0:
                        try:
                            joining.append(self._waiting.get(timeout=min(JOIN_SETTLE_S, left)))
                        except queue.Empty:
                            break
                self._ended = 0 if joining else self._ended
                if joining:
                    self._admit(joining)
                if any(self._rows):
                    self._decode()
            except Exception as exc:  # noqa: BLE001 - reported to each request; the server goes on
                log.exception("generation failed")
                live = {id(row.request) for row in self._rows if row is not None}
                for r in joining:
                    if id(r) not in live:
                        r.emit(None, f"error: {exc}")
                for i, row in enumerate(self._rows):
                    if row is not None:
                        row.request.emit(None, f"error: {exc}")
                        self._free(i)

    def _admit(self, requests: list[Request]) -> None:
        """Prefill the requests' prompts together (left-padded), copy their keys and values into free
        rows just before column t, and hand each its first token."""
        jax, jnp = self._jax, self._jnp
        group = 1 << (len(requests) - 1).bit_length()
        longest = max(len(r.prompt_ids) for r in requests)
        width = min(-(-longest // PROMPT_BUCKET) * PROMPT_BUCKET, self.max_model_len - 1)
        tokens = np.full((group, width), self.tokenizer.pad_id, np.int32)
        valid = np.zeros((group, width), bool)
        for i, r in enumerate(requests):
            tokens[i, width - len(r.prompt_ids) :] = r.prompt_ids
            valid[i, width - len(r.prompt_ids) :] = True
        valid[len(requests) :, width - 1] = True  # padding rows: one token, never read
        positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0).astype(np.int32)
        mask = np.tril(np.ones((width, width), bool))[None] & valid[:, None, :]
        temperature = np.zeros(group, np.float32)
        top_p = np.ones(group, np.float32)
        keys = []
        for i in range(group):
            r = requests[i] if i < len(requests) else None
            if r is not None:
                temperature[i], top_p[i] = r.temperature, r.top_p
            seed = r.seed if r is not None and r.seed is not None else int(np.random.default_rng().integers(2**31))
            keys.append(jax.random.key(seed))
        keys = jnp.stack(keys)
        small = self._init_cache(group, width, self.cache_dtype)
        first, small = self._prefill(
            self._state, tokens, positions, small, mask, keys, np.zeros(group, np.int32), temperature, top_p
        )
        slots = [i for i, row in enumerate(self._rows) if row is None][: len(requests)]
        rows = np.full(group, self.max_num_seqs, np.int32)  # out of range: dropped
        rows[: len(slots)] = slots
        self._cache = self._insert(self._cache, small, jnp.asarray(rows), self._t, width)
        key_data = jax.random.key_data(keys)
        self._keys = self._keys.at[jnp.asarray(slots)].set(key_data[: len(slots)])
        first = np.asarray(first)
        for i, (slot, r) in enumerate(zip(slots, requests, strict=True)):
            self._valid[slot] = False
            self._valid[slot, self._t - width : self._t] = valid[i]
            row = _Row(r, budget=min(r.max_tokens, self.max_model_len - width), position=int(positions[i, -1]) + 1)
            self._rows[slot] = row
            self.running += 1
            self._take(slot, int(first[i]))

    def _decode(self) -> None:
        """One step of every row: each live row's last token in, its next token out."""
        jax = self._jax
        if self._t == self.span:
            m = self.shift
            self._cache = self._rebase(self._cache, m, self.span)
            self._valid[:, :-m] = self._valid[:, m:]
            self._valid[:, -m:] = False
            self._t -= m
            print(f"tunedeck: KV cache columns rebased at step {self.steps}", flush=True)
        # The rows up to the last live one, rounded up to a power of two (requests take the lowest free
        # rows), so a handful of shapes are compiled.
        last = max(i for i, row in enumerate(self._rows) if row is not None)
        n = min(self.max_num_seqs, 1 << last.bit_length())
        tokens = np.zeros((n, 1), np.int32)
        positions = np.zeros((n, 1), np.int32)
        counts = np.zeros(n, np.int32)
        temperature = np.zeros(n, np.float32)
        top_p = np.ones(n, np.float32)
        for i, row in enumerate(self._rows[:n]):
            if row is None:
                continue
            self._valid[i, self._t] = True
            tokens[i, 0], positions[i, 0], counts[i] = row.last, row.position, row.generated
            temperature[i], top_p[i] = row.request.temperature, row.request.top_p
        keys = jax.random.wrap_key_data(self._keys[:n])
        out, self._cache = self._step(
            self._state, tokens, positions, self._cache, self._valid[:n, None, :], keys, counts, temperature, top_p
        )
        out = np.asarray(out)
        self.steps += 1
        self._t += 1
        for i, row in enumerate(self._rows[:n]):
            if row is not None:
                row.position += 1
                self._take(i, int(out[i]))

    def _take(self, slot: int, token: int) -> None:
        """A row's new token: streamed to its request, or the row's end."""
        row = self._rows[slot]
        assert row is not None, "a token is taken for a live row"
        r = row.request
        if r.cancelled:
            self._free(slot)
            return
        # A request that ends is no longer running when its client hears of the end (as in vLLM, whose
        # scheduler frees it before its output goes out): freed first, then told.
        if token in self.stop_ids and not r.ignore_eos:
            self._free(slot)
            r.emit(token, "stop")  # generated, and counted (vLLM's check_stop reads it from the output)
            return
        row.generated += 1
        row.last = token
        r.emit(token, None)
        if row.generated >= row.budget:
            self._free(slot)
            r.emit(None, "length")

    def _free(self, slot: int) -> None:
        self._ended += 1
        self._ended_at = time.perf_counter()
        self._rows[slot] = None
        self._valid[slot] = False
        self.running -= 1


@dataclasses.dataclass
class _Row:
    """A request being decoded in a row of the cache."""

    request: Request
    budget: int  # the most tokens it may generate (max_tokens, within max_model_len)
    position: int  # the position of its next token in its own sequence
    generated: int = 0
    last: int = 0  # its last token: the next step's input
