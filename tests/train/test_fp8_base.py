"""fp8 frozen base weights for LoRA (lora.base_dtype=fp8, videodit/parallel/fp8_base.py), on a tiny
STDiT and a tiny Wan: the loss follows a bf16-base run, the block weights are float8 in memory and
nothing dequantised is kept for backward, resume is bitwise, checkpoints and EMA hold the adapters
only, sampling and --merge-lora read the full-precision base, checkpointing and FSDP2 (2 gloo
processes) match, and refusals are one line."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_overrides, torchrun
from videodit.checkpoint import export
from videodit.checkpoint.lora import init_weights
from videodit.cli import main
from videodit.components import model_geometry
from videodit.config import load_config
from videodit.errors import UserError
from videodit.models.families import get_spec
from videodit.models.lora import base_name, is_adapter_name
from videodit.models.stdit.model import STDiT
from videodit.models.wan import write_wan_folder
from videodit.parallel.fp8_base import (FP8, Float8BaseLinear, base_weight_bytes, check_base_dtype, dequantize,
                                        fp8_storage_bytes, quantize)
from videodit.planner.measure import measure_trainer, synthetic_batch, tensor_bytes
from videodit.sample import Pipeline
from videodit.train.trainer import Trainer

WORKER = Path(__file__).parent / "fp8_base_worker.py"

# The smallest models of each family that still have every kind of block layer.
FAMILIES = {
    "stdit": {},
    "wan": {"model.preset": "wan-tiny", "model.depth": 1, "model.hidden_size": 32, "model.num_heads": 2,
            "model.ffn_dim": 64, "model.patch_size": "[1,2,2]"},
}

# Over 50 steps of bf16 training the fp8-base loss stays within 2% (relative, every step) of the
# bf16-base loss. Why that much: e4m3 keeps 3 mantissa bits, so every block weight is off by ~2.6%
# (relative, scripts/fp8_base_error.py), which moves a tiny Wan's output by ~0.5%; a squared-error
# loss moves by about twice its input's relative change (~1%), doubled again for 50 steps of drift.
# Measured: max 3.8e-4 (STDiT) and 3.9e-3 (Wan), lr 1e-2, batch 2.
FOLLOW_TOLERANCE = 0.02
FOLLOW_STEPS = 50


def make_base(overrides: list[str], folder: Path) -> Path:
    """Random base weights of the family of ``overrides`` (nothing left at zero: a fresh model's
    zero head would give the adapters no gradient), as that family's model folder."""
    cfg = load_config("tiny", overrides)
    torch.manual_seed(0)
    geometry = model_geometry(cfg, 3, cfg.text.dim)
    model = get_spec(cfg.model.family).build(geometry)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    if isinstance(model, STDiT):
        return model.save_pretrained(folder)
    return write_wan_folder(model.state_dict(), geometry, folder)


def lora_run(toy_dir, tmp_path, family: str, **extra) -> list[str]:
    overrides = tiny_overrides(toy_dir, **{**FAMILIES[family], "train.lr": 1e-2, "train.ema_decay": 0.9, **extra})
    base = make_base(overrides, tmp_path / f"base-{family}")
    return overrides + ["lora.rank=4", f"model.init_from={base}"]


def train_losses(overrides: list[str], run_dir: Path, steps: int) -> tuple[Trainer, list[float]]:
    trainer = Trainer(load_config("tiny", overrides), run_dir)
    batches, accum = trainer.batches(), trainer.cfg.train.grad_accum
    return trainer, [trainer.train_step([next(batches) for _ in range(accum)])[0] for _ in range(steps)]


def fp8_layers(model) -> list[Float8BaseLinear]:
    return [m for m in model.modules() if isinstance(m, Float8BaseLinear)]


# ----------------------------------------------------------------------------- the number format

def test_per_row_power_of_two_scales_round_only_once():
    torch.manual_seed(0)
    weight = torch.randn(64, 48) * torch.logspace(-3, 1, 64).unsqueeze(1)   # rows over 4 decades
    weight[5] = 0                                                            # an all-zero row
    bits, scales = quantize(weight)
    assert bits.dtype == torch.uint8 and bits.shape == weight.shape and scales.shape == (64, 1)
    assert torch.equal(torch.exp2(torch.log2(scales).round()), scales)      # powers of two
    q = bits.view(FP8).float()
    assert q.abs().max() <= 448 and (q.abs().amax(dim=1)[scales[:, 0] != 1] >= 224).all()   # each row in its top binade
    assert torch.equal(dequantize(bits, scales, torch.float32), q * scales)
    # bf16 compute sees exactly the fp8 value: the dequantisation adds no rounding of its own
    assert torch.equal(dequantize(bits, scales.bfloat16(), torch.bfloat16).float(), q * scales)
    error = (dequantize(bits, scales, torch.float32) - weight).norm(dim=1) / weight.norm(dim=1).clamp_min(1e-30)
    assert error[weight.norm(dim=1) > 0].max() < 0.05 and torch.equal(dequantize(bits, scales, torch.float32)[5],
                                                                        torch.zeros(48))


def test_base_weight_bytes():
    assert base_weight_bytes(5120 * 5120, 5120, "fp8") == 5120 * 5120 + 2 * 5120   # 1 + 2/in_features per value
    assert base_weight_bytes(5120 * 5120, 5120, "fp8", compute="fp32") == 5120 * 5120 + 4 * 5120
    assert base_weight_bytes(100, 10, "bf16") == 200 and base_weight_bytes(100, 10, "fp32") == 400


# ----------------------------------------------------------------------------- training

@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_base_follows_the_bf16_base(toy_dir, tmp_path, family):
    runs = lora_run(toy_dir, tmp_path, family, **{"train.precision": "bf16", "train.batch_size": 2,
                                                   "train.max_steps": FOLLOW_STEPS})
    _, bf16 = train_losses(runs, tmp_path / "bf16", FOLLOW_STEPS)
    _, fp8 = train_losses(runs + ["lora.base_dtype=fp8"], tmp_path / "fp8", FOLLOW_STEPS)
    relative = np.abs(np.array(fp8) - np.array(bf16)) / np.abs(np.array(bf16))
    print(f"{family}: fp8 vs bf16 base, max relative loss difference {relative.max():.2e} over {FOLLOW_STEPS} steps")
    assert relative.max() < FOLLOW_TOLERANCE, relative.max()
    assert np.mean(bf16[-10:]) < np.mean(bf16[:10]) and np.mean(fp8[-10:]) < np.mean(fp8[:10])   # both learn


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_block_weights_are_float8_in_memory_and_nothing_dequantised_is_kept(toy_dir, tmp_path, family, precision):
    runs = lora_run(toy_dir, tmp_path, family, **{"train.precision": precision})
    auto = Trainer(load_config("tiny", runs), tmp_path / "auto")
    fp8 = Trainer(load_config("tiny", runs + ["lora.base_dtype=fp8"]), tmp_path / "fp8")
    layers = fp8_layers(fp8.model)
    plain = dict(auto.model.named_modules())
    compute = torch.bfloat16 if precision == "bf16" else torch.float32
    # every Linear of every block is fp8: adapted ones (peft's base_layer) and the others
    inside = {id(m) for block in auto.model.blocks for m in block.modules()}
    block_linears = {name for name, m in auto.model.named_modules()
                     if isinstance(m, torch.nn.Linear) and id(m) in inside and ".lora_" not in name}
    fp8_paths = {name for name, m in fp8.model.named_modules() if isinstance(m, Float8BaseLinear)}
    assert fp8_paths == block_linears
    assert all(m.weight_fp8.dtype == torch.uint8 and m.weight_fp8.untyped_storage().nbytes() == m.weight_fp8.numel()
               and m.weight_scale.dtype == compute for m in layers)
    assert any(path.endswith(".base_layer") for path in fp8_paths)
    assert any(not path.endswith(".base_layer") for path in fp8_paths)      # layers without adapters too
    for path in fp8_paths:   # the fp8 copy is of the base weight: within e4m3's rounding
        exact, layer = plain[path].weight.float(), fp8.model.get_submodule(path)
        assert ((layer.weight.float() - exact).norm() / exact.norm()).item() < 0.05
    # what stays out of fp8 is held as lora.base_dtype=auto holds it
    kept = {n: p for n, p in fp8.model.named_parameters() if not is_adapter_name(n) and p.dtype != torch.uint8}
    assert kept and all(p.dtype == compute for p in kept.values())
    # bytes: the formula the planner uses, against the storages
    frozen_auto = tensor_bytes(p for n, p in auto.model.named_parameters() if not is_adapter_name(n))
    fp8_bytes = sum(base_weight_bytes(m.weight_fp8.numel(), m.out_features, "fp8", compute=precision) for m in layers)
    assert fp8_storage_bytes(fp8.model) == fp8_bytes
    frozen_fp8 = tensor_bytes(p for n, p in fp8.model.named_parameters() if not is_adapter_name(n))
    quantised = sum(m.weight_fp8.numel() for m in layers)
    bias_and_rest = frozen_fp8 - fp8_bytes
    assert frozen_auto == quantised * compute.itemsize + bias_and_rest   # the weights, and only they, shrank
    # one step under LiveMemory: the activations held for backward are those of the bf16/fp32 base
    # (the fp8 layers keep their bits, not a dequantised weight); the peak adds one layer's weight at most
    batch = synthetic_batch(2, 4, 16, 16)
    a, f = measure_trainer(auto, batch), measure_trainer(fp8, batch)
    largest = max(m.weight_fp8.numel() for m in layers) * compute.itemsize
    assert f.activations == a.activations and f.peak <= a.peak + largest, (f, a)
    assert f.params == tensor_bytes(fp8.model.parameters()) < a.params
    assert f.grads == a.grads and f.optimizer == a.optimizer                               # adapters only, fp32


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_resume_is_bitwise_and_checkpoints_hold_the_adapters_only(toy_dir, tmp_path, family):
    runs = lora_run(toy_dir, tmp_path, family, **{"train.max_steps": 4, "train.batch_size": 2,
                                                   "train.deterministic": True}) + ["lora.base_dtype=fp8"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(["train", "--out", str(straight), *runs]) == 0
    assert main(["train", "--out", str(split), *runs, "train.max_steps=2"]) == 0
    assert main(["train", "--out", str(split), *runs, "resume=auto"]) == 0
    losses = [[json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
              for run in (straight, split)]
    assert losses[0] == losses[1] and len(losses[0]) == 4                                  # bitwise
    for stem in ("model", "ema"):
        a = load_file(straight / f"checkpoints/step-0000004/{stem}.safetensors")
        b = load_file(split / f"checkpoints/step-0000004/{stem}.safetensors")
        assert a and all(is_adapter_name(k) and v.dtype == torch.float32 for k, v in a.items())   # adapters only
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    optimizer = torch.load(straight / "checkpoints/step-0000004/optimizer.pt", weights_only=False)
    assert optimizer["state"] and all(is_adapter_name(name) for name in optimizer["state"])


def test_ema_and_optimizer_never_see_the_fp8_storage(toy_dir, tmp_path):
    runs = lora_run(toy_dir, tmp_path, "wan", **{"train.precision": "bf16"}) + ["lora.base_dtype=fp8"]
    trainer, _ = train_losses(runs, tmp_path / "run", 2)
    adapters = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert adapters and all(is_adapter_name(n) for n in adapters)
    assert set(trainer.ema.shadow) == adapters and all(v.dtype == torch.float32 for v in trainer.ema.shadow.values())
    optimized = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in optimized} == {id(p) for n, p in trainer.model.named_parameters() if n in adapters}
    assert all(v.dtype == torch.float32 for s in trainer.optimizer.state.values() for v in s.values() if v.dim())


@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_and_merge_read_the_full_precision_base(toy_dir, tmp_path, family):
    runs = lora_run(toy_dir, tmp_path, family, **{"train.max_steps": 2}) + ["lora.base_dtype=fp8"]
    run = tmp_path / "run"
    assert main(["train", "--out", str(run), *runs]) == 0
    adapted = Pipeline(run)
    assert not fp8_layers(adapted.model) and all(p.dtype == torch.float32 for p in adapted.model.parameters())
    full, _ = init_weights(load_config("tiny", runs).model.init_from)   # the base as stored
    own = {base_name(n): t for n, t in adapted.model.state_dict().items() if not is_adapter_name(n)}
    assert own.keys() == full.keys() and all(torch.equal(own[k], full[k].float()) for k in full)   # not an fp8 copy
    merged = load_file(export(run, tmp_path / "merged", merge_lora=True) / "model.safetensors")
    ckpt = load_file(run / "checkpoints/step-0000002/model.safetensors")
    # a layer without adapters is the base's weight bit for bit; an adapted one is base + B @ A (alpha = rank)
    adapted_keys = {f"{k.split('.lora_A.')[0]}.weight" for k in ckpt if ".lora_A." in k}
    assert adapted_keys and merged.keys() == full.keys() and all(t.dtype == torch.float32 for t in merged.values())
    for key in full:
        if key not in adapted_keys:
            assert torch.equal(merged[key], full[key].float()), key
        else:
            stem = key.removesuffix(".weight")
            delta = ckpt[f"{stem}.lora_B.default.weight"] @ ckpt[f"{stem}.lora_A.default.weight"]
            torch.testing.assert_close(merged[key], full[key] + delta, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- layers of parallelism

@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_base_with_activation_checkpointing_matches_without(toy_dir, tmp_path, family):
    runs = lora_run(toy_dir, tmp_path, family, **{"train.batch_size": 2}) + ["lora.base_dtype=fp8"]
    plain, a = train_losses(runs, tmp_path / "plain", 3)
    ckpt, b = train_losses(runs + ["memory.checkpointing=full"], tmp_path / "ckpt", 3)
    assert a == b                                                                          # bitwise
    for (name, p), q in zip(plain.model.named_parameters(), ckpt.model.parameters()):
        assert torch.equal(p, q), name


def test_fp8_base_under_fsdp2_is_sharded_and_matches_one_process(toy_dir, tmp_path):
    """2 gloo processes against one process on the same global batch (grad_accum=2), as
    tests/parallel/test_lora_parallel.py: FSDP2 on both families and FSDP2 with full checkpointing
    in fp32 (adapters within 1e-6 after 3 steps, the fp8 bits and scales bitwise), and FSDP2 under
    bf16 (losses within 1e-2 relative: bf16 sums in another order). Each rank holds half of the fp8
    storage (rows sharded with their scales), and the gathered copy a layer computes with is still
    uint8 bits: FSDP2's bf16 mixed precision does not cast them."""
    def runs_of(family, **extra):
        return lora_run(toy_dir, tmp_path, family, **{"train.lr": 1e-3, "train.warmup_steps": 1, "train.ema_decay": 0,
                                                      "train.batch_size": 2, **extra}) + ["lora.base_dtype=fp8"]
    runs = {"stdit": runs_of("stdit"), "wan": runs_of("wan"), "wan_bf16": runs_of("wan", **{"train.precision": "bf16"})}
    layouts = {f"{family}_fsdp": r + ["parallel.dp_shard=2"] for family, r in runs.items()}
    layouts["stdit_fsdp_checkpointing"] = runs["stdit"] + ["parallel.dp_shard=2", "memory.checkpointing=full"]
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"out": str(tmp_path), "runs": [{"name": n, "overrides": o, "steps": 3}
                                                               for n, o in layouts.items()]}))
    result = torchrun(2, str(WORKER), str(spec), timeout=500)
    assert result.returncode == 0, result.stderr[-3000:]
    for family, overrides in runs.items():
        one, losses = train_losses(overrides + ["train.grad_accum=2"], tmp_path / f"one-{family}", 3)
        weights = {k: v.detach().clone() for k, v in one.model.state_dict().items()}
        whole = fp8_storage_bytes(one.model)
        compute = "torch.bfloat16" if family.endswith("bf16") else "torch.float32"
        for name in [n for n in layouts if n.startswith(f"{family}_fsdp")]:
            got = torch.load(tmp_path / f"{name}.pt")
            adapters = [k for k in weights if is_adapter_name(k)]
            assert got["weights"].keys() == weights.keys()
            assert all(torch.equal(got["weights"][k], weights[k]) for k in weights if k not in adapters), name
            if compute == "torch.float32":
                assert got["losses"] == pytest.approx(losses, rel=1e-5), name
                worst = max((got["weights"][k] - weights[k]).abs().max().item() for k in adapters)
                assert worst < 1e-6, (name, worst)
            else:
                assert got["losses"] == pytest.approx(losses, rel=1e-2), name
            shards = [local for local, _ in got["ranks"]]
            print(f"{name}: fp8 storage per rank {shards} of {whole} bytes")
            assert sum(shards) == whole and max(shards) <= 0.55 * whole, (shards, whole)   # sharded, not replicated
            assert all(placements == ["(Shard(dim=0),)"] for _, placements in got["ranks"]), got["ranks"]
            assert got["gathered"] == [("torch.uint8", compute)], got["gathered"]


# ----------------------------------------------------------------------------- refusals

def test_base_dtype_refusals_are_one_line(toy_dir, tmp_path, capsys):
    overrides = tiny_overrides(toy_dir)
    assert main(["train", "--out", str(tmp_path / "a"), *overrides, "lora.base_dtype=fp8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: lora.base_dtype=fp8 sets how a LoRA run holds its frozen base")
    assert err.count("\n") == 1
    runs = lora_run(toy_dir, tmp_path, "stdit")
    assert main(["train", "--out", str(tmp_path / "b"), *runs, "lora.base_dtype=bf16", "train.precision=fp32"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: lora.base_dtype=bf16 needs bf16 compute") and err.count("\n") == 1
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    with pytest.raises(UserError, match=r"^lora.base_dtype=fp8 does not work with parallel.tp=2 .*parallel.dp_shard"):
        check_base_dtype(load_config("tiny", runs + ["lora.base_dtype=fp8", "parallel.tp=2"]), True)
