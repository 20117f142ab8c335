"""DMD2 under torchrun (gloo, CPU, 2 processes, fp32): student and critic train as one process does
on the same global batch, student turns included, under DDP, FSDP2 (the teacher and critic
sharded like the student) and SP 2 (each role's forwards split over the sequence); full weights,
or two adapters of one shared base (DDP finds the adapter a backward leaves out)."""

import pytest
from safetensors.torch import load_file

from conftest import dmd2_overrides
from test_distributed import TOLERANCE, run_layouts, single_process


@pytest.mark.parametrize("lora", [0, 4], ids=["full", "shared-base-lora"])
def test_dmd2_under_ddp_fsdp2_and_sp_matches_one_process(toy_dir, dmd2_teacher, tmp_path, lora):
    runs = dmd2_overrides(toy_dir, dmd2_teacher, **{"train.batch_size": 2, "train.ema_decay": 0, "lora.rank": lora})
    got = run_layouts(toy_dir, tmp_path, 2, {"ddp": runs + ["parallel.dp_replicate=2", "parallel.dp_shard=1"],
                                             "fsdp": runs + ["parallel.dp_shard=2"],
                                             "sp": runs + ["parallel.sp=2", "parallel.dp_shard=1"]},
                      steps=3)   # the student's turns are steps 0 and 2
    references = {"two micro-batches": single_process(runs + ["train.grad_accum=2"], tmp_path / "ref2", steps=3),
                  "one batch": single_process(runs, tmp_path / "ref1", steps=3)}
    for layout, reference in (("ddp", "two micro-batches"), ("fsdp", "two micro-batches"), ("sp", "one batch")):
        weights, losses = references[reference]
        # The losses are the critic's: the third one is computed with the critic and student both updated.
        assert got[layout]["losses"] == pytest.approx(losses, rel=1e-5), layout
        worst = max((got[layout]["weights"][k] - weights[k]).abs().max().item() for k in weights)
        assert worst < TOLERANCE, (layout, worst)
    weights = references["one batch"][0]
    if lora:   # both adapters (in the one model's state) moved from B = 0
        assert all(any(weights[k].abs().max() > 1e-4 for k in weights if f".lora_B.{role}." in k)
                   for role in ("default", "critic"))
    else:
        start = load_file(str(dmd2_teacher / "model.safetensors"))   # the student started as the teacher
        assert any((weights[k] - start[k]).abs().max() > 1e-4 for k in weights)
