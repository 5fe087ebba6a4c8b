"""Base models API: /api/v1/base-models. Everyone reads; admins register and delete sources."""

from fastapi import APIRouter, HTTPException, status

from app.base_models import service
from app.base_models.models import BaseModelPublic, BaseModelsPublic, RegisteredModelCreate
from app.core import errors
from app.core.deps import AdminUser, CurrentUser, SessionDep
from app.core.routing import Route

router = APIRouter(route_class=Route, prefix="/api/v1/base-models", tags=["base models"])


@router.get("", response_model=BaseModelsPublic)
def list_base_models(session: SessionDep, _: CurrentUser) -> BaseModelsPublic:
    models = service.list_models(session)
    return BaseModelsPublic(data=models, count=len(models))


@router.get("/{name}", response_model=BaseModelPublic)
def get_base_model(name: str, session: SessionDep, _: CurrentUser) -> BaseModelPublic:
    return errors.found(service.get(session, name), "base model", name)


@router.post("", response_model=BaseModelPublic, status_code=status.HTTP_201_CREATED)
def register_base_model(data: RegisteredModelCreate, session: SessionDep, user: AdminUser) -> BaseModelPublic:
    """Register an HF-layout checkpoint at a local directory or a URL (gs://...) under a preset."""
    try:
        return service.register(session, user, data)
    except service.BaseModelError as exc:
        if exc.field == "name" and "exists" in str(exc):
            raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from exc
        raise errors.unprocessable(str(exc), exc.field) from exc


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT)
def delete_base_model(name: str, session: SessionDep, _: AdminUser) -> None:
    try:
        service.delete(session, name)
    except LookupError as exc:
        raise errors.not_found("base model", name) from exc
    except service.BaseModelError as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from exc
