"""Every request body of the API (both trees) is read into a `Schema`, whose numbers must be finite."""

import typing

from fastapi.routing import APIRoute
from pydantic import BaseModel

from app.core.schemas import Schema
from app.main import ROUTERS


def _models(annotation, seen: set) -> set:
    """The pydantic models an annotation names, and those their fields name, all the way down."""
    found = set()
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if annotation in seen:
            return found
        seen.add(annotation)
        found.add(annotation)
        for field in annotation.model_fields.values():
            found |= _models(field.annotation, seen)
    for arg in typing.get_args(annotation):
        found |= _models(arg, seen)
    return found


def test_every_request_body_is_a_schema():
    bodies = {
        f"{sorted(route.methods)[0]} {route.path}": route.body_field.field_info.annotation
        for module in ROUTERS
        for route in module.router.routes
        if isinstance(route, APIRoute) and route.include_in_schema and route.body_field is not None
    }
    assert {"POST /api/v1/runs", "POST /v1/fine_tuning/jobs", "PATCH /api/v1/pools/{name}"} <= set(bodies)
    loose = {
        f"{label}: {model.__name__}"
        for label, annotation in bodies.items()
        for model in _models(annotation, set())
        if not issubclass(model, Schema)
    }
    assert not loose, f"request schemas that do not derive from app.core.schemas.Schema: {sorted(loose)}"
    assert Schema.model_config["allow_inf_nan"] is False
