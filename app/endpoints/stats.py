"""An endpoint's live figures, computed in SQL from its samples: TTFT p50/p95, ITL p50, output tokens/s,
requests and errors, by source (probe, gateway, and all together). The one computation behind the API's
``stats`` object and the endpoint page's summaries and charts.

Percentiles interpolate linearly between the two nearest ranks (numpy's default, PostgreSQL's
``percentile_cont``), written with window functions so SQLite and PostgreSQL run the same query; the
rank arithmetic is integer (percent x (n - 1), divided by 100) so neither database's rounding enters.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.expression import ColumnElement, FunctionElement
from sqlmodel import Session

from app.endpoints.models import BySource, EndpointSample, EndpointSeries, EndpointStats, Figures, SeriesPoint

WINDOWS = {"last_5m": timedelta(minutes=5), "last_1h": timedelta(hours=1)}  # EndpointStats' fields
SOURCES = ("probe", "gateway")  # besides "all": BySource's fields


class _epoch(FunctionElement):
    """Seconds since 1970 of a UTC timestamp column, as an integer."""

    type = sa.BigInteger()
    inherit_cache = True


@compiles(_epoch, "sqlite")
def _epoch_sqlite(element, compiler, **kw):
    return f"CAST(strftime('%s', {compiler.process(element.clauses, **kw)}) AS INTEGER)"


@compiles(_epoch, "postgresql")
def _epoch_postgresql(element, compiler, **kw):
    return f"CAST(FLOOR(EXTRACT(EPOCH FROM {compiler.process(element.clauses, **kw)})) AS BIGINT)"


def _percentile(rows: sa.Subquery, value: str, percent: int, keys: list[str], name: str) -> sa.Subquery:
    """keys + ``name``: ``value``'s ``percent``-th percentile per group of ``keys``, linearly interpolated."""
    v = rows.c[value]
    partition = [rows.c[k] for k in keys]
    ranked = (
        sa.select(
            *partition,
            v.label("v"),
            (sa.func.row_number().over(partition_by=partition, order_by=v) - 1).label("r"),
            sa.func.count().over(partition_by=partition).label("n"),
        )
        .where(v.is_not(None))
        .subquery()
    )
    scaled = (ranked.c.n - 1) * percent  # the percentile's rank x 100
    lo = sa.func.sum(sa.case((ranked.c.r == scaled // 100, ranked.c.v)))
    hi = sa.func.sum(sa.case((ranked.c.r == scaled // 100 + 1, ranked.c.v)))
    frac = sa.func.max((scaled % 100) * 1.0 / 100)
    result = lo + (sa.func.coalesce(hi, lo) - lo) * frac
    by = [ranked.c[k] for k in keys]
    return sa.select(*by, result.label(name)).group_by(*by).subquery()


def _figures(
    session: Session, endpoint_ids: list[str], since: datetime, until: datetime, bucket_s: int | None
) -> dict[tuple[str, str, int], Figures]:
    """{(endpoint id, source or "all", bucket): Figures} over samples in [since, until); bucket 0 when
    ``bucket_s`` is None, else the bucket_s-long slice since ``since`` each sample falls in."""
    s = EndpointSample.__table__.c  # pyright: ignore[reportAttributeAccessIssue]
    bucket: ColumnElement = sa.literal(0) if bucket_s is None else (_epoch(s.at) - int(since.timestamp())) // bucket_s
    streamed = sa.and_(s.ttft_s.is_not(None), s.output_tokens > 1, s.duration_s > s.ttft_s)
    columns = [
        s.endpoint_id,
        bucket.label("bucket"),
        s.ttft_s,
        sa.case((streamed, (s.duration_s - s.ttft_s) / (s.output_tokens - 1))).label("itl_s"),
        s.output_tokens,
        sa.case((sa.or_(s.status_code >= 400, s.error.is_not(None)), 1), else_=0).label("failed"),
        s.generation_tokens_per_s,
    ]
    where = (s.endpoint_id.in_(endpoint_ids), s.at >= since, s.at < until)
    rows = sa.union_all(
        sa.select(s.source.label("source"), *columns).where(*where),
        sa.select(sa.literal("all").label("source"), *columns).where(*where),
    ).subquery()
    keys = ["endpoint_id", "source", "bucket"]
    counts = (
        sa.select(
            *[rows.c[k] for k in keys],
            sa.func.count().label("requests"),
            sa.func.sum(rows.c.failed).label("errors"),
            sa.func.sum(rows.c.output_tokens).label("output_tokens"),
            sa.func.avg(rows.c.generation_tokens_per_s).label("server_tokens_per_s"),
        )
        .group_by(*[rows.c[k] for k in keys])
        .subquery()
    )
    quantiles = {
        "ttft_p50_s": _percentile(rows, "ttft_s", 50, keys, "ttft_p50_s"),
        "ttft_p95_s": _percentile(rows, "ttft_s", 95, keys, "ttft_p95_s"),
        "itl_p50_s": _percentile(rows, "itl_s", 50, keys, "itl_p50_s"),
    }
    query = sa.select(counts, *[q.c[name] for name, q in quantiles.items()]).select_from(counts)
    for q in quantiles.values():
        query = query.outerjoin(q, sa.and_(*[q.c[k] == counts.c[k] for k in keys]))
    span = bucket_s or (until - since).total_seconds()
    out: dict[tuple[str, str, int], Figures] = {}
    for row in session.execute(query).mappings():
        figures = Figures(
            requests=row["requests"],
            errors=row["errors"] or 0,
            ttft_p50_s=row["ttft_p50_s"],
            ttft_p95_s=row["ttft_p95_s"],
            itl_p50_s=row["itl_p50_s"],
            output_tokens=row["output_tokens"] or 0,
            output_tokens_per_s=(row["output_tokens"] or 0) / span,
            server_tokens_per_s=row["server_tokens_per_s"],
        )
        out[(row["endpoint_id"], row["source"], int(row["bucket"]))] = figures
    return out


def _by_source(found: dict[tuple[str, str, int], Figures], endpoint_id: str, bucket: int) -> BySource:
    return BySource(
        **{k: found[(endpoint_id, k, bucket)] for k in ("all", *SOURCES) if (endpoint_id, k, bucket) in found}
    )


def stats(session: Session, endpoint_ids: Iterable[str], now: datetime) -> dict[str, EndpointStats]:
    """Each endpoint's figures over the last 5 minutes and the last hour (to ``now``'s whole second)."""
    ids = list(endpoint_ids)
    if not ids:
        return {}
    until = now.replace(microsecond=0)
    windows = {name: _figures(session, ids, until - span, until, None) for name, span in WINDOWS.items()}
    return {i: EndpointStats(**{name: _by_source(found, i, 0) for name, found in windows.items()}) for i in ids}


def series(session: Session, endpoint_id: str, now: datetime, minutes: int, bucket_s: int) -> EndpointSeries:
    """The figures per ``bucket_s`` over the last ``minutes``, oldest first (buckets with no sample left out)."""
    until = now.replace(microsecond=0)
    since = until - timedelta(minutes=minutes)
    found = _figures(session, [endpoint_id], since, until, bucket_s)
    buckets = sorted({b for (_, _, b) in found})
    return EndpointSeries(
        bucket_s=bucket_s,
        points=[
            SeriesPoint(at=since + timedelta(seconds=(b + 0.5) * bucket_s), figures=_by_source(found, endpoint_id, b))
            for b in buckets
        ],
    )
