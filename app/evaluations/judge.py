"""An LLM judge: the prompts it is sent and the strict reading of its answers.

A judge is any OpenAI-compatible chat model (a Tunedeck endpoint, or a URL with a key). It grades one
answer at a time with a *rubric* (a built-in one of :data:`RUBRICS`, or the user's own text), and, for
pairwise judging, picks the better of two answers. Either way it must reply with one JSON object and
nothing else (a Markdown code fence around it is allowed): ``{"score": 1-10, "reason": "..."}`` or
``{"winner": "A" | "B" | "tie", "reason": "..."}``. Any other reply is *unparsable*: counted and shown
with the sample, never guessed at.

Pure Python, no database: the worker renders and parses, the web process checks a user's rubric.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

SCORE_MIN, SCORE_MAX = 1, 10
PLACEHOLDERS = ("{question}", "{reference}", "{answer}", "{system}")

RUBRICS: dict[str, str] = {
    "correctness": (
        "You are grading an answer against a reference answer.\n\n"
        "Conversation so far:\n{question}\n\n"
        "Reference answer:\n{reference}\n\n"
        "Answer to grade:\n{answer}\n\n"
        "How correct is the answer, judged against the reference? 10: says what the reference says; "
        "1: wrong or unrelated. Wording and length do not matter, only what it says."
    ),
    "helpfulness": (
        "You are grading an assistant's reply.\n\n"
        "Conversation so far:\n{question}\n\n"
        "Reply to grade:\n{answer}\n\n"
        "How helpful is the reply to the user's last message? 10: answers it fully, accurately and "
        "clearly; 1: does not help at all."
    ),
    "system_prompt": (
        "You are grading whether an assistant's reply follows its system prompt.\n\n"
        "System prompt:\n{system}\n\n"
        "Conversation so far:\n{question}\n\n"
        "Reply to grade:\n{answer}\n\n"
        "How well does the reply follow every instruction of the system prompt? 10: all of them; 1: none."
    ),
}
# What a pairwise judge compares, for each built-in rubric (a rubric of the user's own: its text).
_PAIRWISE_CRITERION = {
    "correctness": "Which answer is more correct, judged against the reference answer?",
    "helpfulness": "Which reply helps the user more with their last message?",
    "system_prompt": "Which reply follows the system prompt better?",
}
_SCORE_FORMAT = (
    "\n\nReply with only a JSON object, nothing before or after it: "
    f'{{"score": <an integer from {SCORE_MIN} to {SCORE_MAX}>, "reason": "<one sentence>"}}'
)
_VERDICT_FORMAT = (
    '\n\nReply with only a JSON object, nothing before or after it: {"winner": "A", "B" or "tie", '
    '"reason": "<one sentence>"}'
)
_FENCE = re.compile(r"^```(?:json)?\s*\n?(.*?)\n?```$", re.DOTALL)


def check_rubric(rubric: str | None, prompt: str | None) -> None:
    """A ValueError naming what is wrong: an unknown built-in rubric, or a prompt of one's own that
    does not show the judge the answer."""
    if prompt is not None:
        if "{answer}" not in prompt:
            raise ValueError("a judge prompt shows the judge the answer: put {answer} in it")
        return
    if rubric not in RUBRICS:
        raise ValueError(f"unknown rubric {rubric!r}: choose from {sorted(RUBRICS)}, or give a prompt of your own")


def needs_reference(rubric: str | None, prompt: str | None) -> bool:
    return "{reference}" in (prompt if prompt is not None else RUBRICS.get(rubric or "", ""))


def transcript(messages: Sequence[dict[str, Any]]) -> tuple[str, str]:
    """(the conversation but its system prompt, as "User: ..." lines; the system prompt, or "(none)")."""
    system = "\n".join(m["content"] for m in messages if m["role"] == "system") or "(none)"
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages if m["role"] != "system"]
    return "\n".join(lines), system


def _fill(template: str, values: dict[str, str]) -> str:
    # Plain replacement, not str.format: a user's prompt may hold other braces (JSON examples).
    for name, value in values.items():
        template = template.replace("{" + name + "}", value)
    return template


def grading_prompt(
    rubric: str | None, prompt: str | None, messages: Sequence[dict[str, Any]], reference: str, answer: str
) -> str:
    question, system = transcript(messages)
    template = prompt if prompt is not None else RUBRICS[rubric or ""]
    values = {"question": question, "reference": reference, "answer": answer, "system": system}
    return _fill(template, values) + _SCORE_FORMAT


def pairwise_prompt(
    rubric: str | None,
    prompt: str | None,
    messages: Sequence[dict[str, Any]],
    reference: str,
    first: str,
    second: str,
) -> str:
    """The two answers shown as A (``first``) and B (``second``)."""
    question, system = transcript(messages)
    parts = ["You are comparing two answers to the same conversation.", f"Conversation so far:\n{question}"]
    if system != "(none)":
        parts.append(f"System prompt:\n{system}")
    if needs_reference(rubric, prompt):
        parts.append(f"Reference answer:\n{reference}")
    parts += [f"Answer A:\n{first}", f"Answer B:\n{second}"]
    if prompt is not None:
        criterion = "Which answer is better by these instructions?\n" + _fill(
            prompt, {"question": question, "reference": reference, "answer": "(each of the answers)", "system": system}
        )
    else:
        criterion = _PAIRWISE_CRITERION[rubric or ""]
    parts.append(criterion + ' Say "tie" when neither is better.')
    return "\n\n".join(parts) + _VERDICT_FORMAT


def _object(reply: str, keys: set[str]) -> dict[str, Any] | None:
    text = reply.strip()
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1).strip()
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or set(value) != keys or not isinstance(value.get("reason"), str):
        return None
    return value


def parse_score(reply: str) -> tuple[int, str] | None:
    """(score, reason) from a grading reply, or None when it is not exactly the asked-for object."""
    value = _object(reply, {"score", "reason"})
    if value is None:
        return None
    score = value["score"]
    if isinstance(score, bool) or not isinstance(score, int) or not SCORE_MIN <= score <= SCORE_MAX:
        return None
    return score, value["reason"]


def parse_verdict(reply: str) -> tuple[str, str] | None:
    """("A" | "B" | "tie", reason) from a pairwise reply, or None when it is not the asked-for object."""
    value = _object(reply, {"winner", "reason"})
    if value is None or value["winner"] not in ("A", "B", "tie"):
        return None
    return value["winner"], value["reason"]


def pair_outcome(a_first: str, b_first: str) -> dict[str, Any]:
    """The judgement of a pair from the judge's two replies: with the pair's first subject shown as A
    (``a_first``), then shown as B (``b_first``). ``{"orders": [its verdict for the first subject's side
    in each order, as "A" = the first subject], "outcome": "win" | "tie" | "loss" for the first subject,
    "reasons"}``, or ``{"unparsable": [both replies]}`` when either is not the asked-for object."""
    from app.evaluations.metrics import combine_orders

    first, second = parse_verdict(a_first), parse_verdict(b_first)
    if first is None or second is None:
        return {"unparsable": [a_first[:2000], b_first[:2000]]}
    # Shown second, the first subject was the judge's "B": map its verdict back to the subjects.
    swapped = {"A": "B", "B": "A", "tie": "tie"}[second[0]]
    return {
        "orders": [first[0], swapped],
        "outcome": combine_orders(first[0], swapped),
        "reasons": [first[1], second[1]],
    }


def normalized(score: int) -> float:
    """A 1-10 grade on the [0, 1] scale of the other metrics."""
    return (score - SCORE_MIN) / (SCORE_MAX - SCORE_MIN)
