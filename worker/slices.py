"""Which slice of a multi-host pool this worker's host belongs to, and its place in it.

A pool with ``hosts_per_slice`` > 1 (a TPU v5p-16 slice: 2 hosts) runs each job on every host of one
slice, so each worker must know its slice and its index there (0 is the coordinator). They are given as
``tunedeck worker --slice NAME --host-index I``, or read on a Cloud TPU VM from its metadata server, as
JAX's own cluster detection reads them (``jax._src.clusters.cloud_tpu_cluster``): the host's index is
``agent-worker-number``, and the slice's hosts are ``worker-network-endpoints`` (a comma-separated list of
addresses, or in its older form of ``name:id:address`` triples). The slice is named for its pool and its
first host's address, which every host of it reads alike.
"""

from __future__ import annotations

import httpx

from app.pools.models import Pool

METADATA_PATH = "/computeMetadata/v1/instance/attributes/"
METADATA_TIMEOUT_S = 2.0


class SliceError(ValueError):
    pass


def identify(pool: Pool, slice_: str | None, host_index: int | None, metadata_url: str) -> tuple[str, int] | None:
    """(slice, host index) of this host in ``pool``; None for a pool of single hosts. SliceError says
    what is missing or wrong."""
    if pool.hosts_per_slice == 1:
        if slice_ is not None or host_index is not None:
            raise SliceError(f"pool {pool.name} has one host per slice: --slice and --host-index are for slice pools")
        return None
    if (slice_ is None) != (host_index is None):
        raise SliceError("give both --slice and --host-index, or neither (on a Cloud TPU VM: read from its metadata)")
    if slice_ is None or host_index is None:
        slice_, host_index = from_metadata(pool, metadata_url)
    if not 0 <= host_index < pool.hosts_per_slice:
        raise SliceError(
            f"--host-index {host_index} is not a host of pool {pool.name}'s slices: "
            f"0 to {pool.hosts_per_slice - 1} ({pool.hosts_per_slice} hosts per slice)"
        )
    return slice_, host_index


def from_metadata(pool: Pool, metadata_url: str) -> tuple[str, int]:
    """(slice, host index) from a Cloud TPU VM's metadata server."""
    try:
        index = int(_attribute(metadata_url, "agent-worker-number"))
        endpoints = _attribute(metadata_url, "worker-network-endpoints")
    except (httpx.HTTPError, ValueError) as exc:
        raise SliceError(
            f"pool {pool.name} is made of slices of {pool.hosts_per_slice} hosts: start its workers with "
            f"--slice NAME --host-index I (no Cloud TPU metadata at {metadata_url}: {exc})"
        ) from exc
    hosts = [_address(entry) for entry in endpoints.split(",") if entry.strip()]
    if len(hosts) != pool.hosts_per_slice:
        raise SliceError(
            f"this TPU slice has {len(hosts)} hosts ({', '.join(hosts)}); pool {pool.name} has "
            f"{pool.hosts_per_slice} per slice"
        )
    return f"{pool.name}-{hosts[0]}", index


def _attribute(metadata_url: str, key: str) -> str:
    response = httpx.get(
        f"{metadata_url.rstrip('/')}{METADATA_PATH}{key}",
        headers={"Metadata-Flavor": "Google"},
        timeout=METADATA_TIMEOUT_S,
    )
    if response.status_code != 200:
        raise ValueError(f"{key}: HTTP {response.status_code}")
    return response.text.strip()


def _address(entry: str) -> str:
    parts = entry.strip().split(":")
    if len(parts) == 1:
        return parts[0]
    if len(parts) == 3:
        return parts[2]
    raise SliceError(f"worker-network-endpoints: {entry!r} is neither an address nor name:id:address")
