"""A slice pool's worker finds its slice and its host's index: given, or read from a Cloud TPU VM's metadata
server as JAX reads it (a server of the test's own here, answering as Google's documents it: attributes
under /computeMetadata/v1/instance/attributes/, only with the Metadata-Flavor: Google header)."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from app.core.queue import host_queue
from app.pools.models import Pool
from worker.slices import SliceError, identify

SLICE_POOL = Pool(name="tpu-v5p-16", accelerator="tpu-v5p-16", chips=8, hosts_per_slice=2, price_per_chip_hour=4.2)
ONE_HOST = Pool(name="tpu-v5p-8", accelerator="tpu-v5p-8", chips=4, price_per_chip_hour=4.2)


@pytest.fixture
def metadata():
    """A metadata server whose attributes the test sets: url, attributes."""
    attributes: dict[str, str] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            key = self.path.removeprefix("/computeMetadata/v1/instance/attributes/")
            if self.headers.get("Metadata-Flavor") != "Google" or key not in attributes:
                self.send_response(404 if key not in attributes else 403)
                self.end_headers()
                return
            body = attributes[key].encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", attributes
    server.shutdown()


def test_the_slice_and_index_are_read_from_the_tpu_vms_metadata_in_both_forms(metadata):
    url, attributes = metadata
    attributes["agent-worker-number"] = "1"
    attributes["worker-network-endpoints"] = "10.130.0.5,10.130.0.6"  # the newer form: addresses
    assert identify(SLICE_POOL, None, None, url) == ("tpu-v5p-16-10.130.0.5", 1)
    attributes["worker-network-endpoints"] = "w-0:1e2f:10.130.0.5,w-1:3a4b:10.130.0.6"  # name:id:address
    assert identify(SLICE_POOL, None, None, url) == ("tpu-v5p-16-10.130.0.5", 1)  # every host names it alike
    assert host_queue("tpu-v5p-16", "tpu-v5p-16-10.130.0.5", 1) == "tpu-v5p-16.tpu-v5p-16-10.130.0.5.1"

    attributes["worker-network-endpoints"] = "10.130.0.5,10.130.0.6,10.130.0.7,10.130.0.8"
    with pytest.raises(SliceError, match="this TPU slice has 4 hosts .* pool tpu-v5p-16 has 2 per slice"):
        identify(SLICE_POOL, None, None, url)


def test_given_places_are_checked_and_what_is_missing_is_named(metadata):
    url, _ = metadata  # a metadata server that knows nothing: not a TPU VM
    assert identify(SLICE_POOL, "s1", 0, url) == ("s1", 0)
    assert identify(ONE_HOST, None, None, url) is None
    with pytest.raises(SliceError, match=r"start its workers with --slice NAME --host-index I \(no Cloud TPU metadata"):
        identify(SLICE_POOL, None, None, url)
    with pytest.raises(SliceError, match="--host-index 2 is not a host of pool tpu-v5p-16's slices: 0 to 1"):
        identify(SLICE_POOL, "s1", 2, url)
    with pytest.raises(SliceError, match="give both --slice and --host-index"):
        identify(SLICE_POOL, "s1", None, url)
    with pytest.raises(SliceError, match="pool tpu-v5p-8 has one host per slice"):
        identify(ONE_HOST, "s1", 0, url)
