"""Memory: the pre-flight estimate (``app.runs.estimate``) against XLA's own figures, and what fits.

    PYTHONPATH=. .venv/bin/python bench/memory.py [--quick]

1. Estimate vs XLA: the engine's train step (Tunix Gemma 4 from a random HF checkpoint, Qwix LoRA
   r=16 on all projections, the optax update) compiled for one micro-batch, never run; XLA's
   ``memory_analysis()`` temp size and peak (arguments + outputs - donated + temp) beside the
   estimate's. Rows: the tiny model (the test's 9 rows), then (without ``--quick``) a 4-layer model
   with 256-wide layers and a 32,768-token vocabulary, and the tiny model with Gemma 4's 262,144-token
   vocabulary, with the default loss and the chunked loss.
2. Fit grid: gemma-4-31b on tpu-v5p-8 (4 chips, 95 GB each, 90% usable), bfloat16, LoRA r=16: which
   (rows per step, sequence length, remat, mesh) settings fit, with the default loss and the
   automatic chunked loss.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.base_models.presets import BASE_MODELS, Architecture  # noqa: E402
from app.pools.models import Pool  # noqa: E402
from app.runs import estimate  # noqa: E402
from app.runs.models import RunConfig  # noqa: E402

MID = Architecture(
    num_layers=4,
    d_model=256,
    ffn_dim=1024,
    num_heads=4,
    head_dim=64,
    num_kv_heads=2,
    global_head_dim=128,
    num_global_kv_heads=1,
    global_every=2,
    vocab_size=32768,
    sliding_window=32,
    final_logit_softcap=30.0,
)


def xla_table(quick: bool) -> None:
    from worker.training import engine, memory

    engine.configure_compilation_cache()
    tiny = BASE_MODELS["tiny-gemma4"].arch
    groups = [("tiny-gemma4 (vocab 1,280)", tiny, memory.TINY_ROWS)]
    if not quick:
        groups.append(
            (
                "4 layers x 256 wide, vocab 32,768",
                MID,
                [(b, t, r, 0) for b, t in ((4, 128), (1, 512), (1, 1024)) for r in ("none", "block", "decoder")],
            )
        )
        big_vocab = dataclasses.replace(tiny, vocab_size=262_144)
        groups.append(
            (
                "tiny-gemma4 with a 262,144-token vocabulary: default loss vs chunked (256 tokens)",
                big_vocab,
                [(2, 512, "none", 0), (2, 512, "none", 256), (1, 2048, "none", 0), (1, 2048, "none", 1024)],
            )
        )
    worst = 1.0
    for title, arch, settings in groups:
        t = time.perf_counter()
        measured = memory.measure_many(dataclasses.asdict(arch), settings, compiler_options=memory.FAST_COMPILE)
        rows = memory.compare(arch, settings, measured)
        print(f"\n## {title} ({time.perf_counter() - t:.0f} s to compile)\n")
        print(memory.format_rows(rows))
        for r in rows:
            worst = max(worst, r["temp_ratio"], 1 / r["temp_ratio"], r["peak_ratio"], 1 / r["peak_ratio"])
    print(f"\nworst ratio: {worst:.2f} (the test allows 1.25)")


def fit_grid() -> None:
    base = BASE_MODELS["gemma-4-31b"]
    pool = Pool(name="tpu-v5p-8", accelerator="tpu-v5p-8", chips=4, price_per_chip_hour=4.2)
    print("\n## gemma-4-31b on tpu-v5p-8: GiB per chip (usable 79.6 of 88.5); * = fits\n")
    meshes = ((4, 1), (2, 2), (1, 4))
    for chunked in (False, True):
        print(f"### {'chunked loss (automatic)' if chunked else 'Tunix default loss'}\n")
        head = f"{'rows':>4} {'seq':>6} {'remat':>8} " + " ".join(f"{f'fsdp={f},tp={t}':>14}" for f, t in meshes)
        print(head)
        for batch in (4, 8):
            for seq in (1024, 2048, 4096, 8192, 16384):
                for remat in ("none", "block", "decoder"):
                    cells = []
                    for fsdp, tp in meshes:
                        if batch % fsdp:
                            cells.append(f"{'-':>14}")
                            continue
                        config = RunConfig(
                            batch_size=batch,
                            max_seq_len=seq,
                            remat=remat,
                            dtype="bfloat16",
                            loss_chunk_tokens=None if chunked else 0,
                        )
                        e = estimate.estimate(base, config, pool, fsdp, tp, None)
                        cells.append(f"{e.total_gib_per_chip:>12.1f}{'*' if e.fits else ' ':>2}")
                    print(f"{batch:>4} {seq:>6} {remat:>8} " + " ".join(cells))
        print()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="only the tiny model's rows")
    parser.add_argument("--no-xla", action="store_true", help="only the fit grid (no compiling)")
    args = parser.parse_args()
    if not args.no_xla:
        xla_table(args.quick)
    fit_grid()


if __name__ == "__main__":
    main()
