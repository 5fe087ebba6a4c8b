"""Jinja2 templates for the dashboard pages."""

from pathlib import Path

from fastapi import Request
from fastapi.templating import Jinja2Templates

from app.core.deps import csrf_token

ROOT = Path(__file__).resolve().parents[2]
templates = Jinja2Templates(directory=ROOT / "templates")


def _filesize(n: int | None) -> str:
    if n is None:
        return "–"
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1024 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


templates.env.filters["filesize"] = _filesize


def render(request: Request, name: str, user=None, status_code: int = 200, **context):
    return templates.TemplateResponse(
        request, name, {"user": user, "csrf_token": csrf_token(request), **context}, status_code=status_code
    )
