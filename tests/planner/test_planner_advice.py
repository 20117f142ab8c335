"""`videodit plan` advice for the GPUs the user has (#35 item 12): on the world size given (default:
what the config's parallel sizes imply) it names first what fits on those GPUs, then what more GPUs
would allow, each as command lines to paste; and following a line gives the plan it promised.
Also: `plan` refuses a parallel layout training refuses, by the same check (#35 item 11)."""

from __future__ import annotations

import json
import shlex

import pytest

from conftest import tiny_overrides
from videodit.cli import main
from videodit.config import load_config
from videodit.errors import UserError

WAN_LORA = ["wan2.1-t2v-14b-lora", "--gpu-mem", "24GiB", "--encoders-cached"]
OS2_FULL = ["opensora-v2-stage1", "--gpu-mem", "80GiB", "--encoders-cached"]   # a full fine-tune, 11.9B


def plan(capsys, *args: str) -> str:
    assert main(["plan", *args]) == 0
    return capsys.readouterr().out


def plan_json(capsys, *args: str) -> dict:
    return json.loads(plan(capsys, *args, "--json"))


def follow(capsys, command: str) -> dict:
    """Run a ``check: videodit plan ...`` line as printed (with --json): its plan."""
    args = shlex.split(command.split(": ", 1)[1])
    assert args[:2] == ["videodit", "plan"]
    return plan_json(capsys, *args[2:])


def test_wan_14b_lora_on_one_24gib_gpu_names_the_one_gpu_levers_first(capsys):
    """It answered "try parallel.sp=4 with memory.checkpointing=full": four GPUs, for a user with
    one, while the fp8 base, offload and 30 swapped blocks fit that one at 21.3 GiB."""
    out = plan(capsys, *WAN_LORA)
    table = [line for line in out.splitlines() if line.startswith("480x832")]
    assert "try lora.base_dtype=fp8 with memory.offload=true with memory.swap_blocks=30" in table[0]
    assert "parallel.sp" not in table[0]
    advice = out[out.index("do not fit at batch 1 as configured on 1 GPU"):].splitlines()
    assert advice[1].startswith("On 1 GPU (as given): lora.base_dtype=fp8 memory.offload=true memory.swap_blocks=30 "
                                "fits, batch-1 peak 21.3 GiB")
    assert advice[3] == "  train: videodit train wan2.1-t2v-14b-lora lora.base_dtype=fp8 memory.offload=true " \
                        "memory.swap_blocks=30"
    assert advice[4].startswith("With 4 GPUs: parallel.sp=4 fits") and "without moving" in advice[4]
    assert advice[6].startswith("  train: torchrun --nproc-per-node 4 -m videodit train wan2.1-t2v-14b-lora --out ")

    one_gpu = follow(capsys, advice[2])   # the one-GPU line as printed: batch 1 fits, at the peak promised
    assert one_gpu["world_size"] == 1 and one_gpu["advice"] is None
    (bucket,) = one_gpu["buckets"]
    assert bucket["max_batch_size"] >= 1 and bucket["predicted_peak_bytes"] / 2**30 == pytest.approx(21.3, abs=0.05)
    more = follow(capsys, advice[5])
    assert more["world_size"] == 4 and more["advice"] is None and more["buckets"][0]["max_batch_size"] >= 1


def test_opensora2_full_finetune_at_80gib_says_one_gpu_cannot_then_how_many_can(capsys):
    """11.9B parameters trained whole: weights, gradients and AdamW state are 177 GiB, so no lever
    fits one 80 GiB GPU; sequence parallelism (what it used to suggest) is no answer to that, FSDP
    over more GPUs is."""
    out = plan(capsys, *OS2_FULL)
    assert "try parallel.sp" not in out
    assert "does not fit at batch 1 on 1 GPU with any lever" in out
    advice = out[out.index("do not fit at batch 1 as configured on 1 GPU"):].splitlines()
    assert advice[1].startswith("On 1 GPU (as given) nothing fits at batch 1, whatever lever (the least any leaves is")
    assert advice[2].startswith("With 4 GPUs: ") and "without moving" in advice[2]
    assert advice[4].startswith("  train: torchrun --nproc-per-node 4 -m videodit train opensora-v2-stage1 --out ")
    four = follow(capsys, advice[3])
    assert four["world_size"] == 4 and four["advice"] is None
    assert all(b["max_batch_size"] >= 1 for b in four["buckets"])


def test_opensora2_on_eight_gpus_suggests_what_fits_on_those_eight(capsys):
    """The world size given is the one advised on first: 8 GPUs, FSDP over them (the recipe's
    dp_shard=-1); one bucket needs every block checkpointed, which fits without a ninth GPU."""
    result = plan_json(capsys, *OS2_FULL, "--world-size", "8")
    advice = result["advice"]
    assert result["world_size"] == 8 and advice["gpus"] == 8
    same = advice["same_gpus"]
    assert same["gpus"] == 8 and same["settings"] == ["memory.checkpoint_blocks=null"]
    assert advice["more_gpus"] is None   # nothing slow to spare: no more GPUs suggested
    assert same["commands"][1].startswith("train: torchrun --nproc-per-node 8 -m videodit train opensora-v2-stage1")
    assert all(b["max_batch_size"] >= 1 for b in follow(capsys, same["commands"][0])["buckets"])


def test_a_plan_that_fits_gives_no_advice(capsys, toy_dir):
    out = plan(capsys, *tiny_overrides(toy_dir), "--gpu-mem", "24GiB")
    assert "do not fit" not in out and "train:" not in out


# ------------------------------------------------------------------ one check of the layout for both


@pytest.mark.parametrize("overrides, message", [
    (["parallel.tp=3"], "parallel.tp=3 does not divide model.num_heads=2"),
    (["parallel.sp=3"], "parallel.sp=3 does not divide model.num_heads=2"),
    (["parallel.pp=100"], "parallel.pp=100 exceeds the model's"),
    (["parallel.tp=2", "train.compile=true"], "train.compile=true with parallel.tp=2 is not supported"),
], ids=["tp", "sp", "pp", "tp-compiled"])
def test_plan_refuses_a_layout_training_refuses_by_the_same_check(toy_dir, capsys, monkeypatch, overrides, message):
    """`plan` planned a tp that training refuses; both now run ``parallel.dims.check_layout``."""
    from videodit.parallel import dims, distributed

    args = [*tiny_overrides(toy_dir), *overrides]
    assert main(["plan", *args, "--gpu-mem", "24GiB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    cfg = load_config("tiny", args)
    p = cfg.parallel
    with pytest.raises(UserError) as refused:   # training's check, on the GPUs the sizes imply
        dims.check_layout(cfg, p.dp_replicate * max(p.dp_shard, 1) * p.sp * p.tp * p.pp)
    assert err[0] == f"error: {refused.value}"
    assert distributed.check_layout is dims.check_layout   # what init_distributed runs
