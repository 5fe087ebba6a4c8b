"""The arena: two subjects (ready endpoints) answer one prompt side by side, their names hidden until
the user votes; votes make a win-rate table, Elo and Bradley-Terry ratings, and a preference dataset."""

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import model_validator
from sqlalchemy import JSON, Column, Index
from sqlmodel import AutoString, Field, SQLModel

from app.core.db import utcnow
from app.core.schemas import ID_LENGTH, INT32_MAX, NAME_LENGTH, Schema

SIDES = ("a", "b")
Vote = Literal["a", "b", "tie", "both_bad"]


class Battle(SQLModel, table=True):
    __tablename__ = "arena_battles"  # pyright: ignore[reportAssignmentType]
    __table_args__ = (Index("ix_arena_battles_owner_created", "owner_id", "created_at", "id"),)
    id: str = Field(primary_key=True, max_length=32)
    owner_id: int = Field(foreign_key="users.id", ondelete="CASCADE")
    # The prompt: the messages before the answer (from the user, or an eval set's conversation).
    messages: list[dict[str, Any]] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    dataset_id: str | None = Field(default=None, foreign_key="datasets.id", ondelete="SET NULL", max_length=32)
    position: int | None = None  # the conversation's place in the eval set
    # Side a and side b, in the order shown (drawn at random): {"endpoint_id", "model"} each.
    sides: list[dict[str, Any]] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    outputs: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))  # side -> text
    max_tokens: int
    vote: str | None = Field(default=None, sa_type=AutoString(16))
    created_at: datetime = Field(default_factory=utcnow)
    voted_at: datetime | None = None


class BattleCreate(Schema):
    """Two of your ready endpoints answer ``prompt`` (or the conversation at ``position`` of eval set
    ``dataset_id``: its messages before the last assistant reply)."""

    endpoint_ids: list[Annotated[str, Field(max_length=ID_LENGTH)]] = Field(min_length=2, max_length=2)
    prompt: str | None = Field(default=None, min_length=1, max_length=100_000)
    system: str | None = Field(default=None, max_length=100_000)
    dataset_id: str | None = Field(default=None, max_length=ID_LENGTH)
    position: int | None = Field(default=None, ge=0, le=INT32_MAX)
    max_tokens: int = Field(default=256, ge=1, le=8192)

    @model_validator(mode="after")
    def _one_prompt(self):
        if len(set(self.endpoint_ids)) != 2:
            raise ValueError("endpoint_ids: two different endpoints answer")
        if (self.prompt is None) == (self.dataset_id is None):
            raise ValueError("give either a prompt or an eval set (dataset_id, with position)")
        if self.dataset_id is not None and self.position is None:
            raise ValueError("position: which conversation of the eval set (0 is the first)")
        if self.dataset_id is not None and self.system is not None:
            raise ValueError("system: an eval set's conversation brings its own")
        return self


class BattleVote(Schema):
    vote: Vote


class BattlePublic(SQLModel):
    id: str
    messages: list[dict[str, Any]]
    dataset_id: str | None
    position: int | None
    outputs: dict[str, Any]
    max_tokens: int
    vote: str | None
    # Who answered on each side: hidden (null) until the vote
    sides: list[dict[str, Any]] | None
    created_at: datetime
    voted_at: datetime | None


class BattlesPublic(SQLModel):
    data: list[BattlePublic]
    count: int


class Standing(SQLModel):
    model: str
    battles: int
    wins: int
    ties: int
    losses: int
    both_bad: int
    win_rate: float  # wins / battles (a tie or both bad counts as neither)
    elo: float  # online Elo over the votes in order (K = 32, from 1000)
    bt: float  # Bradley-Terry maximum likelihood, on Elo's scale (400 log10), the mean at 1000


class Leaderboard(SQLModel):
    data: list[Standing]
    votes: int


class PreferenceExport(Schema):
    name: str = Field(default="arena-preferences.jsonl", min_length=1, max_length=NAME_LENGTH)
