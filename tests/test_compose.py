"""docker-compose.yml and the Dockerfile agree with the real CLI and settings.

No Docker engine runs here, so the file is parsed and every service's command is checked by
the CLI's own argument parser, and every TUNEDECK_* variable against the settings.
"""

from pathlib import Path

import typer
import yaml

from app.cli import cli
from app.core.config import Settings

ROOT = Path(__file__).resolve().parents[1]


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _parse(args: list[str]):
    """Resolve args through the real command tree (raises on an unknown command or option)."""
    cmd = typer.main.get_command(cli)
    name, rest = "tunedeck", list(args)
    while hasattr(cmd, "commands"):  # a group
        name, rest = rest[0], rest[1:]
        cmd = cmd.commands[name]
    return cmd.make_context(name, rest)


def test_services_and_healthchecks():
    services = _compose()["services"]
    assert {"postgres", "redis", "web", "worker-cpu", "worker-tpu-v5p-8"} <= set(services)
    for name, svc in services.items():
        assert "healthcheck" in svc, f"{name} has no healthcheck"


def test_tunedeck_commands_parse_with_the_real_cli():
    services = _compose()["services"]
    tunedeck = {n: s for n, s in services.items() if "build" in s}
    assert len(tunedeck) >= 3
    for name, svc in tunedeck.items():
        ctx = _parse(svc["command"])
        assert ctx.command.name in {"web", "worker"}, name
    assert _parse(services["web"]["command"]).params["port"] == 8000


def test_workers_name_their_pool():
    services = _compose()["services"]
    for name, svc in services.items():
        if name.startswith("worker-"):
            pool = name.removeprefix("worker-")
            ctx = _parse(svc["command"])
            assert ctx.params.get("pool") in (None, pool)
            assert svc["environment"]["TUNEDECK_POOL"] == pool
            assert f"{pool}@$$HOSTNAME" in " ".join(svc["healthcheck"]["test"])


def test_workers_model_servers_are_reachable_from_the_web_service():
    """A worker's model servers bind TUNEDECK_SERVE_HOST, and the web service's gateway calls them there:
    on the compose network that is the worker service's own name (127.0.0.1, the default, is the
    worker's container itself, which the web container cannot reach)."""
    services = _compose()["services"]
    workers = {name: svc for name, svc in services.items() if name.startswith("worker-")}
    assert workers
    for name, svc in workers.items():
        assert svc.get("network_mode") is None, f"{name}: on the compose network, reachable by its name"
        serve_host = svc["environment"].get("TUNEDECK_SERVE_HOST")
        assert serve_host is not None and serve_host in (name, svc.get("hostname")), (
            f"{name}: TUNEDECK_SERVE_HOST must be the service's name on the compose network"
        )
    assert "TUNEDECK_SERVE_HOST" not in services["web"]["environment"]


def test_environment_matches_settings():
    fields = set(Settings.model_fields)
    for name, svc in _compose()["services"].items():
        for key in svc.get("environment", {}):
            if key.startswith("TUNEDECK_"):
                assert key.removeprefix("TUNEDECK_").lower() in fields, f"{name}: {key} is not a setting"
    web_env = _compose()["services"]["web"]["environment"]
    assert web_env["TUNEDECK_DATABASE_URL"].startswith("postgresql+psycopg://")
    assert web_env["TUNEDECK_BROKER_URL"].startswith("redis://redis:6379")


def test_dockerfile_runs_the_cli():
    text = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["tunedeck"]' in text
    for path in ("app", "worker", "migrations", "templates", "static"):
        assert f"COPY {path} {path}" in text
