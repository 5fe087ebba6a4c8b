"""Arena API: /api/v1/arena (blind side-by-side battles between two endpoints, votes, standings, and
the votes exported as a preference dataset)."""

from typing import Annotated

from fastapi import APIRouter, Query, status
from sse_starlette.sse import EventSourceResponse

from app.arena import service
from app.arena.models import BattleCreate, BattlePublic, BattlesPublic, BattleVote, Leaderboard, PreferenceExport
from app.core import errors
from app.core.deps import CurrentUser, SessionDep
from app.core.routing import Route
from app.core.schemas import Offset
from app.datasets.models import DatasetPublic

router = APIRouter(route_class=Route, prefix="/api/v1/arena", tags=["arena"])


def _get(session, user, battle_id: str):
    return errors.found(service.get(session, user, battle_id), "battle", battle_id)


@router.post("/battles", response_model=BattlePublic, status_code=status.HTTP_201_CREATED)
def create_battle(data: BattleCreate, session: SessionDep, user: CurrentUser) -> BattlePublic:
    """A battle: two of your ready endpoints will answer a prompt (or an eval set's conversation), drawn
    at random onto sides a and b; which is which is shown only once you vote."""
    try:
        return service.to_public(service.create(session, user, data))
    except service.ArenaError as exc:
        raise errors.answer(exc) from exc


@router.get("/battles", response_model=BattlesPublic)
def list_battles(
    session: SessionDep,
    user: CurrentUser,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Offset = 0,
) -> BattlesPublic:
    rows = service.list_battles(session, user, limit=limit, offset=offset)
    return BattlesPublic(data=[service.to_public(b) for b in rows], count=len(rows))


@router.get("/battles/{battle_id}", response_model=BattlePublic)
def get_battle(battle_id: str, session: SessionDep, user: CurrentUser) -> BattlePublic:
    return service.to_public(_get(session, user, battle_id))


@router.post("/battles/{battle_id}/answers/{side}")
def answer(battle_id: str, side: str, session: SessionDep, user: CurrentUser) -> EventSourceResponse:
    """Side `a` or `b` answers, streamed as server-sent events: `token` ({"text"}) as it is generated,
    then `done` ({"finish_reason"}) or `error` ({"detail"}). The answer is kept with the battle (asking
    again before the vote answers again). No event names the model."""
    battle = _get(session, user, battle_id)
    try:
        service.check_side(battle, side)
    except service.ArenaError as exc:
        raise errors.answer(exc) from exc
    assert user.id is not None, "a caller is a saved user"
    return EventSourceResponse(service.answer(battle.id, user.id, side), ping=15)


@router.post("/battles/{battle_id}/vote", response_model=BattlePublic)
def vote(battle_id: str, data: BattleVote, session: SessionDep, user: CurrentUser) -> BattlePublic:
    """Vote `a`, `b`, `tie` or `both_bad`, once both sides have answered; the answer names the sides."""
    try:
        return service.to_public(service.vote(session, _get(session, user, battle_id), data.vote))
    except service.ArenaError as exc:
        raise errors.answer(exc) from exc


@router.get("/leaderboard", response_model=Leaderboard)
def leaderboard(session: SessionDep, user: CurrentUser) -> Leaderboard:
    """Each model's wins, ties and losses over your votes, its win rate, and its Elo and Bradley-Terry
    ratings (both on Elo's scale, around 1000), strongest first."""
    return service.leaderboard(session, user)


@router.post("/export", response_model=DatasetPublic, status_code=status.HTTP_201_CREATED)
def export(data: PreferenceExport, session: SessionDep, user: CurrentUser):
    """Your votes for one side as a preference dataset (`{"prompt", "chosen", "rejected"}` JSONL, TRL's
    conversational form), registered as a dataset and validated like an upload. Ties and both-bad votes
    choose no answer and are left out."""
    try:
        return service.export(session, user, data.name)
    except service.ArenaError as exc:
        raise errors.answer(exc) from exc
