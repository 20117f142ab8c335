"""Inputs that asked for unbounded work, or gave nothing and said success (#35 items 9 and 11): a
13.9 MB bucket config under the old 16 MiB limit parsed for minutes at 1.6-2.4 GB; a bucket config
of thousands of entries became a million buckets; `cache build` of videos that all fail to decode
exited 0 with a cache of 0 samples."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import time

import pytest

from conftest import tiny_overrides
from videodit.cli import main
from videodit.config import DataConfig
from videodit.data.buckets.config import parse_bucket_config, resolve_bucket_config
from videodit.data.buckets.tables import RESOLUTION_NAMES
from videodit.errors import UserError


def bucket_yaml(frames_per_resolution: int) -> str:
    """A valid bucket config: every resolution with frame counts 1..n, each (0.5, 4)."""
    lines = ["bucket_config:"]
    for name in RESOLUTION_NAMES:
        lines.append(f"  {name!r}:")
        lines += [f"    {n}: [0.5, 4]" for n in range(1, frames_per_resolution + 1)]
    return "\n".join(lines) + "\n"


def run_measured(args: list[str], timeout: float) -> tuple[subprocess.CompletedProcess, float, float]:
    """The CLI in a fresh process: (result, seconds, its peak resident MiB, from wait4)."""
    import tempfile

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    started = time.monotonic()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([sys.executable, "-m", "videodit", *args], stdout=out, stderr=err, env=env)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - started > timeout:
                proc.kill()
                os.wait4(proc.pid, 0)
                pytest.fail(f"videodit {' '.join(args[:3])} ... still ran after {timeout:.0f} s")
            time.sleep(0.1)
        out.seek(0)
        err.seek(0)
        result = subprocess.CompletedProcess(args, os.waitstatus_to_exitcode(status), out.read().decode(),
                                             err.read().decode())
    return result, time.monotonic() - started, usage.ru_maxrss / 1024


def test_a_13_9_mb_bucket_config_is_refused_in_one_line_at_once(tmp_path):
    path = tmp_path / "buckets.yaml"
    path.write_text(bucket_yaml(26_000))
    assert 13e6 < path.stat().st_size < 16 << 20
    result, seconds, peak = run_measured(["config", "show", "tiny", f"data.bucket_config_file={path}"], timeout=90)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "data.bucket_config_file" in errors[0] and "give a smaller file" in errors[0]
    assert seconds < 60 and peak < 1500


def test_a_bucket_config_of_too_many_entries_is_refused_before_its_buckets_are_built(monkeypatch):
    """Small in bytes, large in work: each entry is one bucket per aspect ratio."""
    import yaml

    import videodit.data.buckets.assign as assign

    config = yaml.safe_load(bucket_yaml(200))["bucket_config"]   # 200 per resolution: ~300,000 buckets
    monkeypatch.setattr(assign, "bucket_table", lambda cfg: pytest.fail("buckets were built"))
    started = time.monotonic()
    entries = 200 * len(RESOLUTION_NAMES)
    with pytest.raises(UserError, match=f"bucket_config has {entries:,} entries, more than the 2,048 .resolution, "
                                        "num_frames. pairs"):
        assign.build_buckets(config)
    assert time.monotonic() - started < 5


def test_a_bucket_config_file_within_the_bounds_still_reads(tmp_path):
    from videodit.data.buckets.config import MAX_ENTRIES

    path = tmp_path / "buckets.yaml"
    path.write_text(bucket_yaml(MAX_ENTRIES // len(RESOLUTION_NAMES) - 1))
    config = resolve_bucket_config(DataConfig(bucket_config_file=str(path)))
    assert len(parse_bucket_config(config).entries) <= MAX_ENTRIES


# ------------------------------------------------------------------ cache build of nothing


def test_cache_build_whose_every_video_fails_is_refused_in_one_line(toy_dir, tmp_path, capsys):
    """It exited 0 with "complete, 0 samples"; so did the same command again."""
    rows = list(csv.DictReader(open(toy_dir / "train.csv")))[:2]
    for k, row in enumerate(rows):
        (tmp_path / f"bad{k}.mp4").write_bytes(os.urandom(1000))
        row["path"] = str(tmp_path / f"bad{k}.mp4")
    with open(tmp_path / "bad.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    out = tmp_path / "cache"
    command = ["cache", "build", *tiny_overrides(toy_dir, **{"data.csv": tmp_path / "bad.csv"}), "--out", str(out)]
    for attempt in range(2):   # built, then "complete already": refused both times
        assert main(command) == 2
        err = capsys.readouterr().err.strip().splitlines()
        errors = [line for line in err if line.startswith("error")]
        assert len(errors) == 1 and "Traceback" not in "\n".join(err), err
        assert f"the cache {out} holds 0 samples: all 2 video(s) of data.csv failed to decode" in errors[0]
        assert "bad0.mp4" in errors[0] and f"delete {out}" in errors[0]
