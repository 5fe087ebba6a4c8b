"""Dataset validation benchmark: throughput vs a bare orjson loop, and worker peak RSS.

    .venv/bin/python bench/datasets.py [--size-mb 512] [--out DIR] [--tmp-dir DIR] [--repeat 2]

Generates a chat JSONL file of the given size (and a half-size copy, to show that memory stays flat
as the file grows) in a temporary directory, then for each file:

  * times a bare ``for line in f: orjson.loads(line)`` loop (in a fresh subprocess),
  * times ``validate_file`` in a fresh subprocess and takes that process's peak RSS
    (``ru_maxrss``), which stands in for the Celery worker,

and prints a table. Then it uploads each file through the API of a real `tunedeck up` (uvicorn + a
Celery worker on the embedded defaults) and watches the web and worker processes' RSS while the
upload streams in and the worker validates it.

Goals: validate MB/s >= 0.5 x bare MB/s; worker peak RSS < 300 MB and flat in the file size; web
peak RSS < 200 MB during the upload. The script reports; it does not assert (exit code 0 unless
something crashes).
The generated files are deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GOAL_RATIO = 0.5
GOAL_WORKER_RSS_MB = 300
MB = 1024 * 1024

# ---------------------------------------------------------------------------------------------
# data generation

_SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise support agent for Tunedeck. Answer in at most three sentences.",
    "You are an expert Python reviewer. Point out bugs first, style second.",
    "Tu es un assistant qui répond en français, de façon claire et précise.",
    "You are a friendly tutor. Explain step by step and check the student's understanding.",
    "You answer questions about the company handbook. If unsure, say so.",
    "You write SQL for PostgreSQL 16. Return only the query and one line of explanation.",
    "You are a careful medical-information assistant; always recommend seeing a professional.",
]
_WORDS = (
    "the a an model data train token learning rate batch size adapter rank alpha dropout layer weight "
    "gradient loss eval step epoch checkpoint dataset prompt completion answer question user system "
    "assistant because however therefore example result value error fix update config server request "
    "response latency memory cache queue worker upload validate file line record field format json csv "
    "parquet row column stream chunk buffer hash duplicate histogram percentile median mean maximum "
    "minimum quickly carefully simply usually often never always please thanks sure okay well also "
    "naïve café résumé — “quoted” 😀 日本語 überall"
).split()


def _sentence(rng: random.Random, n_words: int) -> str:
    words = rng.choices(_WORDS, k=n_words)
    words[0] = words[0].capitalize()
    return " ".join(words) + rng.choice(".?!.")


def _text(rng: random.Random, lo: int, hi: int) -> str:
    target = rng.randint(lo, hi)
    parts: list[str] = []
    size = 0
    while size < target:
        s = _sentence(rng, rng.randint(5, 18))
        parts.append(s)
        size += len(s) + 1
    return " ".join(parts)


def generate_chat_jsonl(path: Path, size_bytes: int, seed: int = 7, dup_rate: float = 0.01) -> dict:
    """Realistic chat rows (system + user + assistant, a few hundred chars), ~1% exact duplicates."""
    import orjson

    rng = random.Random(seed)
    # A pool of pre-built texts keeps generation fast; the row id keeps rows distinct.
    users = [_text(rng, 30, 300) for _ in range(4000)]
    answers = [_text(rng, 80, 600) for _ in range(4000)]
    recent: list[bytes] = []
    written = rows = dups = 0
    buf: list[bytes] = []
    with open(path, "wb") as f:
        while written < size_bytes:
            if recent and rng.random() < dup_rate:
                line = rng.choice(recent)
                dups += 1
            else:
                rec = {
                    "messages": [
                        {"role": "system", "content": rng.choice(_SYSTEM_PROMPTS)},
                        {"role": "user", "content": f"[{rows}] " + rng.choice(users)},
                        {"role": "assistant", "content": rng.choice(answers)},
                    ]
                }
                line = orjson.dumps(rec) + b"\n"
                if len(recent) < 1000:
                    recent.append(line)
                else:
                    recent[rng.randrange(1000)] = line
            buf.append(line)
            written += len(line)
            rows += 1
            if len(buf) >= 4096:
                f.write(b"".join(buf))
                buf.clear()
        f.write(b"".join(buf))
    return {"rows": rows, "duplicates": dups, "bytes": written}


def head_copy(src: Path, dst: Path, size_bytes: int) -> None:
    """The first ~size_bytes of src, cut at a line boundary."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        remaining = size_bytes
        while remaining > 0:
            block = fin.read(min(remaining, 8 * MB))
            if not block:
                break
            fout.write(block)
            remaining -= len(block)
        fout.write(fin.readline())


# ---------------------------------------------------------------------------------------------
# child processes


def _child_bare(path: str) -> dict:
    import orjson

    t0 = time.perf_counter()
    n = 0
    with open(path, "rb") as f:
        for line in f:
            orjson.loads(line)
            n += 1
    return {"seconds": time.perf_counter() - t0, "lines": n}


def _child_validate(path: str) -> dict:
    import resource

    from app.datasets.validation import validate_file

    rss_before = _rss_now_mb()
    calls = []
    t0 = time.perf_counter()
    report = validate_file(path, os.path.basename(path), progress=lambda done, total: calls.append(done))
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {
        "seconds": seconds,
        "rss_after_import_mb": rss_before,
        "peak_rss_mb": peak,
        "rows": report.rows,
        "valid_rows": report.valid_rows,
        "error_count": report.error_count,
        "duplicate_count": report.duplicate_count,
        "progress_calls": len(calls),
        "tokens_total": report.stats.get("tokens_total"),
    }


def _rss_now_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB
    except OSError:  # not Linux
        return float("nan")


def run_child(mode: str, path: Path) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, f"--_child-{mode}", str(path)],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def warm_cache(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(16 * MB):
            pass


def bench_file(path: Path, repeat: int) -> dict:
    size = path.stat().st_size
    warm_cache(path)
    bare = min((run_child("bare", path) for _ in range(repeat)), key=lambda r: r["seconds"])
    runs = [run_child("validate", path) for _ in range(repeat)]
    best = min(runs, key=lambda r: r["seconds"])
    bare_mbs = size / MB / bare["seconds"]
    val_mbs = size / MB / best["seconds"]
    return {
        "file": path.name,
        "size_mb": size / MB,
        "bare_s": bare["seconds"],
        "validate_s": best["seconds"],
        "bare_mb_s": bare_mbs,
        "validate_mb_s": val_mbs,
        "ratio": val_mbs / bare_mbs,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
        "rss_after_import_mb": best["rss_after_import_mb"],
        "rows": best["rows"],
        "valid_rows": best["valid_rows"],
        "error_count": best["error_count"],
        "duplicate_count": best["duplicate_count"],
        "progress_calls": best["progress_calls"],
    }


def print_table(results: list[dict]) -> None:
    head = (
        f"{'size MB':>8} {'rows':>9} {'bare MB/s':>10} {'valid. MB/s':>11} {'ratio':>6} "
        f"{'peak RSS MB':>11} {'RSS@import':>10} {'dups':>7}  goals"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        goals = []
        goals.append("ratio ok" if r["ratio"] >= GOAL_RATIO else f"ratio < {GOAL_RATIO}")
        goals.append("rss ok" if r["peak_rss_mb"] < GOAL_WORKER_RSS_MB else f"rss >= {GOAL_WORKER_RSS_MB}")
        print(
            f"{r['size_mb']:8.0f} {r['rows']:9d} {r['bare_mb_s']:10.0f} {r['validate_mb_s']:11.0f} "
            f"{r['ratio']:6.2f} {r['peak_rss_mb']:11.1f} {r['rss_after_import_mb']:10.1f} "
            f"{r['duplicate_count']:7d}  {', '.join(goals)}"
        )
    if len(results) >= 2:
        a, b = results[0], results[-1]
        print(
            f"peak RSS growth {a['size_mb']:.0f} MB -> {b['size_mb']:.0f} MB: "
            f"{b['peak_rss_mb'] - a['peak_rss_mb']:+.1f} MB "
            f"({(b['peak_rss_mb'] - a['peak_rss_mb']) * MB / max(1, b['rows'] - a['rows']):.1f} bytes/extra row)"
        )


GOAL_WEB_RSS_MB = 200


def bench_upload(path: Path) -> dict:
    """Upload `path` through the real API of a real `tunedeck up` and watch the processes' RSS.

    The web process must stream the upload to storage (peak RSS < 200 MB, flat in the file
    size); the real Celery worker then validates it, and its RSS is watched too.
    """
    import threading
    import uuid

    import httpx
    import psutil

    root = Path(__file__).resolve().parents[1]
    data = Path(tempfile.mkdtemp(prefix="tunedeck-bench-up-", dir=path.parent))
    token = "td_bench_" + uuid.uuid4().hex
    port = 18500 + random.randrange(400)
    env = {
        **os.environ,
        "TUNEDECK_DATA_DIR": str(data),
        "TUNEDECK_PORT": str(port),
        "TUNEDECK_ADMIN_TOKEN": token,
        "TUNEDECK_ADMIN_PASSWORD": "bench-password",
    }
    env.pop("TUNEDECK_DATABASE_URL", None)
    env.pop("TUNEDECK_BROKER_URL", None)
    up = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "up"], cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    base = f"http://127.0.0.1:{port}"
    peaks = {"web": 0.0, "worker": 0.0}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                for child in psutil.Process(up.pid).children(recursive=True):
                    role = "web" if " web" in " ".join(child.cmdline()) else "worker"
                    peaks[role] = max(peaks[role], child.memory_info().rss / MB)
            except psutil.Error:
                pass
            stop.wait(0.05)

    try:
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=600) as client:
            for _ in range(300):
                try:
                    if client.get("/api/v1/pools/cpu").json()["workers_online"]:
                        break
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
                time.sleep(0.2)
            idle = dict(peaks)
            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            time.sleep(0.3)
            idle = dict(peaks)
            boundary = uuid.uuid4().hex

            def body():
                yield (
                    f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{path.name}"\r\n'
                    "Content-Type: application/octet-stream\r\n\r\n"
                ).encode()
                with open(path, "rb") as f:
                    while chunk := f.read(1 << 20):
                        yield chunk
                yield f"\r\n--{boundary}--\r\n".encode()

            t0 = time.perf_counter()
            r = client.post(
                "/api/v1/datasets",
                content=body(),
                headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
            )
            upload_s = time.perf_counter() - t0
            r.raise_for_status()
            dataset_id = r.json()["id"]
            while (d := client.get(f"/api/v1/datasets/{dataset_id}").json())["status"] == "validating":
                time.sleep(0.2)
            total_s = time.perf_counter() - t0
    finally:
        stop.set()
        up.send_signal(2)
        try:
            up.wait(timeout=30)
        except subprocess.TimeoutExpired:
            up.kill()
        shutil.rmtree(data, ignore_errors=True)
    size = path.stat().st_size
    return {
        "file": path.name,
        "size_mb": size / MB,
        "upload_mb_s": size / MB / upload_s,
        "validated_in_worker_s": total_s - upload_s,
        "status": d["status"],
        "rows": d["rows"],
        "web_idle_rss_mb": idle["web"],
        "web_peak_rss_mb": peaks["web"],
        "worker_peak_rss_mb": peaks["worker"],
    }


def print_upload_table(uploads: list[dict]) -> None:
    head = (
        f"{'size MB':>8} {'upload MB/s':>11} {'web RSS idle':>12} {'web RSS peak':>12} "
        f"{'worker RSS peak':>15} {'validated':>10}  goal"
    )
    print("Through the API of a real `tunedeck up` (uvicorn + Celery worker):")
    print(head)
    print("-" * len(head))
    for u in uploads:
        goal = "web rss ok" if u["web_peak_rss_mb"] < GOAL_WEB_RSS_MB else f"web rss >= {GOAL_WEB_RSS_MB}"
        print(
            f"{u['size_mb']:8.0f} {u['upload_mb_s']:11.0f} {u['web_idle_rss_mb']:12.1f} {u['web_peak_rss_mb']:12.1f} "
            f"{u['worker_peak_rss_mb']:15.1f} {u['validated_in_worker_s']:9.1f}s  "
            f"{goal} ({u['status']}, {u['rows']} rows)"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=float, default=512, help="size of the large file (a half-size one is added)")
    ap.add_argument("--out", type=Path, default=None, help="write results.json (datasets.json) into this directory")
    ap.add_argument("--tmp-dir", type=Path, default=None, help="where to generate the files (default: system temp)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per measurement; the fastest is reported")
    ap.add_argument("--_child-bare", dest="child_bare", help=argparse.SUPPRESS)
    ap.add_argument("--_child-validate", dest="child_validate", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child_bare:
        print(json.dumps(_child_bare(args.child_bare)))
        return 0
    if args.child_validate:
        print(json.dumps(_child_validate(args.child_validate)))
        return 0

    size = int(args.size_mb * MB)
    tmp = Path(tempfile.mkdtemp(prefix="tunedeck-bench-", dir=args.tmp_dir))
    results: list[dict] = []
    try:
        big = tmp / f"chat-{args.size_mb:g}mb.jsonl"
        half = tmp / f"chat-{args.size_mb / 2:g}mb.jsonl"
        t0 = time.perf_counter()
        info = generate_chat_jsonl(big, size)
        head_copy(big, half, size // 2)
        print(
            f"generated {info['rows']} rows ({info['bytes'] / MB:.0f} MB, {info['duplicates']} duplicates, "
            f"{info['bytes'] / max(1, info['rows']):.0f} bytes/row) in {time.perf_counter() - t0:.1f}s under {tmp}",
            flush=True,
        )
        for path in (half, big):
            results.append(bench_file(path, args.repeat))
            print(f"  measured {path.name}", flush=True)

        uploads = [bench_upload(path) for path in (half, big)]
        print()
        print_table(results)
        print()
        print_upload_table(uploads)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            out = args.out / "datasets.json"
            out.write_text(
                json.dumps(
                    {
                        "goals": {
                            "ratio": GOAL_RATIO,
                            "worker_rss_mb": GOAL_WORKER_RSS_MB,
                            "web_rss_mb": GOAL_WEB_RSS_MB,
                        },
                        "results": results,
                        "uploads": uploads,
                    },
                    indent=2,
                )
            )
            print(f"wrote {out}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
