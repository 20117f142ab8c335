"""The planner's LoRA model against measurement (one training step of the real Trainer under
``LiveMemory``, fp32 on CPU): the frozen base, the adapters with their gradients and AdamW
state, and the activations (a frozen layer keeps no input for its weight's gradient; adapters
keep their rank-wide intermediates) within 5%; and what ``videodit plan`` says for Open-Sora 1.2
XL LoRA on a 24 GiB GPU."""

import json

import pytest
import torch

from conftest import tiny_overrides
from videodit.cli import main
from videodit.components import model_geometry
from videodit.config import load_config
from videodit.models.stdit.model import STDiT
from videodit.planner.measure import measure_trainer, synthetic_batch
from videodit.planner.plan import planner_from_config
from videodit.train.trainer import Trainer

TOLERANCE = 0.05
CATEGORIES = ("activations", "params", "grads", "optimizer")


def preset_overrides(toy_dir, preset: str, **extra) -> list[str]:
    return [o for o in tiny_overrides(toy_dir, **{"model.preset": preset, "train.precision": "fp32", **extra})
            if not o.startswith(("model.depth", "model.hidden_size", "model.num_heads", "model.patch_size"))]


@pytest.fixture(scope="module")
def bases(tmp_path_factory, toy_dir):
    """Base model folders of the tiny and S presets (random weights)."""
    folders = {}
    for preset in ("tiny", "S"):
        cfg = load_config("tiny", preset_overrides(toy_dir, preset))
        torch.manual_seed(0)
        folders[preset] = STDiT(model_geometry(cfg, 3, cfg.text.dim)).save_pretrained(
            tmp_path_factory.mktemp(f"base-{preset}"))
    return folders


# (preset, extra overrides, (batch, frames, height, width))
CASES = {
    "S-video-rank16": ("S", {}, (2, 8, 32, 32)),
    "S-image-full-checkpointing": ("S", {"memory.checkpointing": "full"}, (4, 1, 64, 48)),
    "tiny-video-selective-every-2-dropout": ("tiny", {"memory.checkpointing": "selective",
                                                      "memory.checkpoint_every": 2, "lora.dropout": 0.1},
                                             (4, 8, 16, 16)),
    "tiny-video-cross-attention-targets": ("tiny", {"lora.targets": "[attn.q, attn.v, cross_attn.q, cross_attn.k, "
                                                                    "cross_attn.v, cross_attn.proj, mlp.fc2]"},
                                           (4, 8, 16, 16)),
}


@pytest.mark.parametrize("name", CASES)
def test_lora_planner_matches_measurement(name, bases, toy_dir, tmp_path):
    preset, extra, shape = CASES[name]
    overrides = preset_overrides(toy_dir, preset, **{"lora.rank": 16, "model.init_from": str(bases[preset]), **extra})
    cfg = load_config("tiny", overrides)
    trainer = Trainer(cfg, tmp_path / "run")
    measured = measure_trainer(trainer, synthetic_batch(*shape)).as_dict()
    predicted = planner_from_config(cfg, gpu_bytes=1).estimate(*shape).as_dict()
    for key in CATEGORIES:
        ratio = predicted[key] / measured[key]
        assert abs(ratio - 1) <= TOLERANCE, f"{name}: {key} predicted/measured = {ratio:.3f}"
    assert measured["grads"] * 5 < measured["params"]            # only the adapters have gradients
    assert measured["peak"] <= predicted["activations"] + predicted["temporaries"] + predicted["grads"] \
        + predicted["optimizer"]


def plan(argv, capsys) -> dict:
    assert main(["plan", "opensora-v1.2-stage1", "--latent", "opensora-v1.2", "--caption", "4096,300",
                 "--json", *argv]) == 0
    out = json.loads(capsys.readouterr().out)
    return {(b["resolution"], b["num_frames"]): b for b in out["buckets"]} | {"model": out["model"]}


def test_xl_lora_from_the_cache_fits_360p_51_and_240p_102_in_24_gib(capsys):
    lora = plan(["lora.rank=16", "--gpu-mem", "24GiB", "--encoders-cached"], capsys)
    assert lora["model"]["lora_rank"] == 16 and lora["model"]["adapter_params"] == 18_579_456
    assert lora["model"]["params_bytes"] < 1.21e9 * 2 + 18_579_456 * 4 + 1   # a bf16 base, fp32 adapters
    for key in (("360p", 51), ("240p", 102)):
        assert lora[key]["max_batch_size"] >= 1, key
        assert lora[key]["predicted_peak_bytes"] <= 0.9 * 24 * 2**30
    full = plan(["--gpu-mem", "24GiB", "--encoders-cached"], capsys)
    assert not any(b["max_batch_size"] for k, b in full.items() if k != "model")   # full fine-tuning: nothing fits
