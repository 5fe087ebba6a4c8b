"""The pools settings page: pools, their prices, and which worker hosts are online."""

from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.responses import RedirectResponse
from pydantic import ValidationError

from app.core.deps import CsrfChecked, SessionDep, WebUser
from app.core.routing import Route
from app.core.templating import render
from app.pools import service
from app.pools.models import ACCELERATORS, PoolCreate

router = APIRouter(route_class=Route, include_in_schema=False)


def _page(request, session, user, error=None, status_code=200):
    return render(
        request,
        "pools.html",
        user,
        pools=service.list_pools(session),
        accelerators=ACCELERATORS,
        error=error,
        status_code=status_code,
    )


@router.get("/pools")
def pools_page(request: Request, session: SessionDep, user: WebUser):
    return _page(request, session, user)


@router.post("/pools", dependencies=[CsrfChecked])
def create_pool(
    request: Request,
    session: SessionDep,
    user: WebUser,
    name: Annotated[str, Form()],
    accelerator: Annotated[str, Form()],
    chips: Annotated[str, Form()],
    price_per_chip_hour: Annotated[str, Form()],
    description: Annotated[str, Form()] = "",
    hosts_per_slice: Annotated[str, Form()] = "1",
    shared_dir: Annotated[str, Form()] = "",
):
    if not user.is_admin:
        return _page(request, session, user, error="Only admins can change pools.", status_code=403)
    try:
        data = PoolCreate.model_validate(
            {
                "name": name,
                "accelerator": accelerator,
                "chips": chips,
                "hosts_per_slice": hosts_per_slice,
                "price_per_chip_hour": price_per_chip_hour,
                "description": description,
                "shared_dir": shared_dir.strip() or None,
            }
        )
        service.create_pool(session, data)
    except ValidationError as exc:
        first = exc.errors()[0]
        return _page(request, session, user, error=f"{first['loc'][-1]}: {first['msg']}", status_code=422)
    except service.PoolError as exc:
        return _page(request, session, user, error=f"{exc.field}: {exc}", status_code=422)
    return RedirectResponse("/pools", status_code=303)
