"""Wan under torchrun (gloo, CPU, fp32): LoRA under FSDP2 and FSDP2 + Ulysses sequence parallelism
trains the adapters as one process does (the harness and tolerances of test_lora_parallel.py), and
a checkpoint sharded by FSDP2 on 2 ranks resumes on 1 and ends where an uninterrupted run ends
(as test_distributed.py's STDiT test: 1e-6 absolute on the model and EMA weights)."""

from safetensors.torch import load_file

from conftest import torchrun
from test_distributed import TOLERANCE, run_layouts, wan
from test_lora_parallel import assert_matches, single_process, with_lora
from videodit.cli import main
from videodit.models.lora import is_adapter_name


def test_wan_lora_under_fsdp_and_fsdp_sp_matches_one_process(toy_dir, tmp_path):
    """4 processes: FSDP2 over all 4 (global batch: grad_accum 4 on one process), and Ulysses SP=2
    inside FSDP2 over dp_shard=2 x sp=2 (grad_accum 2). The targets are given in diffusers' names:
    the adapters carry Wan's."""
    targets = "[attn1.to_q, attn1.to_k, attn1.to_v, attn1.to_out.0, ffn.net.0.proj, ffn.net.2]"
    runs = with_lora(wan(toy_dir), tmp_path) + [f"lora.targets={targets}"]
    got = run_layouts(toy_dir, tmp_path, 4, {
        "fsdp": runs + ["parallel.dp_shard=4"],
        "fsdp_sp": runs + ["parallel.sp=2", "parallel.dp_shard=2"],
    })
    assert_matches(got["fsdp"], single_process(runs + ["train.grad_accum=4"], tmp_path / "ref4"))
    assert_matches(got["fsdp_sp"], single_process(runs + ["train.grad_accum=2"], tmp_path / "ref2"))
    adapters = {k for k in got["fsdp_sp"]["weights"] if is_adapter_name(k)}
    assert "blocks.1.self_attn.o.lora_A.default.weight" in adapters and "blocks.0.ffn.0.lora_B.default.weight" in adapters


def test_sharded_wan_checkpoint_resumes_on_one_process(toy_dir, tmp_path):
    """Saved by FSDP2 on 2 ranks (DCP shards) at step 2, resumed on 1 process (grad_accum 2 keeps
    the global batch) to step 4: the model and EMA match an uninterrupted single-process run."""
    video = wan(toy_dir, **{"train.ema_decay": 0.9, "checkpoint.on_config_change": "continue"})
    two = tmp_path / "two"
    result = torchrun(2, "-m", "videodit", "train", "--out", str(two), *video, "train.max_steps=2",
                      "checkpoint.every_steps=2", "parallel.dp_shard=2", timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = two / "checkpoints" / "step-0000002"
    assert sorted(p.name for p in (saved / "dcp").iterdir())[-1] == "__1_0.distcp"
    assert main(["train", "--out", str(two), *video, "train.max_steps=4", "train.grad_accum=2", "resume=auto"]) == 0
    assert main(["train", "--out", str(tmp_path / "ref"), *video, "train.max_steps=4", "train.grad_accum=2"]) == 0
    for stem in ("model", "ema"):
        want = load_file(tmp_path / "ref" / "checkpoints" / "step-0000004" / f"{stem}.safetensors")
        got = load_file(two / "checkpoints" / "step-0000004" / f"{stem}.safetensors")
        assert got.keys() == want.keys() and any(k.startswith("blocks.1.self_attn.") for k in want)
        assert max((got[k] - want[k]).abs().max().item() for k in want) < TOLERANCE
