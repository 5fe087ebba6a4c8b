"""Login, logout and the API-token settings page."""

from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.responses import RedirectResponse

from app.auth import service
from app.core.deps import CsrfChecked, SessionDep, WebUser
from app.core.routing import Route
from app.core.templating import render

router = APIRouter(route_class=Route, include_in_schema=False)


def _safe_next(next_: str) -> str:
    return next_ if next_.startswith("/") and not next_.startswith("//") else "/"


@router.get("/login")
def login_page(request: Request, next: str = "/"):
    return render(request, "login.html", next=_safe_next(next), error=None)


@router.post("/login", dependencies=[CsrfChecked])
def login(
    request: Request,
    session: SessionDep,
    username: Annotated[str, Form()],
    password: Annotated[str, Form()],
    next: Annotated[str, Form()] = "/",
):
    user = service.authenticate(session, username, password)
    if user is None:
        return render(
            request, "login.html", next=_safe_next(next), error="Wrong username or password.", status_code=401
        )
    request.session.clear()  # a fresh session (and CSRF token) on login
    request.session["user_id"] = user.id
    return RedirectResponse(_safe_next(next), status_code=303)


@router.post("/logout", dependencies=[CsrfChecked])
def logout(request: Request):
    request.session.clear()
    return RedirectResponse("/login", status_code=303)


@router.get("/settings/tokens")
def tokens_page(request: Request, session: SessionDep, user: WebUser):
    return render(request, "tokens.html", user, tokens=service.list_tokens(session, user), created=None)


@router.post("/settings/tokens", dependencies=[CsrfChecked])
def create_token(
    request: Request, session: SessionDep, user: WebUser, name: Annotated[str, Form(min_length=1, max_length=100)]
):
    _, secret = service.create_token(session, user, name)
    return render(
        request, "tokens.html", user, tokens=service.list_tokens(session, user), created=secret, status_code=201
    )


@router.post("/settings/tokens/{token_id}/revoke", dependencies=[CsrfChecked])
def revoke_token(token_id: int, session: SessionDep, user: WebUser):
    service.revoke_token(session, user, token_id)
    return RedirectResponse("/settings/tokens", status_code=303)
