"""LoRA under torchrun (gloo, CPU, 2 processes, fp32): DDP, FSDP2 (with activation checkpointing),
sequence, tensor and pipeline parallelism each train the adapters as one process does on the same global
batch (tolerance as in test_distributed.py: 1e-6 absolute after 3 AdamW steps), the frozen base
stays bitwise as it was, and a sharded LoRA checkpoint holds the adapters only and resumes.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from conftest import random_model, tiny_overrides, torchrun
from test_distributed import run_layouts, wan
from videodit.checkpoint.tools import write_model_folder
from videodit.cli import main
from videodit.config import load_config
from videodit.models.lora import is_adapter_name
from videodit.models.stdit.model import STDiT
from videodit.models.wan import write_wan_folder
from videodit.train.trainer import Trainer

TOLERANCE = 1e-6
STEPS = 3
BUCKETS = "{'24px': {1: [1.0, 2], 4: [1.0, 2]}, '16px': {1: [1.0, 2], 4: [1.0, 2]}}"


def make_base(overrides: list[str], folder: Path) -> Path:
    """Random base weights for the geometry of ``overrides``, of its model family, as a videodit
    model folder (nothing zero: see tests/train/test_lora.py)."""
    cfg, spec, geometry, model = random_model(overrides)
    if isinstance(model, STDiT):
        return model.save_pretrained(folder)
    if cfg.model.family == "wan":
        return write_wan_folder(model.state_dict(), geometry, folder)   # Wan's own folder layout
    return write_model_folder(folder, model.state_dict(), {"config.json": json.dumps(spec.geometry_config(geometry))})


def lora_runs(data_dir, tmp_path: Path, **extra) -> list[str]:
    values = {"model.num_heads": 4, "train.lr": 1e-3, "train.warmup_steps": 1, "train.ema_decay": 0,
              "train.batch_size": 2, **extra}
    overrides = tiny_overrides(data_dir, **values)
    return with_lora(overrides, tmp_path)


def with_lora(overrides: list[str], tmp_path: Path) -> list[str]:
    base = make_base(overrides, tmp_path / f"base-{abs(hash(tuple(overrides)))}")
    return overrides + ["lora.rank=4", f"model.init_from={base}"]


def single_process(overrides: list[str], run_dir: Path) -> tuple[dict, list[float], dict]:
    trainer = Trainer(load_config("tiny", overrides), run_dir)
    before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    batches = trainer.batches()
    accum = trainer.cfg.train.grad_accum
    losses = [trainer.train_step([next(batches) for _ in range(accum)])[0] for _ in range(STEPS)]
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, losses, before


def assert_matches(got: dict, reference) -> None:
    weights, losses, before = reference
    assert got["losses"] == pytest.approx(losses, rel=1e-5)
    adapters = [k for k in weights if is_adapter_name(k)]
    assert adapters and got["weights"].keys() == weights.keys()
    worst = max((got["weights"][k] - weights[k]).abs().max().item() for k in adapters)
    assert worst < TOLERANCE, worst
    assert any((weights[k] - before[k]).abs().max() > 5e-4 for k in adapters)     # the adapters did move
    assert all(torch.equal(got["weights"][k], before[k]) for k in weights if k not in adapters)   # base frozen


def test_lora_under_ddp_fsdp_and_sp_matches_one_process(toy_dir, tmp_path):
    runs = lora_runs(toy_dir, tmp_path)
    got = run_layouts(toy_dir, tmp_path, 2, {
        "ddp": runs + ["parallel.dp_replicate=2", "parallel.dp_shard=1"],
        "fsdp": runs + ["parallel.dp_shard=2"],
        "fsdp_checkpointing": runs + ["parallel.dp_shard=2", "memory.checkpointing=full"],
        "sp": runs + ["parallel.sp=2"],
    })
    accum2 = single_process(runs + ["train.grad_accum=2"], tmp_path / "ref2")
    for name in ("ddp", "fsdp", "fsdp_checkpointing"):
        assert_matches(got[name], accum2)
    assert_matches(got["sp"], single_process(runs, tmp_path / "ref1"))


def test_lora_under_tensor_and_pipeline_parallel_matches_one_process(mixed_toy, tmp_path):
    # Every Linear gets an adapter: column-wise (q, k, v, fc1, the caption MLP's fc1, t_block) and
    # row-wise (proj, fc2) layers, in the blocks and at the root.
    targets = "[attn.q, attn.k, attn.v, attn.proj, cross_attn.q, cross_attn.k, cross_attn.v, cross_attn.proj, " \
              "mlp.fc1, mlp.fc2, t_block.1, caption_embedder.proj.fc1, caption_embedder.proj.fc2]"
    runs = lora_runs(mixed_toy, tmp_path, **{"model.depth": 2, "data.bucket_config": BUCKETS}) + \
        [f"lora.targets={targets}"]
    got = run_layouts(mixed_toy, tmp_path, 2, {"tp": runs + ["parallel.tp=2"], "pp": runs + ["parallel.pp=2"]})
    reference = single_process(runs, tmp_path / "ref")
    for name in ("tp", "pp"):
        assert_matches(got[name], reference)


def test_wan_lora_under_ddp_and_fsdp_matches_one_process(toy_dir, tmp_path):
    """LoRA on Wan (default targets: self_attn.q/k/v/o, ffn.0, ffn.2) from a wan-tiny base."""
    runs = with_lora(wan(toy_dir), tmp_path)
    got = run_layouts(toy_dir, tmp_path, 2, {
        "ddp": runs + ["parallel.dp_replicate=2", "parallel.dp_shard=1"],
        "fsdp": runs + ["parallel.dp_shard=2"],
    })
    accum2 = single_process(runs + ["train.grad_accum=2"], tmp_path / "ref2")
    for name in got:
        assert_matches(got[name], accum2)
    assert any(k.startswith("blocks.1.ffn.2.") for k in got["fsdp"]["weights"] if is_adapter_name(k))


def test_sharded_lora_checkpoint_holds_the_adapters_and_resumes_on_one_process(toy_dir, tmp_path):
    runs = lora_runs(toy_dir, tmp_path, **{"train.ema_decay": 0.9, "checkpoint.on_config_change": "continue"})
    two = tmp_path / "two"
    result = torchrun(2, "-m", "videodit", "train", "--out", str(two), *runs, "train.max_steps=2",
                      "checkpoint.every_steps=2", "parallel.dp_shard=2", timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = two / "checkpoints" / "step-0000002"
    assert all(is_adapter_name(k) for k in load_file(saved / "model.safetensors"))
    shards = FileSystemReader(str(saved / "dcp")).read_metadata().state_dict_metadata
    tensors = [key for key in shards if not key.startswith("optimizer.param_groups.")]
    assert tensors and all(is_adapter_name(key) for key in tensors)   # the shards hold no base weights either
    assert main(["train", "--out", str(two), *runs, "train.max_steps=4", "train.grad_accum=2", "resume=auto"]) == 0
    assert main(["train", "--out", str(tmp_path / "ref"), *runs, "train.max_steps=4", "train.grad_accum=2"]) == 0
    for stem in ("model", "ema"):
        want = load_file(tmp_path / "ref" / "checkpoints" / "step-0000004" / f"{stem}.safetensors")
        got = load_file(two / "checkpoints" / "step-0000004" / f"{stem}.safetensors")
        assert got.keys() == want.keys()
        assert max((got[k] - want[k]).abs().max().item() for k in want) < TOLERANCE
