"""The LLM judge's prompts and the strict reading of its replies (app/evaluations/judge.py)."""

import pytest

from app.evaluations import judge

MESSAGES = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "What is the capital of France?"},
]


def test_grading_prompts_show_what_their_rubric_judges_and_ask_for_one_json_object():
    prompt = judge.grading_prompt("correctness", None, MESSAGES, "Paris", "Lyon")
    assert "User: What is the capital of France?" in prompt and "Reference answer:\nParis" in prompt
    assert "Answer to grade:\nLyon" in prompt and prompt.endswith('"reason": "<one sentence>"}')
    assert "Answer in one word." not in prompt  # the system prompt is the system_prompt rubric's
    assert "System prompt:\nAnswer in one word." in judge.grading_prompt("system_prompt", None, MESSAGES, "", "x")
    assert "Paris" not in judge.grading_prompt("helpfulness", None, MESSAGES, "Paris", "x")
    # A prompt of one's own: its placeholders filled, other braces left alone, the reply format added.
    own = judge.grading_prompt(None, 'Grade {answer} vs {reference}; e.g. {"x": 1}', MESSAGES, "Paris", "Lyon")
    assert own.startswith('Grade Lyon vs Paris; e.g. {"x": 1}') and '"score"' in own


def test_pairwise_prompts_show_both_answers_in_the_order_given():
    prompt = judge.pairwise_prompt("correctness", None, MESSAGES, "Paris", "Lyon", "Paris!")
    assert prompt.index("Answer A:\nLyon") < prompt.index("Answer B:\nParis!")
    assert "Reference answer:\nParis" in prompt and '"winner"' in prompt


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ('{"score": 7, "reason": "close"}', (7, "close")),
        ('  ```json\n{"reason": "ok", "score": 10}\n```  ', (10, "ok")),
        ('```\n{"score": 1, "reason": ""}\n```', (1, "")),
        ('Score: {"score": 7, "reason": "close"}', None),  # text around it
        ('{"score": 7}', None),  # no reason
        ('{"score": 7, "reason": "x", "confidence": 0.9}', None),  # a field not asked for
        ('{"score": 11, "reason": "x"}', None),
        ('{"score": 0, "reason": "x"}', None),
        ('{"score": 7.5, "reason": "x"}', None),
        ('{"score": "7", "reason": "x"}', None),
        ('{"score": true, "reason": "x"}', None),
        ('[7, "x"]', None),
        ("", None),
    ],
)
def test_a_grade_is_read_only_when_it_is_exactly_the_asked_for_object(reply, expected):
    assert judge.parse_score(reply) == expected


def test_a_pair_judged_in_both_orders_counts_only_verdicts_that_follow_the_answer():
    def verdict(w: str) -> str:
        return f'{{"winner": "{w}", "reason": "r{w}"}}'

    # The first subject shown as A wins, then shown as B wins again: a win; the judge's "B" is mapped back.
    assert judge.pair_outcome(verdict("A"), verdict("B")) == {
        "orders": ["A", "A"],
        "outcome": "win",
        "reasons": ["rA", "rB"],
    }
    assert judge.pair_outcome(verdict("B"), verdict("A"))["outcome"] == "loss"
    assert judge.pair_outcome(verdict("A"), verdict("A"))["outcome"] == "tie"  # it followed the position
    assert judge.pair_outcome(verdict("tie"), verdict("B"))["outcome"] == "tie"
    assert judge.pair_outcome(verdict("A"), "B is better") == {"unparsable": [verdict("A"), "B is better"]}
    assert judge.parse_verdict('{"winner": "C", "reason": "x"}') is None


def test_rubrics_are_checked():
    judge.check_rubric("helpfulness", None)
    with pytest.raises(ValueError, match="unknown rubric 'kindness'"):
        judge.check_rubric("kindness", None)
    with pytest.raises(ValueError, match=r"put \{answer\} in it"):
        judge.check_rubric(None, "Is it good?")
    assert judge.normalized(1) == 0.0 and judge.normalized(10) == 1.0
