"""Text generation for the built-in model server: a merged Hugging Face checkpoint loaded through
Tunix's loader, a KV cache, and the requests that wait decoded together.

Batching: the engine thread takes every waiting request (up to ``max_num_seqs``), prefills their
prompts together (left-padded) and decodes them one step at a time, all rows in one call, handing
each row's new token to its request as it comes (so replies stream). A row that finishes stops
streaming at once; the batch ends when all its rows have finished, and the requests that arrived
meanwhile form the next batch. A decode step costs about the same for 1 row as for 16, so
throughput grows with concurrency. (Rows cannot join a running batch: Tunix's Gemma 4 cache writes
one column for all rows per step.)

Batch sizes are rounded up to powers of two and prompt lengths to multiples of PROMPT_BUCKET, so a
handful of shapes are compiled once each.
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


@dataclasses.dataclass
class Request:
    """One generation. ``emit(token_id | None, finish_reason | None)`` is called on the engine thread
    for each new token, then once with the finish reason ("stop" or "length")."""

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

        from worker.merge.merge import open_checkpoint
        from worker.merge.verify import weights_dtype
        from worker.training import models
        from worker.training.data import ChatTokenizer
        from worker.training.engine import configure_compilation_cache

        configure_compilation_cache()  # the same persistent cache as training: a redeploy compiles nothing
        self.model_dir = Path(model_dir)
        self.tokenizer = ChatTokenizer(self.model_dir)
        self.stop_ids = {self.tokenizer.eos_id, self.tokenizer.turn_end_id}
        config = models.resolve_config(self.model_dir)
        dtype = dtype or weights_dtype(open_checkpoint(str(self.model_dir)))
        model = models.load_base_model(self.model_dir, config, dtype=dtype)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.vocab_size = config.num_embed
        self.cache_dtype = jnp.float32 if dtype == "float32" else jnp.bfloat16
        graphdef, state = nnx.split(model)
        self._model = model
        self._waiting: queue.Queue[Request] = queue.Queue()
        self.running = 0  # rows of the batch being decoded that have not finished
        self.steps = 0

        def forward(state, tokens, positions, cache, mask):
            return nnx.merge(graphdef, state)(tokens, positions, cache, mask, decode_only_last_token=True)

        def sample(logits, keys, temperature, top_p):
            """Per row: greedy where temperature is 0, else nucleus sampling from its own key."""
            logits = logits[:, -1, :].astype(jnp.float32)
            greedy = jnp.argmax(logits, axis=-1)
            scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
            order = jnp.argsort(-scaled, axis=-1)
            sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
            probs = jax.nn.softmax(sorted_logits, axis=-1)
            cut = jnp.cumsum(probs, axis=-1) - probs > top_p[:, None]  # keep the smallest set reaching top_p
            sorted_logits = jnp.where(cut, -jnp.inf, sorted_logits)
            picked = jax.vmap(jax.random.categorical)(keys, sorted_logits)
            sampled = jnp.take_along_axis(order, picked[:, None], axis=-1)[:, 0]
            return jnp.where(temperature > 0, sampled, greedy)

        def step(state, tokens, positions, cache, mask, keys, temperature, top_p):
            logits, cache = forward(state, tokens, positions, cache, mask)
            return sample(logits, keys, temperature, top_p), cache

        self._state = state
        self._step = jax.jit(step, donate_argnums=(3,))
        self._init_cache = model.init_cache
        self._jax, self._jnp = jax, jnp
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    def start(self, warm_up: bool = True) -> None:
        """Compile every batch shape for short prompts (powers of two up to max_num_seqs), so no early
        request waits for a compile; then serve."""
        if warm_up:
            rows = 1
            while rows // 2 < self.max_num_seqs:
                batch = [
                    Request([self.tokenizer.bos_id], 2, lambda token, finish: None, temperature=1.0)
                    for _ in range(rows)
                ]
                self._run(batch)
                rows *= 2
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

    # -- the engine thread -------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            batch = [self._waiting.get()]
            while len(batch) < self.max_num_seqs:
                try:
                    batch.append(self._waiting.get_nowait())
                except queue.Empty:
                    break
            try:
                self._run(batch)
            except Exception as exc:  # noqa: BLE001 - reported to each request; the server goes on
                log.exception("generation failed")
                for r in batch:
                    r.emit(None, f"error: {exc}")
            finally:
                self.running = 0

    def _run(self, batch: list[Request]) -> None:
        jax, jnp = self._jax, self._jnp
        rows = 1 << (len(batch) - 1).bit_length()  # a power of two
        longest = max(len(r.prompt_ids) for r in batch)
        width = min(-(-longest // PROMPT_BUCKET) * PROMPT_BUCKET, self.max_model_len - 1)
        budget = [min(r.max_tokens, self.max_model_len - width) for r in batch]
        cache_len = self.max_model_len
        pad = self.tokenizer.pad_id

        tokens = np.full((rows, width), pad, np.int32)
        valid = np.zeros((rows, cache_len), bool)  # the cache columns each row attends to
        for i, r in enumerate(batch):
            tokens[i, width - len(r.prompt_ids) :] = r.prompt_ids
            valid[i, width - len(r.prompt_ids) : width] = True
        for i in range(len(batch), rows):  # padding rows: one token, never read
            valid[i, width - 1] = True
        positions = np.maximum(np.cumsum(valid[:, :width], axis=1) - 1, 0).astype(np.int32)
        causal = np.tril(np.ones((width, width), bool))
        mask = np.zeros((rows, width, cache_len), bool)
        mask[:, :, :width] = causal[None] & valid[:, None, :width]

        temperature = np.zeros(rows, np.float32)
        top_p = np.ones(rows, np.float32)
        base_keys = []
        for i in range(rows):
            r = batch[i] if i < len(batch) else None
            if r is not None:
                temperature[i], top_p[i] = r.temperature, r.top_p
            seed = r.seed if r is not None and r.seed is not None else int(np.random.default_rng().integers(2**31))
            base_keys.append(jax.random.key(seed))
        base_keys = jnp.stack(base_keys)

        cache = self._init_cache(rows, cache_len, self.cache_dtype)
        next_pos = positions[:, -1] + 1
        finished = [False] * len(batch)
        generated = [0] * len(batch)
        self.running = len(batch)
        t = width  # the cache column the next token goes to
        step_tokens, step_positions, step_mask = tokens, positions, mask
        while True:
            keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(base_keys, t)
            out, cache = self._step(
                self._state, step_tokens, step_positions, cache, step_mask, keys, temperature, top_p
            )
            out = np.asarray(out)
            self.steps += 1
            for i, r in enumerate(batch):
                if finished[i]:
                    continue
                token = int(out[i])
                if r.cancelled:
                    finished[i] = True
                    self.running -= 1
                    continue
                if token in self.stop_ids and not r.ignore_eos:
                    finished[i] = True
                    self.running -= 1
                    r.emit(None, "stop")
                    continue
                generated[i] += 1
                r.emit(token, None)
                if generated[i] >= budget[i] or t + 1 >= cache_len:
                    finished[i] = True
                    self.running -= 1
                    r.emit(None, "length")
            if all(finished):
                return
            valid[:, t] = True
            step_tokens = out[:, None].astype(np.int32)
            step_positions = next_pos[:, None].astype(np.int32)
            next_pos = next_pos + 1
            step_mask = valid[:, None, :].copy()
            t += 1

    def finish_early(self, request: Request) -> None:
        """The request needs no more tokens (a stop string matched, or its client left)."""
        request.cancelled = True
