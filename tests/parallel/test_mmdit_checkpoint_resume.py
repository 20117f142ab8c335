"""An MMDiT trained under tensor parallelism (gloo, CPU, fp32) saves a sharded checkpoint and resumes
from it bitwise. TP shards the single blocks' fused ``v_mlp``/``linear2`` as strided DTensors,
which DCP cannot write as they are: ``parallel/state.py`` writes and reads them as plain shards
(``parallel/tensor.py``'s ``dcp_state``/``restore_from_dcp``), model, EMA and AdamW moments alike.

Each layout trains 2 steps and saves (DCP shards), then resumes to step 4; an uninterrupted run of
the same layout to step 4 must hold exactly the same model and EMA weights. Under TP=2 x FSDP2=2
the fused weights are sharded two ways (FSDP2 along their inputs, TP strided along their outputs).
One process also resumes each checkpoint (DCP re-shards it), within test_distributed.py's 1e-6.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_overrides, torchrun
from test_distributed import TOLERANCE
from videodit.cli import main

LAYOUTS = {
    "tp": (2, ["parallel.tp=2"]),
    "tp_fsdp": (4, ["parallel.tp=2", "parallel.dp_shard=2"]),
}


def mmdit(toy_dir) -> list[str]:
    """mmdit-tiny (2 double + 2 single blocks, 2 heads of 32) on the toy data, with an EMA and
    AdamW moments to carry across the resume."""
    return tiny_overrides(toy_dir, **{"model.preset": "mmdit-tiny", "model.depth": 1, "model.depth_single": 1,
                                      "model.hidden_size": 64, "model.patch_size": "[1,2,2]", "text.dim": 32,
                                      "train.batch_size": 2, "train.lr": 1e-3, "train.warmup_steps": 1,
                                      "train.ema_decay": 0.9, "checkpoint.on_config_change": "continue"})


def train(nproc: int, out, overrides: list[str], *extra: str) -> None:
    result = torchrun(nproc, "-m", "videodit", "train", "--out", str(out), *overrides, *extra, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]


def end_weights(run, stem: str) -> dict:
    return load_file(run / "checkpoints" / "step-0000004" / f"{stem}.safetensors")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sharded_mmdit_checkpoint_resumes_bitwise(toy_dir, tmp_path, layout):
    nproc, parallel = LAYOUTS[layout]
    runs = mmdit(toy_dir) + parallel
    resumed, straight, one = tmp_path / "resumed", tmp_path / "straight", tmp_path / "one"
    train(nproc, resumed, runs, "train.max_steps=2", "checkpoint.every_steps=2")
    saved = resumed / "checkpoints" / "step-0000002"
    manifest = json.loads((saved / "manifest.json").read_text())
    assert f"dcp/__{nproc - 1}_0.distcp" in manifest["files"] and "optimizer.pt" not in manifest["files"]
    shutil.copytree(resumed, one)
    train(nproc, resumed, runs, "train.max_steps=4", "checkpoint.every_steps=2", "resume=auto")
    train(nproc, straight, runs, "train.max_steps=4", "checkpoint.every_steps=2")
    # One process (grad_accum keeps the global batch; TP does not split it) resumes the same shards.
    assert main(["train", "--out", str(one), *mmdit(toy_dir), "train.max_steps=4", "checkpoint.every_steps=2",
                 f"train.grad_accum={nproc // 2}", "resume=auto"]) == 0
    for stem in ("model", "ema"):
        want = end_weights(straight, stem)
        got = end_weights(resumed, stem)
        assert got.keys() == want.keys() and "single_blocks.0.v_mlp.weight" in want
        different = [name for name in want if not torch.equal(got[name], want[name])]
        assert not different, (stem, different[:5])
        got = end_weights(one, stem)
        assert max((got[k] - want[k]).abs().max().item() for k in want) < TOLERANCE, stem
    # The weights moved on after step 2: the resume carried the training on, not a copy of its end.
    before = load_file(saved / "model.safetensors")["single_blocks.0.v_mlp.weight"]
    assert not torch.equal(before, end_weights(straight, "model")["single_blocks.0.v_mlp.weight"])
