"""A merge that dies or is refused leaves nothing behind, and says what is wrong, naming the file or tensor."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.merge.checkpoints import read_tensors
from worker.merge import export_peft, merge_lora
from worker.merge.output import remove_leftovers

ROOT = Path(__file__).resolve().parents[2]


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_a_killed_merge_leaves_no_output_and_a_rerun_succeeds(lora_run, merged, tmp_path):
    out = tmp_path / "merged"
    script = textwrap.dedent(
        f"""
        import time
        from worker.merge import merge_lora

        def progress(done, total):
            if done == 0:
                time.sleep(0.3)  # slow it down, so that progress is reported mid-way
            elif done < total:
                print("MID", done, total, flush=True)
                time.sleep(120)

        merge_lora({lora_run.base_dir!r}, {lora_run.checkpoint!r}, {str(out)!r}, rank=8, alpha=16.0,
                   shard_size=100_000, progress=progress)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        line = ""
        while not line.startswith("MID") and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "the merge ended without reporting progress mid-way"
        assert line.startswith("MID"), "no progress reported mid-way"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not out.exists()
    (tmp,) = leftovers(tmp_path)  # the dead run's temporary directory, with a shard half written
    assert tmp.startswith(".merged.tmp-") and list((tmp_path / tmp).glob("model-*.safetensors"))

    result = merge_lora(lora_run.base_dir, lora_run.checkpoint, str(out), **lora_run.lora, shard_size=100_000)
    assert leftovers(tmp_path) == [] and len(result.files) > 3
    assert read_tensors(out) == read_tensors(merged)


def test_a_failing_merge_cleans_up_and_a_live_merge_is_left_alone(lora_run, tmp_path):
    def progress(done, total):
        if 0 < done:
            raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here"):
        merge_lora(lora_run.base_dir, lora_run.checkpoint, str(tmp_path / "m"), **lora_run.lora, progress=progress)
    assert list(tmp_path.iterdir()) == []

    live = tmp_path / ".m.tmp-live"  # another merge's, still running: its directory is locked
    live.mkdir()
    fd = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        (tmp_path / ".m.tmp-dead").mkdir()
        assert remove_leftovers(tmp_path / "m") == [tmp_path / ".m.tmp-dead"]
        assert leftovers(tmp_path) == [".m.tmp-live"]
    finally:
        os.close(fd)


P = "model.language_model."  # the text model's tensors in the release's layout (tiny-gemma4's)


def copy_base(src: str, dest: Path, edit=None, config=None) -> Path:
    """A copy of a base checkpoint, its tensors changed by ``edit(tensors)`` or its config by ``config``."""
    shutil.copytree(src, dest)
    if edit:
        tensors = load_file(str(dest / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    if config:  # into the text model's config (a text_config, as in the release's layout)
        path = dest / "config.json"
        whole = json.loads(path.read_text())
        text = whole.get("text_config", whole)
        text.update(config)
        path.write_text(json.dumps(whole))
    return dest


def test_bad_inputs_are_clear_errors_and_leave_nothing(lora_run, tmp_path):
    base, ckpt, lora = lora_run.base_dir, lora_run.checkpoint, lora_run.lora
    outs = tmp_path / "outs"

    def refused(exc, match: str, base_dir=base, checkpoint=ckpt, **kwargs):
        for fn, extra in ((merge_lora, {}), (export_peft, {"base_model_name_or_path": "x"})):
            with pytest.raises(exc, match=match):
                fn(str(base_dir), str(checkpoint), str(outs / "out"), **{**lora, **kwargs, **extra})
            assert not outs.exists() or list(outs.iterdir()) == [], fn.__name__

    (tmp_path / "no-ckpt").mkdir()
    refused(FileNotFoundError, "no-ckpt: no model_params", checkpoint=tmp_path / "no-ckpt")
    (tmp_path / "empty").mkdir()
    refused(FileNotFoundError, "empty: no config.json", base_dir=tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text("{}")
    refused(FileNotFoundError, r"empty: no \*.safetensors", base_dir=tmp_path / "empty")
    refused(FileNotFoundError, "missing: no such directory", base_dir=tmp_path / "missing")

    garbage = copy_base(base, tmp_path / "garbage")
    (garbage / "model.safetensors").write_bytes(b"\xff" * 64)
    refused(ValueError, "garbage/model.safetensors: not a safetensors file", base_dir=garbage)

    def narrow_gate(t):
        t[P + "layers.0.mlp.gate_proj.weight"] = t[P + "layers.0.mlp.gate_proj.weight"][:128]

    narrow = copy_base(base, tmp_path / "narrow", edit=narrow_gate)
    refused(
        ValueError,
        r"layers/0/mlp/gate_proj .* gives a \(256, 64\) delta for model.language_model.layers.0.mlp.gate_proj.weight, "
        r"which is \(128, 64\)",
        base_dir=narrow,
    )
    refused(ValueError, r"layers/.* has rank 8 .*, not 4", rank=4)
    # a base whose global layer is not K=V: the LoRA's k_einsum there has no place in it
    other = copy_base(base, tmp_path / "other", config={"attention_k_eq_v": False})
    refused(ValueError, "LoRA module layers/1/attn/k_einsum has no Hugging Face counterpart", base_dir=other)

    def int8_q(t):
        t[P + "layers.0.self_attn.q_proj.weight"] = np.zeros((128, 64), np.int8)

    quantized = copy_base(base, tmp_path / "quantized", edit=int8_q)
    with pytest.raises(
        ValueError, match=r"cannot merge LoRA into model\.language_model\.layers\.0\.self_attn\.q_proj\.weight \(I8"
    ):
        merge_lora(str(quantized), ckpt, str(outs / "out"), **lora)

    (outs / "out").mkdir(parents=True)
    with pytest.raises(FileExistsError, match="already exists"):
        merge_lora(base, ckpt, str(outs / "out"), **lora)
    assert list(outs.iterdir()) == [outs / "out"] and list((outs / "out").iterdir()) == []
