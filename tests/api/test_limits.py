"""Request bodies are capped before anything reads them, authentication included: a huge body sent
without a token is refused with 413 after at most the cap was read, and the web process's memory
does not grow with what was sent."""

import select
import socket
from urllib.parse import urlparse

import psutil

HUGE = 256 * 1024**2
MB = 1024**2


def web_process(server) -> psutil.Process:
    (web,) = [p for p in psutil.Process(server.proc.pid).children() if "web" in p.cmdline()]
    return web


def peak_rss(proc: psutil.Process) -> int:
    """The process's high-water mark of resident memory (VmHWM), in bytes."""
    with open(f"/proc/{proc.pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def connect(server) -> socket.socket:
    url = urlparse(server.base_url)
    return socket.create_connection((url.hostname, url.port), timeout=30)


def reply_of(sock: socket.socket) -> bytes:
    """What the server answered, up to its closing the connection (or resetting it: the unread rest
    of the body is still in its buffers)."""
    data = b""
    while b"accepts" not in data:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data


def test_a_huge_body_without_a_token_is_refused_before_it_is_read(server):
    web = web_process(server)
    before = peak_rss(web)
    head = "POST {path} HTTP/1.1\r\nHost: tunedeck\r\nContent-Type: application/json\r\n{length}\r\n"

    for path in ("/api/v1/runs", "/v1/fine_tuning/jobs", "/login"):  # a length announced: refused unread
        with connect(server) as sock:
            sock.sendall(head.format(path=path, length=f"Content-Length: {HUGE}\r\n").encode())
            reply = reply_of(sock)
            assert reply.startswith(b"HTTP/1.1 413") and b"larger than this route accepts" in reply, path

    with connect(server) as sock:  # no length (chunked): read up to the cap, then refused
        sock.sendall(head.format(path="/api/v1/runs", length="Transfer-Encoding: chunked\r\n").encode())
        chunk = b"%x\r\n%s\r\n" % (MB, b"[" * MB)
        sent, reply = 0, b""
        while sent < HUGE:
            readable, writable, _ = select.select([sock], [sock], [], 30)
            if readable:
                reply = reply_of(sock)
                break
            sock.sendall(chunk)
            sent += MB
        assert reply.startswith(b"HTTP/1.1 413") and b"larger than this route accepts" in reply
        assert sent < 64 * MB, "the server stopped reading soon after the cap"

    assert peak_rss(web) - before < 20 * MB
    assert server.anonymous().get("/healthz").status_code == 200


def test_bodies_under_the_caps_pass(server, api):
    r = api.post("/api/v1/runs", json={"base_model": "x" * (512 * 1024)})
    assert r.status_code == 422, r.text  # read and validated, not refused for its size
    long_prompt = [{"role": "user", "content": "x" * 2 * MB}]
    r = api.post("/v1/chat/completions", json={"model": "nope", "messages": long_prompt})
    assert r.status_code == 404 and "not deployed" in r.json()["error"]["message"]
