"""The arena's ratings, against figures worked by hand from their definitions."""

import math

import pytest

from app.arena.service import bradley_terry, elo


def test_elo_moves_both_ratings_by_k_times_the_surprise():
    # Equal ratings expect 0.5: a win moves 32 x 0.5 = 16 each way.
    assert elo([("A", "B", "a")]) == {"A": 1016.0, "B": 984.0}
    # Then B (984) beats A (1016): B expected 1 / (1 + 10^(32/400)) = 0.4540, so B gains 32 x 0.5460.
    r = elo([("A", "B", "a"), ("B", "A", "a")])
    gain = 32 * (1 - 1 / (1 + 10 ** (32 / 400)))
    assert r["B"] == pytest.approx(984 + gain) and r["A"] == pytest.approx(1016 - gain)
    # A tie or both bad is half a win: between equals it moves nothing.
    assert elo([("A", "B", "tie"), ("A", "B", "both_bad")]) == {"A": 1000.0, "B": 1000.0}


def test_bradley_terry_is_the_win_ratio_with_one_tie_per_pair_as_its_prior():
    # A beats B 3 times in 4; the prior adds a tie: A's half-wins 3.5, B's 1.5. With two models the
    # maximum likelihood ratio of strengths is exactly that of their wins: 7/3, or 400 log10(7/3) points.
    games = [("A", "B", "a"), ("B", "A", "b"), ("A", "B", "a"), ("A", "B", "b")]
    r = bradley_terry(games)
    gap = 400 * math.log10(7 / 3)
    assert r["A"] == pytest.approx(1000 + gap / 2) and r["B"] == pytest.approx(1000 - gap / 2)
    # Unbeaten is finite: 1 win + the prior's half against the prior's half, a ratio of 3.
    r = bradley_terry([("A", "B", "a")])
    assert r["A"] - r["B"] == pytest.approx(400 * math.log10(3))


def test_bradley_terry_of_three_models_satisfies_its_likelihood_equations():
    """At the maximum, each model's (half-)wins equal its expected wins: sum over opponents of
    n_ij p_i / (p_i + p_j), the prior's tie included."""
    games = [("A", "B", "a")] * 5 + [("B", "C", "a")] * 3 + [("C", "A", "tie")] * 2 + [("A", "C", "b")]
    r = bradley_terry(games)
    p = {m: 10 ** ((v - 1000) / 400) for m, v in r.items()}
    met = {("A", "B"): 5 + 1, ("B", "C"): 3 + 1, ("A", "C"): 3 + 1}
    # (wins, halves of ties, the prior's half per opponent)
    wins = {"A": 5 + 2 * 0.5 + 2 * 0.5, "B": 3 + 2 * 0.5, "C": 1 + 2 * 0.5 + 2 * 0.5}
    for m in p:
        expected = sum(n * p[m] / (p[x] + p[y]) for (x, y), n in met.items() if m in (x, y))
        assert expected == pytest.approx(wins[m], rel=1e-9), m
    assert r["A"] > r["B"] and r["A"] > r["C"]
    assert sum(math.log10(v) for v in p.values()) == pytest.approx(0, abs=1e-9)  # the mean rating is 1000
    assert bradley_terry([]) == {}
