"""Pools API: /api/v1/pools. Everyone reads; admins change."""

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request, status

from app.core import errors
from app.core.db import session_scope
from app.core.deps import AdminUser, CurrentUser, SessionDep
from app.core.routing import Route
from app.core.sse import watch
from app.pools import service
from app.pools.models import Pool, PoolCreate, PoolPublic, PoolsPublic, PoolUpdate

router = APIRouter(route_class=Route, prefix="/api/v1/pools", tags=["pools"])


def _get(session, name: str) -> Pool:
    return errors.found(session.get(Pool, name), "pool", name)


@router.get("", response_model=PoolsPublic)
def list_pools(
    request: Request, session: SessionDep, _: CurrentUser, watch_: Annotated[bool, Query(alias="watch")] = False
):
    """All pools with their workers; with `?watch=true`, a server-sent event stream of the list."""
    if not watch_:
        pools = service.list_pools(session)
        return PoolsPublic(data=pools, count=len(pools))

    def snapshot():
        with session_scope() as s:
            listed = PoolsPublic(data=(pools := service.list_pools(s)), count=len(pools)).model_dump(mode="json")
        fingerprint = [
            (p["name"], p["chips"], p["price_per_chip_hour"], [(w["hostname"], w["online"]) for w in p["workers"]])
            for p in listed["data"]
        ]
        return fingerprint, listed

    return watch(request, snapshot)


@router.get("/{name}", response_model=PoolPublic)
def get_pool(name: str, session: SessionDep, _: CurrentUser) -> PoolPublic:
    return errors.found(service.get_pool(session, name), "pool", name)


@router.post("", response_model=PoolPublic, status_code=status.HTTP_201_CREATED)
def create_pool(data: PoolCreate, session: SessionDep, _: AdminUser) -> PoolPublic:
    try:
        pool = service.create_pool(session, data)
    except service.PoolError as exc:
        raise errors.unprocessable(str(exc), exc.field) from exc
    return errors.found(service.get_pool(session, pool.name), "pool", pool.name)


@router.patch("/{name}", response_model=PoolPublic)
def update_pool(name: str, data: PoolUpdate, session: SessionDep, _: AdminUser) -> PoolPublic:
    try:
        service.update_pool(session, _get(session, name), data)
    except service.PoolError as exc:
        raise errors.unprocessable(str(exc), exc.field) from exc
    return errors.found(service.get_pool(session, name), "pool", name)


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT)
def delete_pool(name: str, session: SessionDep, _: AdminUser) -> None:
    try:
        service.delete_pool(session, _get(session, name))
    except service.PoolInUse as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from exc
