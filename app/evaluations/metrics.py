"""Scoring of generated answers against reference answers, and summaries over samples.

Pure Python, no database and no JAX: the worker computes the scores and the web process may import
this module to describe them, so the heavy scorers (sacrebleu, rouge_score, and numpy for the
bootstrap) are imported inside the functions that use them.

Per-sample reference metrics (:data:`METRICS`), every score a float in [0, 1]:

* ``exact_match``: 1.0 when output and reference are equal after stripping leading and trailing
  whitespace, else 0.0.
* ``normalized_exact_match``: exact match after SQuAD v1.1's answer normalisation
  (:func:`normalize_answer`: lowercase, punctuation removed, the articles a/an/the removed, whitespace
  collapsed), as in the official SQuAD v1.1 evaluation script (Rajpurkar et al., 2016). The
  normalisation drops every ASCII punctuation character, so "-5" and "5", or "0.5" and "05", are equal.
* ``regex_match``: extract-and-match for answers embedded in free text (GSM8K's ``#### 42``, "The
  answer is (B)"): the answer of a text is the first match of a user pattern (its capture group if it
  has one), compared after :func:`normalize_answer`. See :func:`regex_match`.
* ``chrf``: sentence-level chrF (Popović, 2015) as computed by sacrebleu with its defaults (character
  n-grams up to 6, no word n-grams, beta 2, whitespace ignored), divided by 100. Two empty strings
  score 0.0.
* ``perplexity`` (not a score of the reply: of the reference): ``exp(-mean log p(token))`` over the
  reference's tokens as the model's chat template renders the reference as the assistant's reply (its
  end-of-turn token included), given the prompt. Per sample from its own tokens; summarised over all
  tokens of all samples (:func:`bootstrap_perplexity`), as a corpus perplexity is.
* ``rouge_l``: ROUGE-L F-measure (Lin, 2004; the longest common subsequence of tokens) as computed by
  Google's ``rouge_score`` package with its default tokenizer and no stemming. That tokenizer
  lowercases and keeps only the ASCII runs ``[a-z0-9]+``, so text with no ASCII letters or digits
  (Cyrillic, CJK, ...) has no tokens and scores 0.0, as do two empty strings.

Summaries:

* :func:`bootstrap_ci`: the mean of per-sample scores with a percentile bootstrap interval (Efron &
  Tibshirani, 1993), deterministic for a seed.
* :func:`combine_orders` and :func:`pairwise`: pairwise judging of two subjects (models). Each sample
  is judged twice with the presentation order swapped; a verdict that flips with the order counts as
  a tie, which cancels the judge's position bias. Win, tie and loss rates get Wilson score intervals
  (Wilson, 1927), which stay inside [0, 1] and behave at rates near 0 or 1, unlike the normal
  approximation.
* :func:`differ_most`: how much subjects disagree on one sample, to sort samples by it.
"""

from __future__ import annotations

import functools
import math
import re
import statistics
import string
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import regex
    from rouge_score.rouge_scorer import RougeScorer
    from sacrebleu.metrics.chrf import CHRF

METRICS: dict[str, str] = {
    "exact_match": "1 when the output equals the reference (leading and trailing whitespace ignored), else 0",
    "normalized_exact_match": (
        "1 when the output equals the reference after SQuAD normalisation "
        "(lowercase, no punctuation, no articles, single spaces), else 0"
    ),
    "regex_match": (
        "1 when the answer a pattern extracts from the output equals the reference's "
        "(its own extraction, or the whole reference), after SQuAD normalisation, else 0"
    ),
    "chrf": "chrF: character n-gram F-score (orders 1-6, beta 2), sacrebleu's sentence chrF / 100",
    "rouge_l": "ROUGE-L F-measure: longest common subsequence of words, rouge_score's rougeL",
    "perplexity": (
        "perplexity of the reference given the prompt: exp of its mean negative log-likelihood per token "
        "(the model's chat template; from the server's prompt log-probabilities; lower is better)"
    ),
}
# Metrics that are not a score in [0, 1] of the reply's text: computed from the model's likelihood of the
# reference (``perplexity``, lower is better), summarised over tokens and left out of the spread.
LIKELIHOOD = frozenset({"perplexity"})

# One search gets this long: a pattern that backtracks catastrophically would otherwise hold a worker
# for hours. A search that times out counts as no match.
REGEX_TIMEOUT_S = 0.1
# Only the head of a text is searched (the first match is what counts, so the head is the part that
# matters). 100,000 characters is about 25,000 tokens, longer than typical generated answers; the
# bound keeps the timeout the only cost a hostile pattern or a runaway generation can add.
REGEX_MAX_CHARS = 100_000

Outcome = Literal["win", "tie", "loss"]
OUTCOMES: tuple[Outcome, ...] = ("win", "tie", "loss")
VERDICTS = ("A", "B", "tie")


# ---------------------------------------------------------------------------------------------
# per-sample metrics


# Copied in behaviour from normalize_answer in the official SQuAD v1.1 evaluation script
# (evaluate-v1.1.py, https://rajpurkar.github.io/SQuAD-explorer/): the same steps in the same order,
# with the stdlib `re` (whose \b is Unicode-aware in Python 3, as in that script) and
# `string.punctuation` (ASCII only, as there), so scores match those published with that script.
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lowercase, remove ASCII punctuation, remove the articles a/an/the, collapse whitespace (SQuAD v1.1)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(output: str, reference: str) -> float:
    """1.0 when output and reference are equal after stripping surrounding whitespace, else 0.0."""
    return 1.0 if output.strip() == reference.strip() else 0.0


def normalized_exact_match(output: str, reference: str) -> float:
    """1.0 when output and reference are equal after :func:`normalize_answer`, else 0.0."""
    return 1.0 if normalize_answer(output) == normalize_answer(reference) else 0.0


@functools.lru_cache(maxsize=64)
def compile_pattern(pattern: str) -> regex.Pattern[str]:
    """Compile an answer-extraction pattern with the ``regex`` module.

    Raises ValueError, with a message naming the problem, when the pattern is empty, does not
    compile, or has more than one capture group (the one group, if any, is the answer). Compiled
    patterns are cached: :func:`score` is called once per sample with the same pattern.
    """
    import regex

    if not pattern:
        # An empty pattern matches the empty string at the start of every text: every answer would
        # be "" and every sample would match.
        raise ValueError("regex pattern is empty")
    try:
        compiled = regex.compile(pattern)
    except regex.error as e:
        raise ValueError(f"regex pattern {pattern!r} does not compile: {e}") from None
    if compiled.groups > 1:
        raise ValueError(
            f"regex pattern {pattern!r} has {compiled.groups} capture groups; at most one is allowed "
            "(the answer); use (?:...) for groups that are not the answer"
        )
    return compiled


def _extract(compiled: regex.Pattern[str], text: str) -> str | None:
    """The answer in `text`: its first match's capture group (or the whole match), stripped; None if
    there is no match or the search timed out."""
    try:
        m = compiled.search(text[:REGEX_MAX_CHARS], timeout=REGEX_TIMEOUT_S)
    except TimeoutError:
        return None
    if m is None:
        return None
    # A group that did not take part in the match (e.g. `answer:\s*(\d+)?`) yields None: no answer.
    answer = m.group(1) if compiled.groups else m.group(0)
    return (answer or "").strip()


def regex_match(output: str, reference: str, pattern: str) -> float:
    """Extract-and-match: 1.0 when the pattern's answer in the output equals the reference's answer.

    The answer of a text is the first match of `pattern` (its capture group 1 if it has one, else the
    whole match), stripped. The reference's answer is its own extraction when the pattern matches the
    reference, else the whole reference stripped, so references may be given either as bare answers
    ("42") or in the same format as the outputs ("... #### 42"). Both are compared after
    :func:`normalize_answer`. An output with no match scores 0.0.

    Each search stops after :data:`REGEX_TIMEOUT_S` seconds (a timeout counts as no match) and covers
    the first :data:`REGEX_MAX_CHARS` characters. Raises ValueError for a bad pattern
    (:func:`compile_pattern`).
    """
    compiled = compile_pattern(pattern)
    got = _extract(compiled, output)
    if got is None:
        return 0.0
    want = _extract(compiled, reference)
    if want is None:
        want = reference.strip()
    return 1.0 if normalize_answer(got) == normalize_answer(want) else 0.0


@functools.cache
def _chrf_metric() -> CHRF:
    from sacrebleu.metrics.chrf import CHRF

    return CHRF()  # char order 6, word order 0, beta 2: sacrebleu's defaults, as in sentence_chrf


@functools.cache
def _rouge_scorer() -> RougeScorer:
    from rouge_score.rouge_scorer import RougeScorer

    return RougeScorer(["rougeL"], use_stemmer=False)


def chrf(output: str, reference: str) -> float:
    """sacrebleu's sentence-level chrF of the output against the one reference, divided by 100."""
    return _chrf_metric().sentence_score(output, [reference]).score / 100.0


def rouge_l(output: str, reference: str) -> float:
    """rouge_score's ROUGE-L F-measure of the output against the reference (default tokenizer, no stemming)."""
    # rouge_score takes (target, prediction): the reference first.
    return float(_rouge_scorer().score(reference, output)["rougeL"].fmeasure)


def score(output: str, reference: str, metrics: Sequence[str], pattern: str | None = None) -> dict[str, float]:
    """The named :data:`METRICS` of one sample that score its text, name -> score in [0, 1].

    Raises ValueError naming an unknown metric, and when ``regex_match`` is asked for without a
    pattern or with a bad one. Names are checked before anything is computed.
    """
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ValueError(f"unknown metric {unknown[0]!r}; known metrics: {', '.join(METRICS)}")
    if "regex_match" in metrics:
        if pattern is None:
            raise ValueError("metric 'regex_match' needs a pattern")
        compile_pattern(pattern)
    out: dict[str, float] = {}
    for name in metrics:
        if name in out or name in LIKELIHOOD:  # not from the text: see perplexity()
            continue
        if name == "exact_match":
            out[name] = exact_match(output, reference)
        elif name == "normalized_exact_match":
            out[name] = normalized_exact_match(output, reference)
        elif name == "regex_match":
            assert pattern is not None
            out[name] = regex_match(output, reference, pattern)
        elif name == "chrf":
            out[name] = chrf(output, reference)
        elif name == "rouge_l":
            out[name] = rouge_l(output, reference)
    return out


# ---------------------------------------------------------------------------------------------
# summaries over samples

# Resampled means are computed this many values at a time, so 1000 resamples of a large evaluation
# do not need a resamples x n index array at once.
_BOOTSTRAP_CHUNK = 1_000_000


def bootstrap_ci(
    values: Sequence[float], *, resamples: int = 1000, confidence: float = 0.95, seed: int = 0
) -> tuple[float, float, float]:
    """(mean, low, high): the mean of `values` and its percentile bootstrap confidence interval.

    `resamples` samples of len(values) values are drawn with replacement (numpy's default_rng(seed),
    so the result is deterministic for a seed); low and high are the (1 - confidence) / 2 and
    (1 + confidence) / 2 percentiles of their means. Raises ValueError for no values, a value that is
    not finite, resamples < 1 or a confidence outside (0, 1). One value, or all values equal, gives
    (v, v, v).
    """
    if not values:
        raise ValueError("bootstrap_ci needs at least one value")
    if resamples < 1:
        raise ValueError(f"resamples must be at least 1, got {resamples}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be between 0 and 1, got {confidence}")
    if not all(math.isfinite(v) for v in values):
        raise ValueError("bootstrap_ci values must be finite numbers")
    first = float(values[0])
    if all(v == first for v in values):
        return first, first, first

    import numpy as np

    data = np.asarray(values, dtype=np.float64)
    n = data.size
    mean = float(data.mean())
    rng = np.random.default_rng(seed)
    rows = max(1, _BOOTSTRAP_CHUNK // n)
    means = np.empty(resamples, dtype=np.float64)
    for start in range(0, resamples, rows):
        stop = min(start + rows, resamples)
        means[start:stop] = data[rng.integers(0, n, size=(stop - start, n))].mean(axis=1)
    alpha = 1.0 - confidence
    low, high = np.percentile(means, [100.0 * alpha / 2, 100.0 * (1.0 - alpha / 2)])
    # The percentile interval of a mean holds the sample mean but for rounding in the resampled sums;
    # callers display mean [low, high] and may rely on the order.
    return mean, min(float(low), mean), max(float(high), mean)


def perplexity(nll: float, tokens: int) -> float:
    """exp(nll / tokens): one sample's perplexity from its summed negative log-likelihood."""
    return math.exp(nll / tokens)


def bootstrap_perplexity(
    nll: Sequence[float], tokens: Sequence[int], *, resamples: int = 1000, confidence: float = 0.95, seed: int = 0
) -> tuple[float, float, float]:
    """(perplexity, low, high) over samples: exp(total nll / total tokens), with a percentile bootstrap
    interval over the samples (each resample of samples gives its own ratio). Raises ValueError for no
    samples, a sample with no tokens or a value that is not finite."""
    if not nll or len(nll) != len(tokens):
        raise ValueError("bootstrap_perplexity needs as many token counts as log-likelihoods, at least one")
    if any(t < 1 for t in tokens) or not all(math.isfinite(v) for v in nll):
        raise ValueError("each sample needs a token and a finite log-likelihood")
    import numpy as np

    loss, count = np.asarray(nll, np.float64), np.asarray(tokens, np.float64)
    value = math.exp(loss.sum() / count.sum())
    if len(loss) == 1:
        return value, value, value
    rng = np.random.default_rng(seed)
    rows = max(1, _BOOTSTRAP_CHUNK // len(loss))
    ratios = np.empty(resamples, np.float64)
    for start in range(0, resamples, rows):
        stop = min(start + rows, resamples)
        idx = rng.integers(0, len(loss), size=(stop - start, len(loss)))
        ratios[start:stop] = loss[idx].sum(axis=1) / count[idx].sum(axis=1)
    alpha = 1.0 - confidence
    low, high = np.exp(np.percentile(ratios, [100.0 * alpha / 2, 100.0 * (1.0 - alpha / 2)]))
    return value, min(float(low), value), max(float(high), value)


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion successes / n (Wilson, 1927).

    Raises ValueError for n < 1, successes outside [0, n] or a confidence outside (0, 1).
    """
    if n < 1:
        raise ValueError(f"wilson_interval needs n >= 1, got {n}")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be between 0 and n={n}, got {successes}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be between 0 and 1, got {confidence}")
    z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2)
    p = successes / n
    z2n = z * z / n
    center = (p + z2n / 2) / (1 + z2n)
    half = z / (1 + z2n) * math.sqrt(p * (1 - p) / n + z2n / (4 * n))
    # At 0 or n successes the bound is 0 or 1 exactly; the formula leaves a rounding residue there.
    low = 0.0 if successes == 0 else max(0.0, center - half)
    high = 1.0 if successes == n else min(1.0, center + half)
    return low, high


def combine_orders(first: str, second: str) -> Outcome:
    """The outcome for subject A of one sample judged twice, with the presentation order swapped.

    `first` is the judge's verdict when A was shown first, `second` when B was shown first; both are
    "A", "B" or "tie", naming the subject judged better (the caller maps the judge's positions back to
    subjects). When both verdicts name the same subject it wins ("win" if A, "loss" if B); when they
    disagree, or either is a tie, the result is "tie": a verdict that follows the position rather than
    the answer counts for neither side, which cancels the judge's position bias.
    Raises ValueError for any other verdict.
    """
    for name, verdict in (("first", first), ("second", second)):
        if verdict not in VERDICTS:
            raise ValueError(f"{name} verdict must be one of 'A', 'B', 'tie', got {verdict!r}")
    if first == second == "A":
        return "win"
    if first == second == "B":
        return "loss"
    return "tie"


def pairwise(outcomes: Sequence[str], *, confidence: float = 0.95) -> dict[str, Any]:
    """Summary of pairwise judging, A against B, from per-sample outcomes for A.

    Each outcome is "win", "tie" or "loss" (usually from :func:`combine_orders`). Returns
    ``{"n", "win", "tie", "loss", "win_rate", "tie_rate", "loss_rate", "win_rate_ci": [low, high],
    "loss_rate_ci": [low, high]}``: counts, rates over n, and Wilson score intervals
    (:func:`wilson_interval`) at `confidence` for the win and loss rates. Raises ValueError for no
    outcomes or an unknown outcome.
    """
    if not outcomes:
        raise ValueError("pairwise needs at least one outcome")
    counts = dict.fromkeys(OUTCOMES, 0)
    for o in outcomes:
        if o not in counts:
            raise ValueError(f"outcome must be one of 'win', 'tie', 'loss', got {o!r}")
        counts[o] += 1
    n = len(outcomes)
    return {
        "n": n,
        **counts,
        "win_rate": counts["win"] / n,
        "tie_rate": counts["tie"] / n,
        "loss_rate": counts["loss"] / n,
        "win_rate_ci": list(wilson_interval(counts["win"], n, confidence)),
        "loss_rate_ci": list(wilson_interval(counts["loss"], n, confidence)),
    }


def differ_most(per_subject: Mapping[str, Mapping[str, float]]) -> float:
    """How much subjects disagree on one sample: the largest max - min over subjects of any metric in
    [0, 1] that every subject has a score for. 0.0 with fewer than two subjects or no such metric."""
    if len(per_subject) < 2:
        return 0.0
    scores = list(per_subject.values())
    shared = set(scores[0]).intersection(*scores[1:]) - LIKELIHOOD  # scores in [0, 1] only
    spread = 0.0
    for metric in shared:
        values = [s[metric] for s in scores]
        spread = max(spread, max(values) - min(values))
    return spread
