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


@pytest.mark.parametrize("lora", [0, 4], ids=["full", "shared-base-lora"])
def test_a_dmd2_run_under_fsdp2_resumes_where_one_process_ends(toy_dir, dmd2_teacher, tmp_path, lora):
    """Saved at step 2 under FSDP2 (the student in DCP shards, the critic and its optimizer gathered
    whole), resumed to step 4 on 2 ranks: student and critic end where one process ends."""
    from safetensors.torch import load_file as read

    from conftest import torchrun
    from videodit.cli import main

    runs = dmd2_overrides(toy_dir, dmd2_teacher, **{"train.batch_size": 2, "train.ema_decay": 0, "lora.rank": lora,
                                                    "checkpoint.every_steps": 2, "parallel.dp_shard": 2})
    run = tmp_path / "fsdp"
    for steps in (2, 4):   # the student's turns are steps 0 and 2: the resumed run starts on one
        extra = ["resume=auto"] if steps == 4 else []
        result = torchrun(2, "-m", "videodit", "train", "--out", str(run), *runs, f"train.max_steps={steps}", *extra)
        assert result.returncode == 0, result.stderr[-3000:]
    assert (run / "checkpoints" / "step-0000002" / "dcp").is_dir()
    ref = tmp_path / "ref"
    assert main(["train", "--out", str(ref), *runs, "parallel.dp_shard=1", "train.grad_accum=2",
                 "train.max_steps=4"]) == 0
    for stem in ("model", "critic"):
        want = read(ref / "checkpoints" / "step-0000004" / f"{stem}.safetensors")
        got = read(run / "checkpoints" / "step-0000004" / f"{stem}.safetensors")
        assert got.keys() == want.keys()
        assert max((got[k] - want[k]).abs().max().item() for k in want) < TOLERANCE, stem
