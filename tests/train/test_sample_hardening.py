"""`videodit sample` hardening (#35 items 4 and 9): latents that turn NaN or infinite stop the sampler
in one line and no clip is written from them (they made all-black clips with exit 0); numbers it
cannot use (--cfg 1e308, 10^8 steps, 10^5 frames) are refused before the model loads; a long
--prompts file writes each clip as it is made and resumes where a stopped run left off."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from conftest import tiny_overrides
from videodit.cli import main
from videodit.data.video import read_video


@pytest.fixture(scope="module")
def run(toy_dir, tmp_path_factory):
    """A tiny trained run (2 steps, one checkpoint)."""
    folder = tmp_path_factory.mktemp("sample") / "run"
    assert main(["train", "--out", str(folder), *tiny_overrides(toy_dir, **{"train.max_steps": 2,
                                                                         "checkpoint.every_steps": 2})]) == 0
    return folder


@pytest.fixture(scope="module")
def nan_run(run, tmp_path_factory):
    """``run`` with NaN in its final layer (weights and EMA), the manifest's digests updated: a
    diverged run, or a bad import, as the sampler meets it."""
    import shutil

    folder = tmp_path_factory.mktemp("nan") / "run"
    shutil.copytree(run, folder)
    ckpt = next((folder / "checkpoints").glob("step-*"))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for name in ("model.safetensors", "ema.safetensors"):
        tensors = load_file(str(ckpt / name))
        tensors = {k: v * float("nan") if k.startswith("final_layer") else v for k, v in tensors.items()}
        save_file(tensors, str(ckpt / name))
        data = (ckpt / name).read_bytes()
        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return folder


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error")]
    assert len(errors) == 1 and "Traceback" not in "\n".join(err), err
    return errors[0]


# ------------------------------------------------------------------ non-finite latents


@pytest.mark.parametrize("out", ["clip.mp4", "folder"])
def test_nan_latents_stop_the_sampler_and_write_no_clip(nan_run, tmp_path, capsys, out):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle moving right\na blue square moving up\n")
    given = ["--prompt", "a red circle moving right"] if out.endswith(".mp4") else ["--prompts", str(prompts)]
    assert main(["sample", "--ckpt", str(nan_run), *given, "--steps", "2", "--out", str(tmp_path / out)]) == 2
    line = one_error_line(capsys)
    assert "NaN or infinite values in the model's output at step 1 of 2" in line and "no clip was written" in line
    assert "earlier checkpoint" in line
    assert not list(tmp_path.rglob("*.mp4"))


def test_guidance_that_overflows_stops_at_its_step(run, monkeypatch):
    """A scale past the bounds (an API caller's, or a config's) that overflows the latents is
    caught where it happens, and the message blames the scale."""
    from videodit import sample
    from videodit.sample import NonFiniteLatents, Pipeline

    monkeypatch.setattr(sample, "MAX_GUIDANCE", float("inf"))   # past the refusal, into the sampler
    with pytest.raises(NonFiniteLatents, match=r"at step [23] of 3.*guidance scale 1e\+308 is far too large"):
        Pipeline(run, device="cpu")(["a red circle moving right"], steps=3, guidance=1e308)


# ------------------------------------------------------------------ numbers refused up front


@pytest.mark.parametrize("flag, value", [
    ("--cfg", "1e308"), ("--cfg", "101"), ("--cfg", "inf"), ("--image-cfg", "1e308"), ("--steps", "100000000"),
    ("--num-frames", "100000"), ("--height", "100000"), ("--width", "100000"), ("--ref-frames", "100000"),
    ("--seed", str(2**64)), ("--seed", str(-(2**63) - 1)),
])
def test_sample_numbers_out_of_range_are_refused_before_the_model_loads(run, monkeypatch, capsys, flag, value):
    def never(*args, **kwargs):
        raise AssertionError("the checkpoint was loaded")

    monkeypatch.setattr("videodit.sample.Pipeline.__init__", never)
    with pytest.raises(SystemExit) as refused:
        main(["sample", "--ckpt", str(run), "--prompt", "x", flag, value])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and ("out of range" in err or "not a" in err) and "Traceback" not in err


def test_the_pipeline_checks_the_same_bounds(run):
    from videodit.errors import UserError
    from videodit.sample import Pipeline

    pipeline = Pipeline(run, device="cpu")
    for options in ({"guidance": 1e308}, {"steps": 10**8}, {"num_frames": 10**5}, {"image_guidance": float("nan")}):
        with pytest.raises(UserError, match="cannot sample with"):
            pipeline(["x"], **options)


# ------------------------------------------------------------------ many prompts


def test_a_long_prompts_file_writes_each_clip_as_it_is_made(run, tmp_path):
    """20,000 prompts: clips appear while the rest are sampled (nothing was written for minutes)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"prompt {k} a red circle moving right\n" for k in range(20_000)))
    out = tmp_path / "clips"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "videodit", "sample", "--ckpt", str(run), "--prompts", str(prompts),
                             "--steps", "1", "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    deadline, written = time.monotonic() + 150, []
    try:
        while time.monotonic() < deadline and len(written) < 20 and proc.poll() is None:
            time.sleep(0.5)
            written = sorted(out.glob("[!.]*.mp4")) if out.is_dir() else []
    finally:
        proc.send_signal(signal.SIGTERM)
        stdout, _ = proc.communicate(timeout=60)
    assert len(written) >= 20, "no clips written while sampling"
    assert written[0].name == "00000-prompt_0_a_red_circle_moving_right.mp4"   # numbered to sort in order
    printed = stdout.decode().splitlines()
    assert printed[0] == str(written[0]) and len(printed) >= 20                # each path printed when written
    assert proc.returncode == 128 + signal.SIGTERM                             # stopped as asked
    assert sorted(p.name for p in out.glob("*.mp4")) == sorted(Path(line).name for line in printed)   # no half clip


def test_a_stopped_prompts_run_resumes_and_equals_one_run(run, tmp_path, monkeypatch, capsys):
    """Stopped after 5 of 12 clips, the same command makes only the other 7, and the folder then
    holds the clips of one uninterrupted run; other settings into that folder are refused."""
    import videodit.data.video_write as video_write

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"prompt {k}\n" for k in range(12)))
    command = ["sample", "--ckpt", str(run), "--prompts", str(prompts), "--steps", "2"]
    assert main([*command, "--out", str(tmp_path / "straight")]) == 0

    real_write, calls, stop_at = video_write.write_video, [], [6]

    def write(path, frames, fps, audio=None):
        calls.append(Path(path).name)
        if len(calls) == stop_at[0]:
            raise KeyboardInterrupt   # a stop in the middle: 5 clips written
        return real_write(path, frames, fps, audio=audio)

    monkeypatch.setattr(video_write, "write_video", write)
    resumed = tmp_path / "resumed"
    assert main([*command, "--out", str(resumed)]) == 130   # "interrupted", as a Ctrl-C ends it
    assert len(list(resumed.glob("*.mp4"))) == 5
    calls.clear()
    stop_at[0] = None
    capsys.readouterr()
    assert main([*command, "--out", str(resumed)]) == 0
    assert "5 of 12 clips are there already (kept); sampling the other 7" in capsys.readouterr().err
    assert len(calls) == 7
    straight = sorted((tmp_path / "straight").glob("*.mp4"))
    assert [p.name for p in straight] == sorted(p.name for p in resumed.glob("*.mp4"))
    for path in straight:
        assert np.array_equal(read_video(path)[0], read_video(resumed / path.name)[0])

    assert main([*command, "--seed", "7", "--out", str(resumed)]) == 2
    assert "holds clips sampled with other settings (seed: 0 there, 7 now)" in one_error_line(capsys)
