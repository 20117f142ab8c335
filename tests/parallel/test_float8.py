"""fp8 compute (``train.fp8``, ``parallel/float8.py``): torchao's float8 training of the block linears,
emulated on CPU (the same float8 casts and rounding as on a GPU, with fp32 matmuls).

- Which layers: every linear layer inside ``model.blocks`` with both sides a multiple of 16; the
  embedders, the head and any odd-sized layer keep their precision.
- Numerics: over 20 toy steps of a tiny Wan (and STDiT) the fp8 run's loss stays within
  ``FOLLOWS`` (relative) of the fp32 run's at every step. Measured on the 2-core CPU machine
  (torch 2.13, torchao 0.18), seeds 0 / 1 / 2: Wan 9.3e-3 / 7.1e-3 / 5.7e-3 (bf16 autocast instead:
  3.9e-4), STDiT 1.9e-2 / 1.0e-3 / 2.4e-3 (bf16: 5.7e-3). e4m3 keeps 3 mantissa bits (a relative
  rounding error up to 1/16 per element, e5m2 gradients 1/8), so each step's loss moves by ~1e-3
  and the trajectories drift apart slowly with AdamW at lr 1e-3: the tolerance is three times the
  worst seen. The fp8 run must also differ from fp32 by more than bf16 rounding alone would
  explain (the conversion is not a silent no-op).
- FSDP2 (float8 all-gather, scales precomputed after each optimizer step) and DDP over 2 gloo
  processes match one process as the fp32 layouts do (1e-6); SP within 1e-3 on the losses.
- Resume is bitwise, on one process and under FSDP2: 4 steps straight vs 2, a checkpoint, 2 more.
- Unsupported combinations are refused in one line.
"""

import json
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from conftest import torchrun
from test_distributed import base, run_layouts, single_process, wan
from videodit.cli import main
from videodit.components import model_geometry, model_of
from videodit.config import load_config
from videodit.errors import UserError
from videodit.parallel.float8 import Float8Options, apply_float8, check_float8, float8_layers
from videodit.train.trainer import Trainer

pytest.importorskip("torchao")

# The largest relative loss difference to fp32 over 20 steps: three times the worst measured
# (module docstring). STDiT's tiny test model (width 32, 2 heads) sums 32-term dot products, which
# average float8 rounding less than Wan's (64 wide, FFN 128): it drifts further, in bf16 too.
FOLLOWS = {"wan": 3e-2, "stdit": 6e-2}
BF16_ROUNDING = 1e-4  # fp8 must move the losses more than this (bf16 vs fp32 moves them 3.9e-4)
FAMILIES = {"wan": wan, "stdit": base}


def losses_of(overrides: list[str], run_dir, steps: int) -> list[float]:
    trainer = Trainer(load_config("tiny", overrides), run_dir)
    batches = trainer.batches()
    return [trainer.train_step([next(batches)])[0] for _ in range(steps)]


def relative_difference(a: list[float], b: list[float]) -> float:
    a, b = np.array(a), np.array(b)
    return float(np.max(np.abs(a - b) / np.abs(b)))


# --------------------------------------------------------------------------- which layers


def tiny_model(overrides: list[str]) -> nn.Module:
    cfg = load_config("tiny", overrides)
    return model_of(cfg, model_geometry(cfg, latent_channels=4, caption_channels=64))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_block_linear_is_converted_and_nothing_else(toy_dir, tmp_path, family):
    model = tiny_model(FAMILIES[family](toy_dir))
    in_blocks = {id(m) for block in model.blocks for m in block.modules()}
    linears = {name: id(m) in in_blocks for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    converted = apply_float8(model, Float8Options(emulate=True))
    assert set(converted) == {name for name, in_block in linears.items() if in_block}
    assert len(converted) >= 12 and not all(linears.values())   # the embedders and head are linears, kept
    assert all(type(m) is nn.Linear for name, m in model.named_modules() if name in linears and not linears[name])


def test_a_layer_not_a_multiple_of_16_keeps_its_precision(toy_dir):
    model = tiny_model(wan(toy_dir, **{"model.ffn_dim": 72}))
    converted = apply_float8(model, Float8Options(emulate=True))
    assert "blocks.0.self_attn.q" in converted and "blocks.0.cross_attn.o" in converted
    assert not any(".ffn." in name for name in converted)   # 64 -> 72 -> 64: 72 is not a multiple of 16


def test_each_expert_of_a_two_expert_model_is_converted(toy_dir, tmp_path):
    """Wan 2.2 A14B's layout (model.expert=both, as tests/train/test_wan_experts.py trains it)."""
    experts = {"model.expert": "both", "model.expert_boundary": 0.75, "diffusion.constant_shift": 3.0,
               "diffusion.logit_mean": 0.0, "train.fp8": True}
    trainer = Trainer(load_config("tiny", wan(toy_dir, **experts)), tmp_path / "run")
    layers = float8_layers(trainer.model)
    per_expert = {}
    for name in layers:
        expert, _, inside = name.partition(".blocks.")
        per_expert.setdefault(expert, set()).add(inside)
    assert len(per_expert) == 2 and len({frozenset(v) for v in per_expert.values()}) == 1
    assert len(layers) == 2 * 2 * 10   # 2 experts x 2 blocks x (self q/k/v/o, cross q/k/v/o, ffn.0, ffn.2)
    batches = trainer.batches()
    assert all(np.isfinite(trainer.train_step([next(batches)])[0]) for _ in range(2))


# --------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fp8_follows_fp32_training(toy_dir, tmp_path, family):
    """20 steps, lr 1e-3: fp8 (emulated) against fp32, every step's loss. Measured max relative
    difference for seeds 0, 1, 2: Wan 9.3e-3, 7.1e-3, 5.7e-3 (bf16: 3.9e-4); STDiT 1.9e-2, 1.0e-3,
    2.4e-3 (bf16: 5.7e-3)."""
    runs = FAMILIES[family](toy_dir)
    reference = losses_of(runs, tmp_path / "fp32", 20)
    fp8 = losses_of(runs + ["train.fp8=true"], tmp_path / "fp8", 20)
    difference = relative_difference(fp8, reference)
    assert BF16_ROUNDING < difference < FOLLOWS[family], difference


def test_checkpointing_and_compile_run_the_same_fp8_step(toy_dir, tmp_path):
    """The float8 casts are recomputed exactly by activation checkpointing (full and selective)
    and traced by train.compile (aot_eager: the graph torchao's casts end up in, without inductor's
    CPU code generation time)."""
    runs = wan(toy_dir, **{"train.fp8": True})
    plain = losses_of(runs, tmp_path / "plain", 3)
    for extra in (["memory.checkpointing=full"], ["memory.checkpointing=selective"]):
        assert losses_of(runs + extra, tmp_path / extra[0][-4:], 3) == plain
    compiled = losses_of(runs + ["train.compile=true", "train.compile_backend=aot_eager"], tmp_path / "compiled", 3)
    assert compiled == pytest.approx(plain, rel=1e-6)


def test_resume_is_bitwise(toy_dir, tmp_path):
    """4 steps straight vs 2 steps, a checkpoint, and 2 more: the same weights, EMA and losses."""
    runs = wan(toy_dir, **{"train.fp8": True, "train.ema_decay": 0.9, "checkpoint.every_steps": 2})
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(["train", "--out", str(straight), *runs, "train.max_steps=4"]) == 0
    assert main(["train", "--out", str(resumed), *runs, "train.max_steps=2"]) == 0
    assert main(["train", "--out", str(resumed), *runs, "train.max_steps=4", "resume=auto"]) == 0
    for stem in ("model", "ema"):
        want = load_file(straight / "checkpoints" / "step-0000004" / f"{stem}.safetensors")
        got = load_file(resumed / "checkpoints" / "step-0000004" / f"{stem}.safetensors")
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert step_losses(resumed) == step_losses(straight) and len(step_losses(straight)) == 4


def step_losses(run) -> list[float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in sorted(records, key=lambda r: r["step"]) if "loss" in r]


# --------------------------------------------------------------------------- FSDP2 and SP


def test_fsdp2_and_sp_two_processes_match_one(toy_dir, tmp_path):
    """2 gloo processes. FSDP2 (float8 all-gather, scales precomputed after each step) and DDP
    see the micro-batches one process sees with grad_accum 2, so every float8 scale is the same
    and only the gradient summation order differs: weights within 1e-6 after 3 steps, as the
    fp32 layouts. Under SP each rank scales the activations of its own tokens (the weights' scales
    stay whole): a float8 rounding difference, so the losses are compared (1e-3 relative)."""
    video = wan(toy_dir, **{"train.fp8": True})
    got = run_layouts(toy_dir, tmp_path, 2, {"fsdp": video + ["parallel.dp_shard=2"],
                                             "ddp": video + ["parallel.dp_replicate=2", "parallel.dp_shard=1"],
                                             "sp": video + ["parallel.sp=2"]})
    accum2 = single_process(video + ["train.grad_accum=2"], tmp_path / "ref2")
    for name in ("fsdp", "ddp"):
        weights, losses = accum2
        assert got[name]["losses"] == pytest.approx(losses, rel=1e-6)
        assert max((got[name]["weights"][k] - weights[k]).abs().max().item() for k in weights) < 1e-6
    _, losses = single_process(video, tmp_path / "ref1")
    assert got["sp"]["losses"] == pytest.approx(losses, rel=1e-3)


def test_fsdp2_resume_is_bitwise(toy_dir, tmp_path):
    """Under FSDP2 the first step after a resume gathers with scales computed at the gather, the
    straight run with the scales precomputed after the previous step: the same numbers."""
    runs = wan(toy_dir, **{"train.fp8": True, "train.ema_decay": 0.9, "checkpoint.every_steps": 2,
                           "parallel.dp_shard": 2})
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for out, extra in ((straight, ["train.max_steps=4"]), (resumed, ["train.max_steps=2"]),
                       (resumed, ["train.max_steps=4", "resume=auto"])):
        result = torchrun(2, "-m", "videodit", "train", "--out", str(out), *runs, *extra, timeout=400)
        assert result.returncode == 0, result.stderr[-3000:]
    for stem in ("model", "ema"):
        want = load_file(straight / "checkpoints" / "step-0000004" / f"{stem}.safetensors")
        got = load_file(resumed / "checkpoints" / "step-0000004" / f"{stem}.safetensors")
        assert all(torch.equal(got[k], want[k]) for k in want)
    assert step_losses(resumed) == step_losses(straight)


# --------------------------------------------------------------------------- refused


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_lora_is_refused_in_one_line_before_anything_is_built(toy_dir, tmp_path, family):
    with pytest.raises(UserError) as error:
        Trainer(load_config("tiny", FAMILIES[family](toy_dir, **{"train.fp8": True, "lora.rank": 4})), tmp_path / "run")
    assert str(error.value) == (
        "train.fp8 with LoRA (lora.rank > 0) is not supported: torchao's float8 linear always computes the weight "
        "gradient, which a frozen base discards, so it would add matmuls rather than save time; set train.fp8=false "
        "(lora.base_dtype=fp8 stores the frozen base in float8)")
    assert not (tmp_path / "run").exists()


def test_tensor_parallel_is_refused_on_every_rank(toy_dir, tmp_path):
    result = torchrun(2, "-m", "videodit", "train", "--out", str(tmp_path / "run"),
                      *wan(toy_dir, **{"train.fp8": True}), "parallel.tp=2")
    assert result.returncode != 0
    assert "error (rank 0): train.fp8 with parallel.tp=2 is not supported" in result.stderr


@pytest.mark.parametrize("capability, refused", [((8, 0), True), ((8, 6), True), ((8, 9), False), ((9, 0), False)])
def test_gpus_without_float8_matmuls_are_refused(monkeypatch, capability, refused):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Test GPU")
    if not refused:
        check_float8(torch.device("cuda", 0), tp=1, lora_rank=0)
        return
    with pytest.raises(UserError) as error:
        check_float8(torch.device("cuda", 0), tp=1, lora_rank=0)
    assert str(error.value) == (f"train.fp8 needs float8 matmuls: a GPU of compute capability >= 8.9 (L4, L40S, "
                                f"RTX 4090, H100, B200); NVIDIA Test GPU is {capability[0]}.{capability[1]}: set "
                                "train.fp8=false")


def test_without_torchao_it_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(UserError, match=r"train.fp8 needs torchao: pip install 'videodit\[lowmem\]'"):
        check_float8(torch.device("cpu"), tp=1, lora_rank=0)
