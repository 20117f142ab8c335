"""DMD2 under torchrun (gloo, CPU, 2 processes, fp32, DDP): student and critic train as one process
does on the same global batch (its two micro-batches accumulated), student turns included; full
weights, or two adapters of one shared base (DDP finds the adapter a backward leaves out)."""

import pytest
from safetensors.torch import load_file

from conftest import dmd2_overrides
from test_distributed import TOLERANCE, run_layouts, single_process


@pytest.mark.parametrize("lora", [0, 4], ids=["full", "shared-base-lora"])
def test_dmd2_under_ddp_matches_one_process(toy_dir, dmd2_teacher, tmp_path, lora):
    runs = dmd2_overrides(toy_dir, dmd2_teacher, **{"train.batch_size": 2, "train.ema_decay": 0, "lora.rank": lora})
    got = run_layouts(toy_dir, tmp_path, 2, {"ddp": runs + ["parallel.dp_replicate=2", "parallel.dp_shard=1"]},
                      steps=3)   # the student's turns are steps 0 and 2
    weights, losses = single_process(runs + ["train.grad_accum=2"], tmp_path / "ref", steps=3)
    # The losses are the critic's: the third one is computed with the critic and student both updated.
    assert got["ddp"]["losses"] == pytest.approx(losses, rel=1e-5)
    worst = max((got["ddp"]["weights"][k] - weights[k]).abs().max().item() for k in weights)
    assert worst < TOLERANCE, worst
    if lora:   # both adapters (in the one model's state) moved from B = 0
        assert all(any(weights[k].abs().max() > 1e-4 for k in weights if f".lora_B.{role}." in k)
                   for role in ("default", "critic"))
    else:
        start = load_file(str(dmd2_teacher / "model.safetensors"))   # the student started as the teacher
        assert any((weights[k] - start[k]).abs().max() > 1e-4 for k in weights)
