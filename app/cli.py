"""The `tunedeck` command: up, web, worker, db upgrade, token create, user create."""

import os
import signal
import subprocess
import sys
import time
from typing import Annotated

import typer

from app.core.config import get_settings

cli = typer.Typer(
    help="Tunedeck: LoRA fine-tuning and serving of open LLMs.", no_args_is_help=True, pretty_exceptions_enable=False
)
db_cli = typer.Typer(help="Database schema.", no_args_is_help=True)
token_cli = typer.Typer(help="API tokens.", no_args_is_help=True)
user_cli = typer.Typer(help="Users.", no_args_is_help=True)
cli.add_typer(db_cli, name="db")
cli.add_typer(token_cli, name="token")
cli.add_typer(user_cli, name="user")

HostOpt = Annotated[str | None, typer.Option(help="Address to listen on [TUNEDECK_HOST]")]
PortOpt = Annotated[int | None, typer.Option(help="Port to listen on [TUNEDECK_PORT]")]


def _apply(host: str | None, port: int | None) -> None:
    if host:
        os.environ["TUNEDECK_HOST"] = host
    if port:
        os.environ["TUNEDECK_PORT"] = str(port)
    get_settings.cache_clear()


def prepare() -> dict[str, str]:
    """Migrate, seed the pools, make sure the admin exists. Returns secrets made on first start."""
    from app.auth import service as auth
    from app.core.db import session_scope, upgrade
    from app.pools import service as pools

    upgrade()
    with session_scope() as session:
        pools.seed(session)
        return auth.bootstrap(session, get_settings())


def _announce(created: dict[str, str]) -> None:
    settings = get_settings()
    typer.echo(f"Tunedeck: {settings.public_url}  (data in {settings.data_dir})")
    if "password" in created:
        typer.echo(f"First start: log in as '{settings.admin_username}' with password: {created['password']}")
    if "token" in created:
        typer.echo(f"First start: an API token for '{settings.admin_username}' (shown once): {created['token']}")


@db_cli.command("upgrade")
def db_upgrade() -> None:
    """Bring the database schema up to date."""
    from app.core.db import upgrade

    upgrade()
    typer.echo("database is up to date")


@cli.command()
def web(
    host: HostOpt = None,
    port: PortOpt = None,
    workers: Annotated[int | None, typer.Option(min=1, help="Web processes [TUNEDECK_WEB_WORKERS]")] = None,
    migrate: bool = True,
) -> None:
    """Serve the dashboard and the APIs."""
    import uvicorn

    _apply(host, port)
    if migrate:
        _announce(prepare())
    settings = get_settings()
    uvicorn.run(
        "app.main:create_app",
        factory=True,
        host=settings.host,
        port=settings.port,
        workers=workers or settings.web_workers,
        log_level="info",
        proxy_headers=True,
        timeout_graceful_shutdown=5,
    )


@cli.command()
def worker(
    pool: Annotated[str | None, typer.Option(help="The pool this host serves [TUNEDECK_POOL]")] = None,
    concurrency: Annotated[int, typer.Option(min=1, help="Tasks run at once")] = 2,
    name: Annotated[str | None, typer.Option(help="Worker name (default POOL@hostname)")] = None,
    slice_: Annotated[
        str | None,
        typer.Option("--slice", help="A slice pool's worker: its slice (a Cloud TPU VM reads it) [TUNEDECK_SLICE]"),
    ] = None,
    host_index: Annotated[
        int | None, typer.Option(min=0, help="Its host's place in the slice, 0 first [TUNEDECK_HOST_INDEX]")
    ] = None,
) -> None:
    """Run a worker for one pool: consumes the pool's queue and the shared 'general' queue (and, on a host
    of a multi-host slice, that host's own queue)."""
    from app.core.db import session_scope
    from app.core.queue import GENERAL_QUEUE, host_queue
    from app.pools.models import Pool
    from worker import slices

    settings = get_settings()
    pool = pool or settings.pool
    slice_ = slice_ if slice_ is not None else settings.slice
    host_index = host_index if host_index is not None else settings.host_index
    with session_scope() as session:
        row = session.get(Pool, pool)
        try:
            if row is None and (slice_ is not None or host_index is not None):
                raise slices.SliceError(f"unknown pool {pool!r}: an admin adds it (Pools page) first")
            place = slices.identify(row, slice_, host_index, settings.tpu_metadata_url) if row else None
        except slices.SliceError as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(2) from exc
    os.environ["TUNEDECK_POOL"] = pool
    queues = [pool, GENERAL_QUEUE]
    if place is not None:
        os.environ["TUNEDECK_SLICE"], os.environ["TUNEDECK_HOST_INDEX"] = place[0], str(place[1])
        queues.append(host_queue(pool, *place))
        typer.echo(f"pool {pool}: host {place[1]} of slice {place[0]}")
    get_settings.cache_clear()  # the worker's processes read its pool and place from the settings
    from worker.celery_app import celery

    celery.worker_main(
        [
            "worker",
            "--queues",
            ",".join(queues),
            "--hostname",
            name or f"{pool}@%h",
            "--concurrency",
            str(concurrency),
            "--loglevel",
            "INFO",
            "--without-gossip",
            "--without-mingle",
        ]
    )


@cli.command()
def up(host: HostOpt = None, port: PortOpt = None) -> None:
    """Run everything on this machine: the web app and one worker for the 'cpu' pool (restarted if it dies)."""
    _apply(host, port)
    _announce(prepare())
    me = [sys.executable, "-m", "app.cli"]
    worker_cmd = [*me, "worker", "--pool", "cpu"]
    web_proc = subprocess.Popen([*me, "web", "--no-migrate"])
    worker_proc = subprocess.Popen(worker_cmd)
    restarts: list[float] = []
    stopping = False

    def stop(signum, _frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    while not stopping and web_proc.poll() is None:
        if worker_proc.poll() is not None:  # a crashed worker is restarted; its runs are re-queued
            restarts = [t for t in restarts if time.monotonic() - t < 60] + [time.monotonic()]
            if len(restarts) > 5:
                break
            typer.echo(f"tunedeck: the worker exited ({worker_proc.returncode}); restarting it", err=True)
            worker_proc = subprocess.Popen(worker_cmd)
        time.sleep(0.2)
    children = [worker_proc, web_proc]
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 20
    for child in children:
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    failed = [c for c in children if c.returncode not in (0, -signal.SIGTERM, -signal.SIGINT)]
    if not stopping or failed:
        typer.echo("tunedeck: a process ended unexpectedly; stopped the rest", err=True)
        raise typer.Exit(1)
    typer.echo("tunedeck: stopped")


@token_cli.command("create")
def token_create(
    name: Annotated[str, typer.Option(help="What the token is for")],
    user: Annotated[str | None, typer.Option(help="Username (default: the admin)")] = None,
) -> None:
    """Create an API token and print it (once)."""
    from sqlmodel import select

    from app.auth import service as auth
    from app.auth.models import User
    from app.core.db import session_scope

    prepare()
    username = user or get_settings().admin_username
    with session_scope() as session:
        owner = session.exec(select(User).where(User.username == username)).first()
        if owner is None:
            typer.echo(f"no user named {username!r}", err=True)
            raise typer.Exit(2)
        _, secret = auth.create_token(session, owner, name)
    typer.echo(secret)


@user_cli.command("create")
def user_create(
    username: Annotated[str, typer.Option()],
    password: Annotated[str, typer.Option(prompt=True, hide_input=True, confirmation_prompt=True)],
    admin: Annotated[bool, typer.Option(help="Make the user an admin")] = False,
) -> None:
    """Create a user who can log in to the dashboard."""
    from pydantic import ValidationError

    from app.auth import service as auth
    from app.auth.models import UserCreate
    from app.core.db import session_scope

    prepare()
    try:
        data = UserCreate(username=username, password=password, is_admin=admin)
    except ValidationError as exc:
        first = exc.errors()[0]
        typer.echo(f"{first['loc'][0]}: {first['msg']}", err=True)
        raise typer.Exit(2) from exc
    with session_scope() as session:
        try:
            auth.create_user(session, data)
        except auth.UsernameTaken as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(2) from exc
    typer.echo(f"created user {username}")


def main() -> None:
    from pydantic import ValidationError

    try:
        get_settings()  # a bad setting stops every command here, with its name, before anything starts
    except ValidationError as exc:
        for error in exc.errors():
            name = "TUNEDECK_" + "_".join(str(p) for p in error["loc"]).upper()
            message = error["msg"].removeprefix("Value error, ")
            typer.echo(f"tunedeck: {message}" if message.startswith(name) else f"tunedeck: {name}: {message}", err=True)
        raise SystemExit(2) from None
    cli()


if __name__ == "__main__":
    main()
