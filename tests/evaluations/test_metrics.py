"""Tests for app.evaluations.metrics, cross-checked against the reference implementations.

chrF against sacrebleu, ROUGE-L against rouge_score, the SQuAD normalisation against a verbatim
copy of the official script's function, the bootstrap and the Wilson interval against scipy.
"""

from __future__ import annotations

import re
import string
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from app.evaluations import metrics
from app.evaluations.metrics import (
    METRICS,
    REGEX_MAX_CHARS,
    bootstrap_ci,
    chrf,
    combine_orders,
    compile_pattern,
    differ_most,
    exact_match,
    normalize_answer,
    normalized_exact_match,
    pairwise,
    regex_match,
    rouge_l,
    score,
    wilson_interval,
)

ROOT = Path(__file__).resolve().parents[2]
GSM8K = r"#### (\-?[0-9\.\,]+)"

PAIRS = [
    ("The cat sat on the mat.", "The cat sat on the mat."),
    ("the cat on the mat", "the cat sat on the mat"),
    ("A quick brown fox", "The quick brown dog jumps"),
    ("", "a non-empty reference"),
    ("non-empty output", ""),
    ("", ""),
    ("héllo wörld, ça va?", "hello world, ça va"),
    ("東京は日本の首都です", "日本の首都は東京です"),
    ("Привет, мир", "привет мир"),
    ("42", "The answer is 42"),
    ("  spaced   out  ", "spaced out"),
]


def squad_v11_normalize_answer(s):
    """Verbatim from the official SQuAD v1.1 evaluate script (evaluate-v1.1.py)."""

    def remove_articles(text):
        return re.sub(r"\b(a|an|the)\b", " ", text)

    def white_space_fix(text):
        return " ".join(text.split())

    def remove_punc(text):
        exclude = set(string.punctuation)
        return "".join(ch for ch in text if ch not in exclude)

    def lower(text):
        return text.lower()

    return white_space_fix(remove_articles(remove_punc(lower(s))))


# ---------------------------------------------------------------------------------------------
# module shape


def test_import_is_light() -> None:
    # The web process imports this module; the scorers (nltk through rouge_score) cost seconds.
    code = (
        "import sys, app.evaluations.metrics; "
        "print(sorted(m for m in ('sacrebleu', 'rouge_score', 'nltk', 'numpy', 'regex') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_metric_names() -> None:
    assert list(METRICS) == ["exact_match", "normalized_exact_match", "regex_match", "chrf", "rouge_l", "perplexity"]
    assert all(isinstance(d, str) and d for d in METRICS.values())


@pytest.mark.parametrize(("output", "reference"), PAIRS)
def test_scores_in_unit_interval(output: str, reference: str) -> None:
    scores = score(output, reference, list(METRICS), pattern=r"\d+")
    assert set(scores) == set(METRICS) - metrics.LIKELIHOOD  # perplexity: of the reference, not the text
    for name, value in scores.items():
        assert isinstance(value, float), name
        assert 0.0 <= value <= 1.0, (name, value)


# ---------------------------------------------------------------------------------------------
# exact match and the SQuAD normalisation


def test_normalize_answer_examples() -> None:
    assert normalize_answer("The  Cat!") == "cat"
    assert normalize_answer("an apple, a pear") == "apple pear"
    # Articles only as whole words: "theory", "banana", "ant" keep their letters.
    assert normalize_answer("The theory of a banana and an ant") == "theory of banana and ant"
    assert normalize_answer("  Tab\tand\nnewline  ") == "tab and newline"
    # ASCII punctuation only, as in the script: the guillemets and the em dash stay.
    assert normalize_answer("«Oui» — non.") == "«oui» — non"


@pytest.mark.parametrize(
    "text",
    [p[0] for p in PAIRS]
    + [p[1] for p in PAIRS]
    + ["The, the. THE", "a-an-the", "O'Neil's A.B.C.", "Ångström the Über", "x\u00a0the\u2003y", "theater a"],
)
def test_normalize_answer_matches_squad_script(text: str) -> None:
    assert normalize_answer(text) == squad_v11_normalize_answer(text)


def test_exact_match() -> None:
    assert exact_match("Paris", "Paris") == 1.0
    assert exact_match("  Paris\n", "Paris ") == 1.0
    assert exact_match("paris", "Paris") == 0.0
    assert exact_match("Par is", "Paris") == 0.0
    assert exact_match("", "") == 1.0


def test_normalized_exact_match() -> None:
    assert normalized_exact_match("The Eiffel Tower!", "eiffel tower") == 1.0
    assert normalized_exact_match("Eiffel  Tower", "the eiffel-tower") == 0.0  # the hyphen goes, no space comes
    assert normalized_exact_match("Eiffel Tower", "Eiffel Towers") == 0.0


# ---------------------------------------------------------------------------------------------
# regex_match


def test_regex_match_gsm8k() -> None:
    output = "She has 40 apples and buys 2 more, so 40 + 2 = 42.\n#### 42"
    assert regex_match(output, "#### 42", GSM8K) == 1.0
    assert regex_match(output, "#### 43", GSM8K) == 0.0
    # The reference's own extraction is used, and both answers are SQuAD-normalised ("1,000" = "1000").
    assert regex_match("so #### 1000", "Work... #### 1,000", GSM8K) == 1.0
    # The first match is the answer, not a later one.
    assert regex_match("#### 41 no wait #### 42", "#### 42", GSM8K) == 0.0


def test_regex_match_without_group_uses_whole_match() -> None:
    pattern = r"\b[A-D]\b(?=\)?\s*$)"
    assert regex_match("Looking at the options, the answer is B", "B", pattern) == 1.0
    assert regex_match("Looking at the options, the answer is C", "B", pattern) == 0.0
    pattern = r"answer is \w+"
    assert regex_match("I think the answer is Paris.", "The answer is paris", pattern) == 1.0


def test_regex_match_reference_without_match_is_compared_whole() -> None:
    # "42" has no "####": the whole reference is the answer.
    assert regex_match("so #### 42", "42", GSM8K) == 1.0
    assert regex_match("so #### 42", "  42 \n", GSM8K) == 1.0
    assert regex_match("so #### 42", "the answer is 42", GSM8K) == 0.0


def test_regex_match_no_match_in_output_is_zero() -> None:
    assert regex_match("the answer is 42", "42", GSM8K) == 0.0
    # Even when the output, whole, would equal the reference.
    assert regex_match("42", "42", GSM8K) == 0.0


def test_regex_match_optional_group_not_taken_is_no_answer() -> None:
    assert regex_match("answer: none given", "42", r"answer:\s*(\d+)?") == 0.0
    assert regex_match("answer: 42", "42", r"answer:\s*(\d+)?") == 1.0


@pytest.mark.parametrize(("pattern", "text"), [(r"(a+)+$", "a" * 40 + "b"), (r"(a|aa)+$", "a" * 40 + "b")])
def test_regex_match_catastrophic_pattern_is_bounded(pattern: str, text: str) -> None:
    # The second one backtracks exponentially in `regex` and ends only by the timeout.
    start = time.perf_counter()
    assert regex_match(text, text, pattern) == 0.0
    assert time.perf_counter() - start < 2.0


def test_regex_match_searches_only_the_head() -> None:
    assert regex_match("x" * REGEX_MAX_CHARS + " #### 42", "42", GSM8K) == 0.0
    assert regex_match("x" * (REGEX_MAX_CHARS - 20) + " #### 42", "42", GSM8K) == 1.0


def test_compile_pattern_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match=r"does not compile"):
        compile_pattern("(")
    with pytest.raises(ValueError, match=r"has 2 capture groups"):
        compile_pattern(r"(\d+)-(\d+)")
    with pytest.raises(ValueError, match=r"empty"):
        compile_pattern("")
    with pytest.raises(ValueError, match=r"does not compile"):
        regex_match("x", "x", "[a-")
    # One group, a named group, and non-capturing groups are fine.
    assert compile_pattern(GSM8K).groups == 1
    assert compile_pattern(r"(?P<ans>\d+)").groups == 1
    assert compile_pattern(r"(?:a|b)(?:c)").groups == 0


# ---------------------------------------------------------------------------------------------
# chrF and ROUGE-L against their reference implementations


@pytest.mark.parametrize(("output", "reference"), PAIRS)
def test_chrf_matches_sacrebleu(output: str, reference: str) -> None:
    import sacrebleu
    from sacrebleu.metrics import CHRF

    expected = CHRF().sentence_score(output, [reference]).score / 100
    assert chrf(output, reference) == pytest.approx(expected, abs=1e-12)
    assert chrf(output, reference) == pytest.approx(sacrebleu.sentence_chrf(output, [reference]).score / 100, abs=1e-12)


def test_chrf_values() -> None:
    assert chrf("The cat sat on the mat.", "The cat sat on the mat.") == pytest.approx(1.0)
    assert chrf("東京は日本の首都です", "東京は日本の首都です") == pytest.approx(1.0)
    assert chrf("", "a reference") == 0.0
    partial = chrf("the cat on the mat", "the cat sat on the mat")
    assert 0.5 < partial < 1.0
    # Recall weighs more than precision (beta 2): dropping words costs more than adding them.
    assert chrf("the cat sat on the mat today", "the cat sat on the mat") > chrf("the cat", "the cat sat on the mat")


@pytest.mark.parametrize(("output", "reference"), PAIRS)
def test_rouge_l_matches_rouge_score(output: str, reference: str) -> None:
    from rouge_score import rouge_scorer

    expected = rouge_scorer.RougeScorer(["rougeL"]).score(reference, output)["rougeL"].fmeasure
    assert rouge_l(output, reference) == pytest.approx(expected, abs=1e-12)


def test_rouge_l_hand_computed() -> None:
    # LCS of "the cat on the mat" in "the cat sat on the mat" is the whole output: 5 tokens.
    p, r = 5 / 5, 5 / 6
    assert rouge_l("the cat on the mat", "the cat sat on the mat") == pytest.approx(2 * p * r / (p + r))
    # Argument order matters: precision and recall swap, the F-measure is symmetric.
    assert rouge_l("the cat sat on the mat", "the cat on the mat") == pytest.approx(2 * p * r / (p + r))
    # Order of words matters: LCS of "mat the on" in "on the mat" is 1 token.
    assert rouge_l("mat the on", "on the mat") == pytest.approx(1 / 3)
    assert rouge_l("The Cat", "the cat") == 1.0  # the default tokenizer lowercases
    assert rouge_l("Привет, мир", "Привет, мир") == 0.0  # and keeps only ASCII letters and digits


# ---------------------------------------------------------------------------------------------
# score()


def test_score_selects_metrics() -> None:
    out = score("The answer is #### 42", "#### 42", ["exact_match", "regex_match", "rouge_l"], pattern=GSM8K)
    assert list(out) == ["exact_match", "regex_match", "rouge_l"]
    assert out["exact_match"] == 0.0
    assert out["regex_match"] == 1.0
    assert out["rouge_l"] == pytest.approx(rouge_l("The answer is #### 42", "#### 42"))
    assert score("x", "x", []) == {}


def test_score_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match=r"unknown metric 'bleu'"):
        score("a", "a", ["exact_match", "bleu"])
    with pytest.raises(ValueError, match=r"'regex_match' needs a pattern"):
        score("a", "a", ["chrf", "regex_match"])
    with pytest.raises(ValueError, match=r"2 capture groups"):
        score("a", "a", ["regex_match"], pattern="(a)(b)")
    # A pattern is needed only for regex_match.
    assert score("a", "a", ["exact_match"], pattern=None) == {"exact_match": 1.0}


# ---------------------------------------------------------------------------------------------
# bootstrap_ci


def test_bootstrap_ci_basics() -> None:
    values = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.25, 1.0, 0.0]
    mean, low, high = bootstrap_ci(values)
    assert mean == pytest.approx(sum(values) / len(values))
    assert low < mean < high
    assert 0.0 <= low and high <= 1.0
    varied = np.random.default_rng(3).uniform(size=50).tolist()
    assert bootstrap_ci(varied, seed=7) == bootstrap_ci(varied, seed=7)
    assert bootstrap_ci(varied, seed=7) != bootstrap_ci(varied, seed=8)
    # A wider confidence gives a wider interval.
    _, low99, high99 = bootstrap_ci(values, confidence=0.99)
    assert low99 <= low and high99 >= high and (high99 - low99) > (high - low)


def test_bootstrap_ci_degenerate_and_errors() -> None:
    assert bootstrap_ci([0.3]) == (0.3, 0.3, 0.3)
    assert bootstrap_ci([0.1] * 7) == (0.1, 0.1, 0.1)
    with pytest.raises(ValueError, match="at least one value"):
        bootstrap_ci([])
    with pytest.raises(ValueError, match="finite"):
        bootstrap_ci([0.5, float("nan")])
    with pytest.raises(ValueError, match="confidence"):
        bootstrap_ci([0.1, 0.2], confidence=1.0)
    with pytest.raises(ValueError, match="resamples"):
        bootstrap_ci([0.1, 0.2], resamples=0)


def test_bootstrap_ci_narrows_with_more_samples() -> None:
    rng = np.random.default_rng(123)
    small = rng.uniform(size=20).tolist()
    large = rng.uniform(size=2000).tolist()
    _, s_low, s_high = bootstrap_ci(small)
    _, l_low, l_high = bootstrap_ci(large)
    # The width goes as 1/sqrt(n): 10x narrower for 100x the samples; allow for noise.
    assert (l_high - l_low) < (s_high - s_low) / 5
    assert l_low < 0.5 < l_high  # the true mean of U(0, 1)


def test_bootstrap_ci_chunked_resampling_covers_all_resamples(monkeypatch: pytest.MonkeyPatch) -> None:
    values = np.random.default_rng(5).uniform(size=300).tolist()
    whole = bootstrap_ci(values, resamples=500)
    monkeypatch.setattr(metrics, "_BOOTSTRAP_CHUNK", 300 * 7)  # 7 resamples per chunk, a ragged last one
    chunked = bootstrap_ci(values, resamples=500)
    # One generator draws the same index stream whatever the chunking: the chunks must fill every resample.
    assert chunked == pytest.approx(whole, abs=1e-12)


def test_bootstrap_ci_agrees_with_scipy() -> None:
    from scipy import stats

    data = np.random.default_rng(42).beta(2, 5, size=200)
    mean, low, high = bootstrap_ci(data.tolist(), resamples=4000, seed=1)
    ref = stats.bootstrap(
        (data,), np.mean, n_resamples=4000, confidence_level=0.95, method="percentile", rng=np.random.default_rng(2)
    ).confidence_interval
    # Different random draws: agreement to Monte Carlo error (about 0.001 here; the interval is 0.044 wide,
    # its 90% bounds 0.0035 inside the 95% ones).
    assert mean == pytest.approx(float(data.mean()))
    assert low == pytest.approx(ref.low, abs=0.002)
    assert high == pytest.approx(ref.high, abs=0.002)


# ---------------------------------------------------------------------------------------------
# pairwise judging


@pytest.mark.parametrize(
    ("first", "second", "expected"),
    [
        ("A", "A", "win"),
        ("B", "B", "loss"),
        ("A", "B", "tie"),  # the verdict followed the position: cancelled
        ("B", "A", "tie"),
        ("A", "tie", "tie"),
        ("tie", "A", "tie"),
        ("B", "tie", "tie"),
        ("tie", "B", "tie"),
        ("tie", "tie", "tie"),
    ],
)
def test_combine_orders_truth_table(first: str, second: str, expected: str) -> None:
    assert combine_orders(first, second) == expected


def test_combine_orders_rejects_unknown_verdicts() -> None:
    with pytest.raises(ValueError, match=r"first verdict .* got 'a'"):
        combine_orders("a", "A")
    with pytest.raises(ValueError, match=r"second verdict .* got 'win'"):
        combine_orders("A", "win")


def test_wilson_interval_hand_computed() -> None:
    low, high = wilson_interval(8, 10)
    assert (round(low, 4), round(high, 4)) == (0.4902, 0.9433)
    assert wilson_interval(0, 10)[0] == 0.0
    assert wilson_interval(10, 10)[1] == 1.0
    assert 0.0 < wilson_interval(0, 10)[1] < 0.35
    with pytest.raises(ValueError):
        wilson_interval(0, 0)
    with pytest.raises(ValueError):
        wilson_interval(11, 10)


@pytest.mark.parametrize(("k", "n"), [(0, 5), (1, 7), (8, 10), (37, 100), (999, 1000)])
def test_wilson_interval_agrees_with_scipy(k: int, n: int) -> None:
    from scipy import stats

    ref = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    assert wilson_interval(k, n) == pytest.approx((ref.low, ref.high), abs=1e-9)


def test_pairwise_summary() -> None:
    outcomes = ["win"] * 8 + ["loss"] * 1 + ["tie"] * 1
    out = pairwise(outcomes)
    assert {k: out[k] for k in ("n", "win", "tie", "loss")} == {"n": 10, "win": 8, "tie": 1, "loss": 1}
    assert (out["win_rate"], out["tie_rate"], out["loss_rate"]) == pytest.approx((0.8, 0.1, 0.1))
    assert out["win_rate_ci"] == pytest.approx([0.4902, 0.9433], abs=5e-4)
    assert out["loss_rate_ci"] == pytest.approx(list(wilson_interval(1, 10)))
    assert out["win_rate_ci"][0] <= out["win_rate"] <= out["win_rate_ci"][1]
    assert set(out) == {"n", "win", "tie", "loss", "win_rate", "tie_rate", "loss_rate", "win_rate_ci", "loss_rate_ci"}


def test_pairwise_from_combined_orders() -> None:
    judged = [("A", "A"), ("A", "B"), ("B", "B"), ("tie", "A"), ("A", "A")]
    out = pairwise([combine_orders(f, s) for f, s in judged])
    assert (out["win"], out["tie"], out["loss"]) == (2, 2, 1)


def test_pairwise_errors() -> None:
    with pytest.raises(ValueError, match="at least one"):
        pairwise([])
    with pytest.raises(ValueError, match="got 'A'"):
        pairwise(["win", "A"])


# ---------------------------------------------------------------------------------------------
# differ_most


def test_differ_most() -> None:
    assert differ_most({}) == 0.0
    assert differ_most({"m1": {"chrf": 0.9}}) == 0.0
    assert differ_most({"m1": {"chrf": 0.9, "rouge_l": 0.2}, "m2": {"chrf": 0.4, "rouge_l": 0.3}}) == pytest.approx(0.5)
    # Spread over three subjects is max - min; metrics not scored for every subject are ignored.
    per_subject = {
        "m1": {"exact_match": 1.0, "chrf": 0.7},
        "m2": {"exact_match": 1.0, "chrf": 0.2, "regex_match": 0.0},
        "m3": {"exact_match": 1.0, "chrf": 0.5, "regex_match": 1.0},
    }
    assert differ_most(per_subject) == pytest.approx(0.5)
    assert differ_most({"m1": {"chrf": 0.5}, "m2": {"rouge_l": 0.1}}) == 0.0
    assert differ_most({"m1": {"chrf": 0.5}, "m2": {"chrf": 0.5}}) == 0.0


# ---------------------------------------------------------------------------------------------
# perplexity


def test_perplexity_is_over_every_token_of_every_sample_not_a_mean_of_samples():
    # Sample 1: 1 token, nll 2; sample 2: 3 tokens, nll 4. Over tokens: exp(6 / 4). (The mean of the
    # samples' own perplexities, (e^2 + e^(4/3)) / 2, would weigh the 1-token sample as much as the other.)
    value, low, high = metrics.bootstrap_perplexity([2.0, 4.0], [1, 3])
    assert value == pytest.approx(np.exp(1.5)) and low <= value <= high
    assert metrics.perplexity(4.0, 3) == pytest.approx(np.exp(4 / 3))
    # Each resample is a ratio of its own sums: the interval spans what the samples' ratios can give.
    assert low >= np.exp(4 / 3) - 1e-12 and high <= np.exp(2.0) + 1e-12
    assert metrics.bootstrap_perplexity([3.0], [2]) == (np.exp(1.5),) * 3
    for nll, tokens in [([], []), ([1.0], [0]), ([float("nan")], [1]), ([1.0, 2.0], [1])]:
        with pytest.raises(ValueError):
            metrics.bootstrap_perplexity(nll, tokens)
    # Not a score of the text: score() leaves it to the likelihoods, and the spread leaves it out.
    assert metrics.score("a", "a", ["exact_match", "perplexity"]) == {"exact_match": 1.0}
    assert (
        metrics.differ_most({"s0": {"perplexity": 1.0, "chrf": 0.5}, "s1": {"perplexity": 90.0, "chrf": 0.25}}) == 0.25
    )
