"""Real Tunix + Qwix LoRA training of the tiny model on CPU: stopping, checkpoints and resuming exactly.
(Apart from test_engine.py so that the two test processes share the training tests.)"""

from __future__ import annotations

import math

import numpy as np

from tests.training.test_engine import ckpt_dirs
from worker.training import engine


def test_resume_continues_exactly(Recorder, make_spec, tmp_path, capitals_file):
    """Train to 10 (checkpoints at 5 and 10), then call again with max_steps 20: it resumes at 10 and
    reports 11..20, with the same losses as an uninterrupted 20-step run. (Separate validation file.)"""
    spec = make_spec(
        max_steps=10,
        checkpoint_every_steps=5,
        eval_every_steps=5,
        output_dir=str(tmp_path / "a"),
        validation_path=str(capitals_file),
        validation_filename="val.jsonl",
    )
    first = Recorder()
    r1 = engine.train(spec, first)
    assert (r1.final_step, r1.resumed_from_step) == (10, None)
    assert first.train_steps == list(range(1, 11)) and first.checkpoints == [5, 10]

    second = Recorder()
    r2 = engine.train(make_spec(**{**spec.__dict__, "max_steps": 20}), second)
    assert (r2.final_step, r2.resumed_from_step, r2.stopped_early) == (20, 10, False)
    assert second.train_steps == list(range(11, 21))  # none twice, none skipped
    assert second.checkpoints == [15, 20]
    assert sorted(first.eval_losses) == [0, 5, 10] and sorted(second.eval_losses) == [15, 20]  # no re-eval at 10
    assert any("validation file: {'records': 40" in line for line in first.logs)
    assert any("resumed from the checkpoint at step 10" in line for line in second.logs)

    straight = Recorder()
    engine.train(make_spec(**{**spec.__dict__, "max_steps": 20, "output_dir": str(tmp_path / "b")}), straight)
    a = [first.train_metrics[s]["loss"] for s in range(1, 11)] + [
        second.train_metrics[s]["loss"] for s in range(11, 21)
    ]
    b = [straight.train_metrics[s]["loss"] for s in range(1, 21)]
    np.testing.assert_allclose(a, b, rtol=1e-4)

    # called again when already done: nothing to train
    third = Recorder()
    r3 = engine.train(make_spec(**{**spec.__dict__, "max_steps": 20}), third)
    assert (r3.final_step, r3.resumed_from_step) == (20, 20) and third.train_steps == []


def test_should_stop_checkpoints_and_returns(Recorder, make_spec, tmp_path):
    """A reporter that answers True after step 3 stops the run there, with a checkpoint at 3.
    Also: gradient accumulation, block remat, padding (no packing), LoRA dropout, no validation."""
    spec = make_spec(
        max_steps=50,
        checkpoint_every_steps=100,
        grad_accum_steps=2,
        batch_size=4,
        remat="block",
        packing=False,
        validation_fraction=0.0,
        lora_dropout=0.05,
    )
    rep = Recorder(stop_after=3)
    result = engine.train(spec, rep)
    assert result.stopped_early and result.final_step == 3 and result.resumed_from_step is None
    assert rep.train_steps == [1, 2, 3]
    assert rep.checkpoints == [3] and ckpt_dirs(spec) == [3]
    assert rep.eval_losses == {} and "evaluating" not in rep.phases
    assert rep.polls == 4  # before steps 1, 2, 3 and 4
    assert all(math.isfinite(v["loss"]) for v in rep.train_metrics.values())
    assert any("stop requested" in line for line in rep.logs)

    # and it resumes from there
    rep2 = Recorder()
    result = engine.train(make_spec(**{**spec.__dict__, "max_steps": 5}), rep2)
    assert result.resumed_from_step == 3 and rep2.train_steps == [4, 5]
