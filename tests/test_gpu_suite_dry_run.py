"""benchmarks/gpu_suite.py: the one command a person with a GPU runs. ``--dry-run`` runs every
section on CPU in tiny form (fp32, two steps, torchrun over 2 gloo processes for the parallel
layouts), so the suite is known to work before anyone spends GPU time on it."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "benchmarks" / "gpu_suite.py"


def run_suite(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    return subprocess.run([sys.executable, str(SUITE), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)


def table_rows(text: str, heading: str) -> list[str]:
    block = text.split(heading, 1)[1].split("\n### ", 1)[0]
    return [line for line in block.splitlines() if line.startswith("| ") and not line.startswith("| ---")][1:]


def test_dry_run_measures_every_section_and_appends_one_section(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\nearlier sections\n")
    result = run_suite("--dry-run", "--results", str(results))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    text = results.read_text()
    assert text.startswith("# Benchmark results\n\nearlier sections\n")   # appended, nothing replaced
    assert text.count("\n## ") == 1 and "## GPU suite -- DRY RUN" in text
    families = [row.split(" | ") for row in table_rows(text, "### Families (dry run)")]
    labels = ["Wan 2.1 1.3B", "Wan 2.1 14B", "Open-Sora 2.0 MMDiT", "LTX-2.3"]
    assert [(r[0][2:], r[4], r[5]) for r in families] == [(f, mode, compiled) for f in labels
                                                          for compiled in ("off", "on")
                                                          for mode in ("none", "selective", "full")]
    assert all(float(r[6]) > 0 for r in families)                               # s/step
    assert all(r[13] != "n/a" for r in families if r[5] == "off")               # planner / measured (CPU: eager)
    shares = table_rows(text, "### Families: where the step's device time goes")
    assert len(shares) == len(families)
    for label in labels:                                                        # the top 10 of each family
        assert len(table_rows(text, f"### Families: top kernels, {label} (")) == 10
    assert len(table_rows(text, "### MFU")) == 4                                # 2 shapes x compile off/on
    assert [row.split(" | ")[3] for row in table_rows(text, "### MFU")] == ["off", "off", "on", "on"]
    assert len(table_rows(text, "### SDPA kernel per attention kind")) == 3     # spatial, temporal, cross
    assert len(table_rows(text, "### Fast paths")) == 3                         # for-loop, foreach, fused AdamW
    assert len(table_rows(text, "### Planner prediction vs measured peak")) == 5
    tuned = table_rows(text, "### videodit tune's batch sizes vs the planner's")
    assert [row.split(" | ")[0][2:] for row in tuned] == ["32x48 x 17", "48x64 x 17"]
    assert all(int(row.split(" | ")[2]) >= 1 for row in tuned)                  # the search found a batch
    assert len(table_rows(text, "### Memory levers")) == 5                      # offload is CUDA-only
    fp8 = table_rows(text, "### fp8 compute")                                   # fp32/fp8 x compile off/on
    assert [row.split(" | ")[0][2:] + " " + row.split(" | ")[1] for row in fp8] == ["fp32 off", "fp8 off",
                                                                                  "fp32 on", "fp8 on"]
    swap = table_rows(text, "### Block swapping")                               # 0, 1, 2 of 2 blocks swapped
    assert [row.split(" | ")[1] for row in swap] == ["0 of 2", "1 of 2", "2 of 2"]
    layouts = [row.split(" | ")[0][2:] for row in table_rows(text, "### Parallel layouts")]
    assert layouts == ["fsdp=2", "sp=2", "tp=2", "pp=2 x fsdp=1"]
    decoders = [row.split(" | ")[0][2:] for row in table_rows(text, "### Data: decode clips/s")]
    assert decoders in (["PyAV, CPU"], ["PyAV, CPU", "torchcodec, CPU"])        # NVDEC needs a GPU
    waits = table_rows(text, "### Data: the training step waiting for data")
    assert [row.split(" | ")[0][2:] for row in waits] == ["0", "2"]               # data.num_workers
    assert all(0 <= float(row.split(" | ")[1]) <= 1 for row in waits)
    # On CPU only what needs a GPU (or torchcodec, where it does not load) is missing, each with
    # its reason; nothing failed.
    missing = table_rows(text, "### Not measured")
    if decoders == ["PyAV, CPU"]:
        assert [row for row in missing if row.startswith("| data: torchcodec CPU decode | ")], missing
        missing = [row for row in missing if not row.startswith("| data: torchcodec CPU decode | ")]
    assert {row.split(" | ")[0][2:] for row in missing} == {"MFU", "families MFU", "TF32 matmuls", "lever offload",
                                                           "data: NVDEC decode", "lever offload + fp8",
                                                           "lever checkpoint full + offload"}, missing
    assert "failed" not in text


def test_help_says_how_to_run_offline_and_what_it_cannot_measure(capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_suite", SUITE)
    suite = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_suite", suite)   # its dataclasses look their module up
    spec.loader.exec_module(suite)
    with pytest.raises(SystemExit):
        suite.main(["--help"])
    text = capsys.readouterr().out
    wheel = next(line for line in text.splitlines() if "pip wheel --wheel-dir videodit-wheels" in line)
    assert "'numpy>=1.24'" in wheel and "'setuptools>=68'" in wheel and "torch" not in wheel  # from pyproject.toml
    assert "pip install --no-index --find-links videodit-wheels -e ." in text
    assert "Not measured" in text and "What this suite never measures" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_without_a_gpu_it_says_so_in_one_line():
    result = run_suite("--sections", "mfu", timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == ("error: no GPU visible; run on a machine with one, or --dry-run to check the "
                                     "suite on CPU")
