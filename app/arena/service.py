"""Arena battles: created with their sides drawn at random, answered side by side (each answer streamed
from its endpoint's model server and kept), voted on once; the votes' standings (win rates, Elo,
Bradley-Terry) and their export as a preference dataset. The only place a battle changes."""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import AsyncIterator

import httpx
import orjson
from sqlmodel import Session, col, select
from starlette.concurrency import run_in_threadpool

from app.arena.models import SIDES, Battle, BattleCreate, BattlePublic, Leaderboard, Standing
from app.auth.models import User
from app.core.db import locked, owned, owned_page, session_scope, utcnow
from app.core.echo import echo
from app.core.errors import FieldError
from app.core.security import new_id
from app.datasets import service as datasets
from app.datasets.models import Dataset, DatasetStatus
from app.datasets.validation import iter_conversations
from app.endpoints import service as endpoints
from app.endpoints.models import Endpoint, EndpointStatus

ELO_K = 32.0
ELO_START = 1000.0
BT_ITERATIONS = 10_000


class ArenaError(FieldError):
    pass


def to_public(battle: Battle) -> BattlePublic:
    """The battle as the page shows it: who answered on each side only once it is voted on."""
    return BattlePublic(
        **battle.model_dump(exclude={"owner_id", "sides"}), sides=battle.sides if battle.vote is not None else None
    )


def create(session: Session, owner: User, data: BattleCreate) -> Battle:
    sides = []
    for endpoint_id in data.endpoint_ids:
        endpoint = endpoints.get(session, owner, endpoint_id)
        if endpoint is None:
            raise ArenaError("endpoint_ids", f"endpoint {echo(endpoint_id)} not found", missing=True)
        if endpoint.status != EndpointStatus.ready:
            raise ArenaError("endpoint_ids", f"endpoint {endpoint.id} is {endpoint.status}; only a ready one answers")
        sides.append({"endpoint_id": endpoint.id, "model": endpoint.model})
    random.shuffle(sides)  # which is a and which is b: the user sees neither name before voting
    if data.dataset_id is not None:
        assert data.position is not None, "BattleCreate asks for a position with an eval set"
        messages = _eval_prompt(session, owner, data.dataset_id, data.position)
    else:
        assert data.prompt is not None, "BattleCreate asks for a prompt or an eval set"
        messages = [{"role": "system", "content": data.system}] if data.system else []
        messages.append({"role": "user", "content": data.prompt})
    assert owner.id is not None, "the owner is a saved user"
    battle = Battle(
        id=new_id("bt"),
        owner_id=owner.id,
        messages=messages,
        dataset_id=data.dataset_id,
        position=data.position,
        sides=sides,
        max_tokens=data.max_tokens,
    )
    session.add(battle)
    session.commit()
    return battle


def _eval_prompt(session: Session, owner: User, dataset_id: str, position: int) -> list[dict]:
    """The messages before the last assistant reply of the eval set's conversation at ``position``
    (counting, as an evaluation does, the conversations that have one after a user turn)."""
    dataset = session.get(Dataset, dataset_id)
    if dataset is None or dataset.owner_id != owner.id:
        raise ArenaError("dataset_id", f"dataset {echo(dataset_id)} not found", missing=True)
    if dataset.status != DatasetStatus.ready:
        raise ArenaError("dataset_id", f"dataset {dataset.id} is {dataset.status}; only a valid one is an eval set")
    path = datasets.file_path(dataset)
    seen = 0
    for messages in iter_conversations(path, dataset.filename, file_type=dataset.file_type, fmt=dataset.format):
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if last is None or not any(m["role"] == "user" for m in messages[:last]):
            continue
        if seen == position:
            return messages[:last]
        seen += 1
    raise ArenaError("position", f"dataset {dataset.id} has {seen} conversations with a reply: 0 to {seen - 1}")


def list_battles(session: Session, owner: User, *, limit: int, offset: int) -> list[Battle]:
    return owned_page(session, Battle, owner, limit=limit, offset=offset)


def get(session: Session, owner: User, battle_id: str) -> Battle | None:
    return owned(session, Battle, owner, battle_id)


def check_side(battle: Battle, side: str) -> None:
    if side not in SIDES:
        raise ArenaError("side", f"a battle's sides are a and b, not {echo(side)}", missing=True)
    if battle.vote is not None:
        raise ArenaError("vote", f"battle {battle.id} is already voted on", conflict=True)


async def answer(battle_id: str, owner_id: int, side: str) -> AsyncIterator[dict]:
    """Stream one side's answer, as server-sent events: ``token`` ({"text"}) as the model server
    generates, then ``done`` ({"finish_reason"}) or ``error`` ({"detail"}). The whole answer is kept
    with the battle once it ends; one cut short is not."""

    def load() -> tuple[Endpoint | None, Battle]:
        with session_scope() as session:
            battle = session.get_one(Battle, battle_id)
            endpoint = session.get(Endpoint, battle.sides[SIDES.index(side)]["endpoint_id"])
            session.expunge_all()
            return endpoint, battle

    endpoint, battle = await run_in_threadpool(load)
    if endpoint is None or endpoint.status != EndpointStatus.ready or endpoint.owner_id != owner_id:
        yield {"event": "error", "data": orjson.dumps({"detail": f"side {side}'s endpoint is not ready"}).decode()}
        return
    assert endpoint.url is not None, "a ready endpoint has its url"
    body = {"model": endpoint.model, "messages": battle.messages, "max_tokens": battle.max_tokens, "stream": True}
    headers = {"authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
    text, finish = [], None
    try:
        async with (
            httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10)) as client,
            client.stream("POST", endpoint.url + "/v1/chat/completions", json=body, headers=headers) as r,
        ):
            if r.status_code != 200:
                detail = (await r.aread()).decode(errors="replace")[:500]
                yield {"event": "error", "data": orjson.dumps({"detail": f"HTTP {r.status_code}: {detail}"}).decode()}
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = orjson.loads(line[6:])
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        text.append(piece)
                        yield {"event": "token", "data": orjson.dumps({"text": piece}).decode()}
                    finish = choice.get("finish_reason") or finish
    except httpx.HTTPError as exc:
        yield {"event": "error", "data": orjson.dumps({"detail": f"the model server: {exc!r}"}).decode()}
        return
    await run_in_threadpool(_keep, battle_id, side, "".join(text))
    yield {"event": "done", "data": orjson.dumps({"finish_reason": finish}).decode()}


def _keep(battle_id: str, side: str, text: str) -> None:
    with session_scope() as session:
        battle = locked(session, Battle, battle_id)  # the other side's answer may be kept at the same moment
        if battle.vote is None:
            battle.outputs = {**battle.outputs, side: text}
            session.add(battle)
            session.commit()


def vote(session: Session, battle: Battle, choice: str) -> Battle:
    if battle.vote is not None:
        raise ArenaError("vote", f"battle {battle.id} is already voted on ({battle.vote})", conflict=True)
    unanswered = [s for s in SIDES if s not in battle.outputs]
    if unanswered:
        raise ArenaError("vote", f"side {unanswered[0]} has not answered yet", conflict=True)
    battle.vote, battle.voted_at = choice, utcnow()
    session.add(battle)
    session.commit()
    return battle


def _voted(session: Session, owner: User) -> list[Battle]:
    query = select(Battle).where(Battle.owner_id == owner.id, col(Battle.vote).is_not(None))
    return list(session.exec(query.order_by(col(Battle.voted_at), col(Battle.id))).all())


def leaderboard(session: Session, owner: User) -> Leaderboard:
    """Every model's record over the user's votes, with its Elo and Bradley-Terry ratings."""
    games: list[tuple[str, str, str]] = [
        (b.sides[0]["model"], b.sides[1]["model"], b.vote)
        for b in _voted(session, owner)
        if b.vote is not None and b.sides[0]["model"] != b.sides[1]["model"]  # one model twice says nothing
    ]
    record: dict[str, dict[str, int]] = defaultdict(lambda: {"wins": 0, "ties": 0, "losses": 0, "both_bad": 0})
    for a, b, v in games:
        for me, other_won, won in ((a, v == "b", v == "a"), (b, v == "a", v == "b")):
            key = "wins" if won else "losses" if other_won else "both_bad" if v == "both_bad" else "ties"
            record[me][key] += 1
    elo_ratings, bt_ratings = elo(games), bradley_terry(games)
    rows = []
    for model, r in record.items():
        n = sum(r.values())
        rows.append(
            Standing(model=model, battles=n, **r, win_rate=r["wins"] / n, elo=elo_ratings[model], bt=bt_ratings[model])
        )
    rows.sort(key=lambda s: -s.bt)
    return Leaderboard(data=rows, votes=len(games))


def _score(vote: str) -> float:
    """Side a's score: a win 1, a loss 0, a tie or both bad a half."""
    return {"a": 1.0, "b": 0.0}.get(vote, 0.5)


def elo(games: list[tuple[str, str, str]]) -> dict[str, float]:
    """Online Elo over the games in order: each moves both ratings by K x (score - expected)."""
    rating: dict[str, float] = defaultdict(lambda: ELO_START)
    for a, b, v in games:
        expected = 1 / (1 + 10 ** ((rating[b] - rating[a]) / 400))
        delta = ELO_K * (_score(v) - expected)
        rating[a] += delta
        rating[b] -= delta
    return dict(rating)


def bradley_terry(games: list[tuple[str, str, str]]) -> dict[str, float]:
    """The Bradley-Terry strengths that make the votes most likely (Hunter's MM iterations), a tie or
    both bad counted as half a win each, with one more tie per pair that met as a prior (so a model that
    never lost has a finite rating). On Elo's scale: 400 log10(strength), the mean rating at 1000."""
    if not games:
        return {}
    wins: dict[str, float] = defaultdict(float)
    met: dict[tuple[str, str], float] = defaultdict(float)
    for a, b, v in games:
        wins[a] += _score(v)
        wins[b] += 1 - _score(v)
        x, y = sorted((a, b))
        met[x, y] += 1
    for pair in met:
        met[pair] += 1
        for m in pair:
            wins[m] += 0.5
    models = sorted(wins)
    strength = dict.fromkeys(models, 1.0)
    for _ in range(BT_ITERATIONS):
        new = {}
        for m in models:
            denominator = 0.0
            for (x, y), n in met.items():
                if m in (x, y):
                    denominator += n / (strength[x] + strength[y])
            new[m] = wins[m] / denominator
        mean_log = sum(math.log(s) for s in new.values()) / len(new)
        new = {m: s / math.exp(mean_log) for m, s in new.items()}
        done = max(abs(new[m] - strength[m]) for m in models) < 1e-12
        strength = new
        if done:
            break
    return {m: ELO_START + 400 * math.log10(s) for m, s in strength.items()}


def export(session: Session, owner: User, name: str) -> Dataset:
    """The votes for one side as a preference dataset (TRL's conversational form: the prompt's messages,
    the chosen and the rejected answer each one assistant message), stored and validated as an upload.
    A battle where either answer is blank is left out: it makes no pair to learn from."""
    lines = []
    for b in _voted(session, owner):
        if b.vote not in SIDES or any(not b.outputs[s].strip() for s in SIDES):
            continue  # no answer chosen, or a blank one (no preference pair to learn from)
        won = b.vote
        lost = "b" if won == "a" else "a"
        row = {
            "prompt": b.messages,
            "chosen": [{"role": "assistant", "content": b.outputs[won]}],
            "rejected": [{"role": "assistant", "content": b.outputs[lost]}],
        }
        lines.append(orjson.dumps(row))
    if not lines:
        raise ArenaError(
            "vote", "no battle has a winner with two answers yet (a tie or both bad chooses neither)", conflict=True
        )
    filename = name if name.endswith(".jsonl") else name + ".jsonl"
    return datasets.create_from_bytes(session, owner, filename, b"\n".join(lines) + b"\n", fmt="preference")
