"""The memory planner against measurement, and the plan/tune commands.

Measurement: one training step of the real Trainer under ``LiveMemory`` (every tensor
storage created and still alive), fp32 on CPU. The planner must agree within 10% on
activations, parameters, gradients and optimizer state.
"""

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from conftest import tiny_overrides, torchrun
from videodit.cli import main
from videodit.config import load_config
from videodit.models.stdit.temporal_vae import latent_frames
from videodit.planner.estimate import Parallel, Precision, block_activation_bytes
from videodit.planner.measure import LiveMemory, measure_trainer, synthetic_batch
from videodit.planner.plan import LatentGeometry, planner_from_config
from videodit.planner.report import parse_bytes
from videodit.planner.tune import search_max_batch
from videodit.train.trainer import Trainer

TOLERANCE = 0.10
CATEGORIES = ("activations", "params", "grads", "optimizer")
WORKER = Path(__file__).parents[1] / "parallel" / "workers" / "memory_worker.py"


def preset_overrides(toy_dir, preset: str, **extra) -> list[str]:
    """The unit-test run settings with the model preset's real geometry (not the test's tiny one)."""
    return [o for o in tiny_overrides(toy_dir, **{"model.preset": preset, "train.precision": "fp32", **extra})
            if not o.startswith(("model.depth", "model.hidden_size", "model.num_heads", "model.patch_size"))]


def assert_close(measured: dict, predicted: dict, label: str) -> None:
    for key in CATEGORIES:
        ratio = predicted[key] / measured[key]
        assert abs(ratio - 1) <= TOLERANCE, f"{label}: {key} predicted/measured = {ratio:.3f}"


# (preset, extra overrides, (batch, frames, height, width)) on one process
SINGLE = {
    "tiny-video": ("tiny", {}, (4, 8, 16, 16)),
    "tiny-video-full-checkpointing": ("tiny", {"memory.checkpointing": "full"}, (4, 8, 16, 16)),
    "tiny-image": ("tiny", {}, (8, 1, 32, 32)),
    "tiny-video-selective-every-2": ("tiny", {"memory.checkpointing": "selective", "memory.checkpoint_every": 2},
                                     (4, 8, 16, 16)),
    "S-video": ("S", {}, (2, 8, 32, 32)),

    "S-image-full-checkpointing": ("S", {"memory.checkpointing": "full"}, (4, 1, 64, 48)),
}


@pytest.mark.parametrize("name", SINGLE)
def test_planner_matches_measurement_on_one_process(name, toy_dir, tmp_path):
    preset, extra, (batch, frames, height, width) = SINGLE[name]
    cfg = load_config("tiny", preset_overrides(toy_dir, preset, **extra))
    trainer = Trainer(cfg, tmp_path / "run")
    measured = measure_trainer(trainer, synthetic_batch(batch, frames, height, width)).as_dict()
    predicted = planner_from_config(cfg, gpu_bytes=1).estimate(batch, frames, height, width).as_dict()
    assert_close(measured, predicted, name)
    # Peak: the prediction is an upper bound (it adds the categories), but not a loose one.
    assert measured["peak"] <= predicted["activations"] + predicted["temporaries"] + predicted["grads"] \
        + predicted["optimizer"]


def test_planner_counts_8bit_adamw_as_measured(toy_dir, tmp_path):
    """train.optimizer=adamw8bit: two 8-bit moments and their block scales per parameter; the
    planner counts every trained parameter so (the S preset's tensors are nearly all large
    enough to be quantized; small ones keep fp32 moments, which the planner leaves out)."""
    cfg = load_config("tiny", preset_overrides(toy_dir, "S", **{"train.optimizer": "adamw8bit"}))
    measured = measure_trainer(Trainer(cfg, tmp_path / "run"), synthetic_batch(2, 4, 16, 16)).as_dict()
    predicted = planner_from_config(cfg, gpu_bytes=1).estimate(2, 4, 16, 16).as_dict()
    assert_close(measured, predicted, "adamw8bit")
    assert abs(predicted["optimizer"] / measured["optimizer"] - 1) <= 0.05
    assert planner_from_config(cfg, gpu_bytes=1).levers.describe() == ["train.optimizer=adamw8bit"]


def test_planner_holds_both_experts_and_trains_one(toy_dir, tmp_path):
    """model.expert=both: both experts' weights are held, one expert's gradients and activations
    per step; the other's optimizer state appears at its first step (the plan is the steady state)."""
    cfg = load_config("tiny", preset_overrides(toy_dir, "wan-tiny", **{
        "model.expert": "both", "model.expert_boundary": 0.5, "text.max_length": 16}))
    measured = measure_trainer(Trainer(cfg, tmp_path / "run"), synthetic_batch(2, 4, 16, 16)).as_dict()
    predicted = planner_from_config(cfg, gpu_bytes=1).estimate(2, 4, 16, 16).as_dict()
    assert_close(measured, {**predicted, "optimizer": predicted["optimizer"] / 2}, "both experts")
    one = planner_from_config(load_config("tiny", preset_overrides(toy_dir, "wan-tiny", **{"text.max_length": 16})),
                              gpu_bytes=1).estimate(2, 4, 16, 16).as_dict()
    assert (predicted["params"], predicted["optimizer"], predicted["grads"]) == \
        (2 * one["params"], 2 * one["optimizer"], one["grads"])


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_planner_matches_measurement_with_sequence_parallel(checkpointing, toy_dir):
    # dp_shard=1: the SP ranks replicate the weights (DDP), so the activations are SP's alone;
    # FSDP's gathered weights would count there too, where LiveMemory files them.
    overrides = preset_overrides(toy_dir, "tiny", **{"parallel.sp": 2, "parallel.dp_shard": 1,
                                                     "memory.checkpointing": checkpointing})
    spec = json.dumps({"overrides": overrides, "shape": [4, 8, 16, 16]})
    result = torchrun(2, str(WORKER), spec)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 2
    for report in reports:
        assert_close(report["measured"], report["predicted"], f"sp=2 rank {report['rank']}")


# Family x checkpointing: the activation table comes from the family (models/<family>/activations.py).
# wan-ti2v: TI2V's image frame given (every sample, here), so the time embedding and the modulation
# are per token.
FAMILY_ACTIVATIONS = {"wan": ("wan-tiny", (2, 8, 32, 32), 0.05, {}),
                      "wan-ti2v": ("wan-tiny", (2, 8, 32, 32), 0.05,
                                   {"model.task": "ti2v", "diffusion.mask_ratios": "{'image_head': 1.0}"})}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", ["none", "selective", "full"])
@pytest.mark.parametrize("family", FAMILY_ACTIVATIONS)
def test_family_activations_match_measurement(family, checkpointing, precision, toy_dir, tmp_path):
    # Wan keeps its residual stream, modulation, norms and gate products in fp32 under autocast,
    # copies the modulated input per projection and attends text_len caption tokens.
    preset, (batch, frames, height, width), tolerance, extra = FAMILY_ACTIVATIONS[family]
    cfg = load_config("tiny", preset_overrides(toy_dir, preset, **{"memory.checkpointing": checkpointing,
                                                                    "train.precision": precision, **extra}))
    trainer = Trainer(cfg, tmp_path / "run")
    measured = measure_trainer(trainer, synthetic_batch(batch, frames, height, width)).activations
    predicted = planner_from_config(cfg, gpu_bytes=1).estimate(batch, frames, height, width).activations
    assert abs(predicted / measured - 1) <= tolerance, f"{family} {checkpointing} {precision}: {predicted / measured:.3f}"


def test_live_memory_sees_only_new_storages():
    import torch
    weight = torch.randn(64, 64)
    with LiveMemory() as tracker:
        view = weight.t()                      # a view of existing memory: nothing new
        assert tracker.live == 0
        product = view @ torch.ones(64, 8)     # two new tensors, one freed right away
        assert tracker.live == product.untyped_storage().nbytes()
        del product
        assert tracker.live == 0
    assert tracker.peak >= 64 * 8 * 4 * 2


def test_checkpointing_levers_order_the_activation_bytes():
    from videodit.models.stdit.model import DiTGeometry
    g = DiTGeometry(in_channels=4, caption_channels=64, caption_length=8, depth=2, hidden_size=128, num_heads=4)
    args = (g, 4096, 4, 8, Parallel(), Precision())
    plain, selective, full = (block_activation_bytes(*args, mode=m) for m in ("none", "selective", "full"))
    assert full < selective < plain
    assert block_activation_bytes(*args, mode="none", compression="fp8") == pytest.approx(plain / 4)
    tp2 = block_activation_bytes(g, 4096, 4, 8, Parallel(tp=2), Precision())
    assert plain / 2 < tp2 < plain


@pytest.mark.parametrize("every, fraction", [(1, 0.5), (2, 1.0), (3, 1.0), (1, 0.25)])
def test_pipeline_checkpointing_counts_blocks_per_rank_as_parallelize_does(every, fraction):
    # parallelize() checkpoints each rank's stage module, so checkpoint_every/_fraction pick
    # among that rank's blocks; the planner's first stage must hold what that rank really keeps.
    from videodit.config import MemoryConfig
    from videodit.models.stdit.model import DiTGeometry, STDiT
    from videodit.parallel.activation_checkpoint import apply_activation_checkpointing
    from videodit.planner.estimate import Shape, activation_bytes

    g = DiTGeometry(in_channels=4, caption_channels=16, caption_length=4, depth=8, hidden_size=32, num_heads=2)
    memory = MemoryConfig(checkpointing="full", checkpoint_every=every, checkpoint_fraction=fraction)
    first_stage = STDiT(dataclasses.replace(g, depth=g.depth // 2))   # the rank's module: half the blocks
    chosen = apply_activation_checkpointing(first_stage, memory)
    blocks = len(STDiT(g).blocks)   # spatial and temporal: 2 per depth
    _, detail = activation_bytes(g, Shape(2, 2, 8, 8, 4, 4), Parallel(pp=2, microbatches=2, in_flight=2),
                                 Precision(), memory, blocks)
    assert detail["blocks_on_rank"] == len(first_stage.blocks) == blocks // 2
    assert detail["checkpointed_blocks"] == len(chosen)


# ---------------------------------------------------------------------------- the command


def test_plan_json_lists_every_bucket_and_fits_the_budget(toy_dir, capsys):
    overrides = preset_overrides(toy_dir, "tiny", **{"data.bucket_config": "{24px: {1: [1.0, 16], 8: [1.0, 16]}, "
                                                                           "16px: {8: [1.0, 32]}}"})
    assert main(["plan", *overrides, "--gpu-mem", "2GiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["num_params"] > 1_000_000
    rows = {(b["resolution"], b["num_frames"]): b for b in out["buckets"]}
    assert set(rows) == {("24px", 1), ("24px", 8), ("16px", 8)}
    for b in rows.values():
        assert 0 < b["predicted_peak_bytes"] <= 0.9 * 2 * 2**30
        assert b["max_batch_size"] >= 1
        assert b["hardware_flops_per_sample"] >= b["model_flops_per_sample"] > 0
    # More tokens per sample: fewer samples fit, more FLOPs per sample.
    assert rows[("24px", 8)]["max_batch_size"] < rows[("24px", 1)]["max_batch_size"]
    assert rows[("24px", 8)]["model_flops_per_sample"] > rows[("24px", 1)]["model_flops_per_sample"]


def test_plan_names_the_cheapest_fix_and_writes_a_loadable_bucket_config(toy_dir, tmp_path, capsys):
    out_file = tmp_path / "buckets.yaml"
    overrides = preset_overrides(toy_dir, "S", **{"data.bucket_config": "{64px: {8: [1.0, 4]}, 16px: {8: [1.0, 4]}}"})
    assert main(["plan", *overrides, "--gpu-mem", "3GiB", "--write-bucket-config", str(out_file)]) == 0
    table = capsys.readouterr().out
    assert "TFLOP/sample" in table.splitlines()[1]
    assert "does not fit at batch 1; try memory.checkpointing=full (all blocks)" in table
    written = yaml.safe_load(out_file.read_text())["bucket_config"]
    assert written["64px"][8] == [0.0, None]           # switched off: nothing fits
    assert written["16px"][8][1] >= 1
    cfg = load_config("tiny", [*overrides[:1], f"data.bucket_config_file={out_file}"])
    assert cfg.data.bucket_config_file == str(out_file)


def test_plan_equal_step_time_gives_short_clips_bigger_batches(toy_dir, capsys):
    overrides = preset_overrides(toy_dir, "tiny", **{"data.bucket_config": "{16px: {1: [1.0, 8], 8: [1.0, 8]}, "
                                                                           "24px: {8: [1.0, 8]}}"})
    assert main(["plan", *overrides, "--gpu-mem", "1GiB", "--json", "--equal-step-time"]) == 0
    rows = {(b["resolution"], b["num_frames"]): b for b in json.loads(capsys.readouterr().out)["buckets"]}
    assert rows[("16px", 1)]["batch_size"] > rows[("16px", 8)]["batch_size"] > rows[("24px", 8)]["batch_size"]
    flops = [b["step_flops"] for b in rows.values()]
    assert max(flops) / min(flops) < 1.15                       # about equal work per step
    assert all(b["batch_size"] <= b["max_batch_size"] for b in rows.values())


def test_xl_stage1_plan_runs_with_opensora_geometry(capsys):
    assert main(["plan", "opensora-v1.2-stage1", "--gpu-mem", "80GiB", "--latent", "opensora-v1.2",
                 "--caption", "4096,300", "--encoder-mem", "10GB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["num_params"] == 1_208_854_288   # the opensora-v1.2 model (docs/opensora.md)
    assert {b["resolution"] for b in out["buckets"]} >= {"144p", "240p", "360p", "2048"}


@pytest.mark.parametrize("argv, message", [
    (["--gpu-mem", "80 gigs"], "memory size '80 gigs' is not understood"),
    (["--gpu-mem", "80GiB", "--latent", "4,8"],
     "--latent '4,8' must be a known VAE (opensora-v1.2, wan2.1, wan2.2, hunyuan, opensora-dc-ae, ltx2) or three integers"),
    (["--gpu-mem", "80GiB", "--caption", "4096"], "--caption '4096' must be two integers"),
    (["--gpu-mem", "80GiB", "--margin", "1.5"], "--margin 1.5 must be in [0, 1)"),
    (["--gpu-mem", "80GiB", "vae.kind=diffusers", "vae.path=/x"], "give the latent geometry with --latent"),
])
def test_plan_bad_input_is_one_line(argv, message, capsys):
    assert main(["plan", "tiny", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_tune_without_gpu_says_so(capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: tune would run")
    assert main(["tune", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "videodit tune measures on a CUDA GPU and none is visible" in err and "videodit plan" in err


def test_parse_bytes_units():
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("1536 MiB") == 1536 * 2**20
    assert parse_bytes("1024") == 1024


def test_latent_geometry_follows_opensora_chunks():
    vae = LatentGeometry.parse("opensora-v1.2")
    # 17-frame pieces, each front-padded to a multiple of 4: 16 -> 4, 20 -> 5 + 1, 34 -> 5 + 5.
    assert [vae.frames(n) for n in (1, 4, 5, 16, 17, 20, 34, 51, 102)] == [1, 1, 2, 4, 5, 6, 10, 15, 30]
    assert all(vae.frames(n) == latent_frames(n) for n in range(1, 420))   # the VAE's own rule
    assert LatentGeometry.parse("4,4,8").frames(51) == 13


def test_opensora_vae_kind_needs_no_latent_option():
    cfg = load_config("opensora-v1.2-stage1")
    assert cfg.vae.kind == "opensora-v1.2"
    planner = planner_from_config(cfg, 80 * 2**30, caption=(4096, 300), encoder_bytes=0)
    assert planner.latent == LatentGeometry.parse("opensora-v1.2")


@pytest.mark.parametrize("capacity", [0, 1, 5, 37, 4096, 10**6])
@pytest.mark.parametrize("start", [1, 8, 100])
def test_tune_search_finds_the_largest_fitting_batch(capacity, start):
    tried = []

    def fits(batch):
        tried.append(batch)
        return batch <= capacity

    assert search_max_batch(fits, start=start, limit=4096) == min(capacity, 4096)
    assert len(tried) <= 2 * 13 + 2          # doubling then bisection: logarithmic
    assert search_max_batch(lambda b: b <= capacity, start=start, multiple=4) == min(capacity, 4096) // 4 * 4


def test_frozen_encoder_bytes_read_safetensors_headers_at_the_configured_dtype(tmp_path):
    # T5-XXL's files may be fp32 while text.dtype=bf16 loads half of that: the header's shapes
    # count, not the file size. A file that only looks like safetensors counts by its size.
    import torch
    from safetensors.torch import save_file

    from videodit.planner.plan import frozen_encoder_bytes

    save_file({"w": torch.zeros(100, 10), "b": torch.zeros(10)}, tmp_path / "model.safetensors")
    toy = frozen_encoder_bytes(load_config("tiny", []))   # the built-in toy text encoder
    sizes = {dtype: frozen_encoder_bytes(load_config("tiny", ["vae.kind=diffusers", f"vae.path={tmp_path}",
                                                             f"vae.dtype={dtype}"])) - toy
             for dtype in ("fp32", "bf16")}
    assert sizes == {"fp32": 1010 * 4, "bf16": 1010 * 2}
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 8 + b"not a header")
    assert frozen_encoder_bytes(load_config("tiny", ["vae.kind=diffusers", f"vae.path={tmp_path}"])) - toy == 20


@pytest.mark.parametrize("preset, num_params", [("wan2.1-t2v-1.3b", 1_418_996_800), ("wan2.1-t2v-14b", 14_288_491_584)])
def test_wan_presets_plan_without_latent_or_caption(preset, num_params, capsys):
    # vae.kind=wan2.1 and text.kind=umt5 are known geometry: 16 channels, 4x causal time, 8x
    # space; 4096-wide captions at text.max_length. 81 frames -> 21 latent frames, patch 1x2x2.
    overrides = [f"model.preset={preset}", "vae.kind=wan2.1", "text.kind=umt5", "text.max_length=512",
                 "data.num_frames=81", "data.height=480", "data.width=832", "train.precision=bf16"]
    planner = planner_from_config(load_config("tiny", overrides), 80 * 2**30)
    assert planner.latent == LatentGeometry.parse("wan2.1") == LatentGeometry(16, 4, 8)
    assert planner.caption_length == 512 and planner.geometry.text_dim == 4096
    assert planner.counts.num_params == num_params
    assert planner.shape(1, 81, 480, 832).tokens(planner.geometry) == 21 * 30 * 52 == 32_760
    assert planner.shape(1, 81, 720, 1280).tokens(planner.geometry) == 21 * 45 * 80 == 75_600
    assert [planner.latent.frames(n) for n in (1, 5, 17, 81)] == [1, 2, 5, 21]   # (T - 1) // 4 + 1
    assert main(["plan", "tiny", *overrides, "--gpu-mem", "80GiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["num_params"] == num_params
    assert [b["tokens"] for b in out["buckets"]] == [32_760]


@pytest.mark.parametrize("argv, message", [
    (["--gpu-mem", "1e300GiB"], "memory size '1e300GiB' is out of range; give 1 byte to 1024TiB"),
    (["--gpu-mem", "1" + "0" * 300 + "GiB"], "memory size '1000000000000000000000000000000000000...' is out"),
    (["--gpu-mem", "10^300GiB"], "memory size '10^300GiB' is not understood"),
    (["--gpu-mem", "0.5"], "memory size '0.5' is out of range"),
    (["--gpu-mem", "80GiB", "--encoder-mem", "1e30TB"], "memory size '1e30TB' is out of range"),
    (["--gpu-mem", "80GiB", "--world-size", "0"], "--world-size 0 is out of range; give 1 to 1,000,000 GPUs"),
    (["--gpu-mem", "80GiB", "--world-size", "-4"], "--world-size -4 is out of range"),
], ids=["1e300", "10**300", "caret", "half-byte", "encoder-mem", "world-0", "world-negative"])
def test_plan_out_of_range_sizes_are_one_line(argv, message, capsys):
    assert main(["plan", "tiny", *argv]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert message in err and "\n" not in err and len(err) < 200
    assert captured.out == ""


def test_parse_bytes_range_and_exponents():
    from videodit.errors import UserError
    assert parse_bytes("8e10") == 8 * 10**10
    assert parse_bytes("1024TiB") == 2**50
    with pytest.raises(UserError, match="out of range"):
        parse_bytes("1025TiB")
