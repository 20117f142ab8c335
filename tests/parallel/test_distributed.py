"""Multi-process training on CPU with gloo (torchrun, 2 and 4 processes, tiny model, fp32):
data, sequence, tensor and pipeline parallelism and their hybrids.

Each layout trains a few steps and must match one process trained on the same global
batch (grad_accum = the data-parallel size): the noise of a batch is seeded by its global
index, so both draw the same noise. Tolerance: parameters within 1e-6 absolute after 3
AdamW steps at lr 1e-3 (the observed difference is ~1e-7, from summation order).
"""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_overrides, torchrun
from videodit.cli import main
from videodit.config import load_config
from videodit.train.trainer import Trainer

WORKER = Path(__file__).parent / "workers" / "worker.py"
TOLERANCE = 1e-6
STEPS = 3


def base(toy_dir, **extra):
    # 4 heads so that SP=2 splits them; batch 2 keeps every run inside epoch 0.
    values = {"model.num_heads": 4, "train.lr": 1e-3, "train.warmup_steps": 1, "train.ema_decay": 0,
              "train.batch_size": 2, **extra}
    return tiny_overrides(toy_dir, **values)


def run_layouts(toy_dir, tmp_path, nproc: int, runs: dict[str, list[str]], steps: int = STEPS,
                options: dict[str, dict] | None = None) -> dict[str, dict]:
    """``options``: a run's further worker keys, by name (``{"fsdp": "torch_defaults"}``)."""
    spec = {"out": str(tmp_path), "runs": [{"name": name, "overrides": overrides, "steps": steps,
                                            **(options or {}).get(name, {})} for name, overrides in runs.items()]}
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec))
    result = torchrun(nproc, str(WORKER), str(spec_file))
    assert result.returncode == 0, result.stderr[-3000:]
    return {name: torch.load(tmp_path / f"{name}.pt") for name in runs}


def single_process(overrides: list[str], run_dir: Path, steps: int = STEPS) -> tuple[dict, list[float]]:
    trainer = Trainer(load_config("tiny", overrides), run_dir)
    batches = trainer.batches()
    accum = trainer.cfg.train.grad_accum
    losses = [trainer.train_step([next(batches) for _ in range(accum)])[0] for _ in range(steps)]
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, losses


def assert_matches(got: dict, reference: tuple[dict, list[float]], noise_only: str | None = None) -> None:
    """``noise_only``: a regex of parameters whose true gradient is zero, left out: AdamW normalises
    their rounding-noise gradients into updates that differ with the summation order."""
    weights, losses = reference
    assert got["losses"] == pytest.approx(losses, rel=1e-5)
    compared = [k for k in weights if noise_only is None or not re.search(noise_only, k)]
    worst = max((got["weights"][k] - weights[k]).abs().max().item() for k in compared)
    assert worst < TOLERANCE, worst


# On images (one frame) temporal attention attends to itself alone: its softmax is 1 whatever q
# and k are, so their gradients are zero up to rounding.
IMAGE_NOISE_ONLY = r"^temporal_blocks\.\d+\.attn\.(q|k|q_norm|k_norm)\."


def seeds_by_rank(got: dict) -> list[list]:
    return [[step[0] for step in rank] for rank in got["keys"]]


def test_two_processes_match_one(toy_dir, tmp_path):
    video, image = base(toy_dir), base(toy_dir, **{"data.num_frames": 1})
    got = run_layouts(toy_dir, tmp_path, 2, {
        "ddp": video + ["parallel.dp_replicate=2", "parallel.dp_shard=1"],
        "fsdp": video + ["parallel.dp_shard=2"],
        "fsdp_zero2": video + ["zero_stage=2"],
        "fsdp_accum": video + ["parallel.dp_shard=2", "train.grad_accum=2"],
        "sp_video": video + ["parallel.sp=2"],
        "sp_image": image + ["parallel.sp=2"],
    })
    accum2 = single_process(video + ["train.grad_accum=2"], tmp_path / "ref2")
    for name in ("ddp", "fsdp", "fsdp_zero2"):
        assert_matches(got[name], accum2)
    assert_matches(got["fsdp_accum"], single_process(video + ["train.grad_accum=4"], tmp_path / "ref4"))
    assert_matches(got["sp_video"], single_process(video, tmp_path / "ref1"))
    assert_matches(got["sp_image"], single_process(image, tmp_path / "ref_image"), noise_only=IMAGE_NOISE_ONLY)
    # Data-parallel ranks see different batches; the ranks of one SP group the same ones.
    ddp = seeds_by_rank(got["ddp"])
    assert all(a != b for a, b in zip(*ddp))
    assert seeds_by_rank(got["sp_video"])[0] == seeds_by_rank(got["sp_video"])[1]
    assert "[2, 3, 1, 16, 16]" in got["sp_image"]["keys"][0][0][1]


# STDiT's blocks in execution order (model.depth=2): what FSDP2's prefetching must follow.
STDIT_BLOCKS = ["spatial_blocks.0", "temporal_blocks.0", "spatial_blocks.1", "temporal_blocks.1"]


def expected_schedule(blocks: list[str], *, reshard: bool) -> dict[str, dict]:
    """videodit's FSDP2 schedule (``parallelize.apply_fsdp``): every block reshards as
    ``parallel.reshard_after_forward`` says but the last, the root never; each block prefetches
    the next one in forward and the previous one in backward."""
    schedule = {"<root>": {"reshard": False, "forward": [], "backward": []}}
    for i, name in enumerate(blocks):
        schedule[name] = {"reshard": reshard and i < len(blocks) - 1, "forward": blocks[i + 1:i + 2],
                          "backward": blocks[max(i - 1, 0):i]}
    return schedule


def test_fsdp_schedule_is_the_policy_and_leaves_the_math_alone(toy_dir, tmp_path):
    """Issue #40: the prefetch and reshard settings apply_fsdp chooses are those FSDP2 runs with
    (ZeRO-3 and ZeRO-2-like), and they change when weights are gathered, not what is computed:
    two steps under dp_shard=2 match torch's defaults (implicit prefetch, root resharded) bit for bit."""
    video = base(toy_dir, **{"model.depth": 2})
    got = run_layouts(toy_dir, tmp_path, 2, {
        "fsdp": video + ["parallel.dp_shard=2"],
        "fsdp_torch_defaults": video + ["parallel.dp_shard=2"],
        "fsdp_zero2": video + ["zero_stage=2"],
    }, steps=2, options={"fsdp_torch_defaults": {"fsdp": "torch_defaults"}})
    assert got["fsdp"]["fsdp_schedule"] == expected_schedule(STDIT_BLOCKS, reshard=True)
    assert got["fsdp_zero2"]["fsdp_schedule"] == expected_schedule(STDIT_BLOCKS, reshard=False)
    defaults = got["fsdp_torch_defaults"]["fsdp_schedule"]
    assert defaults["<root>"]["reshard"] and not any(u["forward"] or u["backward"] for u in defaults.values())
    for name in ("fsdp_torch_defaults", "fsdp_zero2"):
        assert got[name]["losses"] == got["fsdp"]["losses"], name
        assert all(torch.equal(w, got[name]["weights"][k]) for k, w in got["fsdp"]["weights"].items()), name


def test_four_processes_hsdp_and_sp_times_dp(toy_dir, tmp_path):
    video = base(toy_dir)
    got = run_layouts(toy_dir, tmp_path, 4, {
        "hsdp": video + ["parallel.dp_replicate=2", "parallel.dp_shard=2"],
        "sp_dp": video + ["parallel.sp=2", "parallel.dp_shard=1", "parallel.dp_replicate=2"],
        "sp_fsdp": video + ["parallel.sp=2"],
    })
    assert_matches(got["hsdp"], single_process(video + ["train.grad_accum=4"], tmp_path / "ref4"))
    accum2 = single_process(video + ["train.grad_accum=2"], tmp_path / "ref2")
    assert_matches(got["sp_dp"], accum2)
    assert_matches(got["sp_fsdp"], accum2)
    for name in ("hsdp", "sp_fsdp"):   # the 2D mesh and the dp_shard x sp group: the same schedule
        assert got[name]["fsdp_schedule"] == expected_schedule(STDIT_BLOCKS[:2], reshard=True), name
    seeds = seeds_by_rank(got["sp_dp"])   # mesh order: ranks 0,1 form one SP group, 2,3 the other
    assert seeds[0] == seeds[1] and seeds[2] == seeds[3] and seeds[0] != seeds[2]


BUCKETS = "{'24px': {1: [1.0, 2], 4: [1.0, 2]}, '16px': {1: [1.0, 2], 4: [1.0, 2]}}"


def bucketed(toy_dir, **extra):
    """Two blocks pairs (four stages for an interleaved schedule), bucketed batches of 2."""
    return base(toy_dir, **{"model.depth": 2, "data.bucket_config": BUCKETS, **extra})


def shapes_seen(got: dict) -> set[str]:
    return {shape for step in got["keys"][0] for shape in step[1:]}


def pipeline_schedules(runs: list[str]) -> dict[str, list[str]]:
    """``runs`` under pp=2 with each schedule (interleaved: two stages per rank)."""
    return {"pp_gpipe": runs + ["parallel.pp=2", "parallel.pp_schedule=gpipe"],
            "pp_1f1b": runs + ["parallel.pp=2", "parallel.pp_schedule=1f1b"],
            "pp_interleaved": runs + ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b",
                                      "parallel.pp_microbatches=2"]}


def test_tensor_and_pipeline_parallel_match_one_process(mixed_toy, tmp_path):
    runs = bucketed(mixed_toy)
    got = run_layouts(mixed_toy, tmp_path, 2, {
        "tp": runs + ["parallel.tp=2"], **pipeline_schedules(runs)})
    reference = single_process(runs, tmp_path / "ref")
    for name in got:
        assert_matches(got[name], reference)
    assert len(shapes_seen(got["tp"])) >= 2, shapes_seen(got["tp"])   # the bucket shape changed


def test_pipeline_trains_with_frame_masks_as_one_process(mixed_toy, tmp_path):
    # Open-Sora's frame masks (diffusion.mask_ratios) under PP: the mask travels between the
    # stages with the per-frame adaLN input, and the last stage's loss leaves given frames out.
    masks = "{'image_head': 0.3, 'quarter_tail': 0.3, 'random': 0.2}"
    runs = bucketed(mixed_toy, **{"diffusion.mask_ratios": masks})
    got = run_layouts(mixed_toy, tmp_path, 2, pipeline_schedules(runs))
    reference = single_process(runs, tmp_path / "ref")
    for name in got:
        assert_matches(got[name], reference)
    unmasked = single_process(bucketed(mixed_toy), tmp_path / "unmasked")
    assert unmasked[1] != pytest.approx(reference[1], rel=1e-3)   # the masks did change the losses


def test_four_process_hybrids_match_one_process(mixed_toy, tmp_path):
    runs = bucketed(mixed_toy)
    got = run_layouts(mixed_toy, tmp_path, 4, {
        "tp_dp": runs + ["parallel.tp=2", "parallel.dp_shard=2"],
        "pp_dp": runs + ["parallel.pp=2", "parallel.dp_shard=2"],
        "sp_tp": runs + ["parallel.sp=2", "parallel.tp=2"],
    })
    accum2 = single_process(runs + ["train.grad_accum=2"], tmp_path / "ref2")
    assert_matches(got["tp_dp"], accum2)
    assert_matches(got["pp_dp"], accum2)
    assert_matches(got["sp_tp"], single_process(runs, tmp_path / "ref1"))
    # A pipeline schedule interleaves micro-batches: no block-order prefetching under it.
    assert not any(u["forward"] or u["backward"] for u in got["pp_dp"]["fsdp_schedule"].values())
    assert got["tp_dp"]["fsdp_schedule"] == expected_schedule(STDIT_BLOCKS, reshard=True)   # bucketed: depth 2


def test_checkpoint_saved_under_one_hybrid_resumes_under_another(mixed_toy, tmp_path):
    """TP=2 x DP=2 saves at step 2; PP=2 x DP=2 and one process (grad_accum 2) resume it to
    step 4 and end where an uninterrupted single-process run ends."""
    runs = bucketed(mixed_toy, **{"train.ema_decay": 0.9, "checkpoint.on_config_change": "continue"})
    first = tmp_path / "tp_dp"
    result = torchrun(4, "-m", "videodit", "train", "--out", str(first), *runs, "train.max_steps=2",
                      "checkpoint.every_steps=2", "parallel.tp=2", "parallel.dp_shard=2")
    assert result.returncode == 0, result.stderr[-3000:]
    import shutil
    pp_dp, one = tmp_path / "pp_dp", tmp_path / "one"
    shutil.copytree(first, pp_dp)
    shutil.copytree(first, one)
    result = torchrun(4, "-m", "videodit", "train", "--out", str(pp_dp), *runs, "train.max_steps=4",
                      "parallel.pp=2", "parallel.dp_shard=2", "resume=auto")
    assert result.returncode == 0, result.stderr[-3000:]
    assert main(["train", "--out", str(one), *runs, "train.max_steps=4", "train.grad_accum=2", "resume=auto"]) == 0
    assert main(["train", "--out", str(tmp_path / "ref"), *runs, "train.max_steps=4", "train.grad_accum=2"]) == 0
    for stem in ("model", "ema"):
        want = load_file(tmp_path / "ref" / "checkpoints" / "step-0000004" / f"{stem}.safetensors")
        for run in (pp_dp, one):
            got = load_file(run / "checkpoints" / "step-0000004" / f"{stem}.safetensors")
            assert got.keys() == want.keys()
            assert max((got[k] - want[k]).abs().max().item() for k in want) < TOLERANCE


def test_sharded_checkpoint_resumes_at_other_world_sizes(toy_dir, tmp_path):
    """Saved by FSDP on 4 ranks (DCP shards), resumed on 2 ranks and on 1; global batch kept
    by grad_accum. Both end where an uninterrupted single-process run ends."""
    video = base(toy_dir, **{"train.ema_decay": 0.9, "checkpoint.on_config_change": "continue"})
    first = tmp_path / "four"
    result = torchrun(4, "-m", "videodit", "train", "--out", str(first), *video, "train.max_steps=2",
                      "checkpoint.every_steps=2")
    assert result.returncode == 0, result.stderr[-3000:]
    saved = first / "checkpoints" / "step-0000002"
    assert sorted(p.name for p in (saved / "dcp").iterdir())[-1] == "__3_0.distcp"
    manifest = json.loads((saved / "manifest.json").read_text())
    assert "dcp/__0_0.distcp" in manifest["files"] and "optimizer.pt" not in manifest["files"]

    import shutil
    on_two, on_one = tmp_path / "two", tmp_path / "one"
    shutil.copytree(first, on_two)
    shutil.copytree(first, on_one)
    result = torchrun(2, "-m", "videodit", "train", "--out", str(on_two), *video, "train.max_steps=4",
                      "train.grad_accum=2", "resume=auto")
    assert result.returncode == 0, result.stderr[-3000:]
    assert main(["train", "--out", str(on_one), *video, "train.max_steps=4", "train.grad_accum=4",
                 "resume=auto"]) == 0
    assert main(["train", "--out", str(tmp_path / "ref"), *video, "train.max_steps=4",
                 "train.grad_accum=4"]) == 0
    for stem in ("model", "ema"):
        want = load_file(tmp_path / "ref" / "checkpoints" / "step-0000004" / f"{stem}.safetensors")
        for run in (on_two, on_one):
            got = load_file(run / "checkpoints" / "step-0000004" / f"{stem}.safetensors")
            assert max((got[k] - want[k]).abs().max().item() for k in want) < TOLERANCE


def test_impossible_sizes_stop_every_rank_with_one_line(toy_dir, tmp_path):
    result = torchrun(2, "-m", "videodit", "train", "--out", str(tmp_path / "run"),
                      *base(toy_dir, **{"model.num_heads": 2}), "parallel.sp=2", "parallel.dp_shard=1",
                      "model.hidden_size=24", "model.num_heads=3")
    assert result.returncode != 0
    assert "error (rank 0): parallel.sp=2 does not divide model.num_heads=3; valid: 1, 3" in result.stderr
    assert not (tmp_path / "run").exists()


def wan(toy_dir, **extra):
    """The Wan family (wan-tiny at a Wan-valid size: 4 heads of 16, FFN 128, patch 1x2x2)."""
    return base(toy_dir, **{"model.preset": "wan-tiny", "model.depth": 2, "model.hidden_size": 64,
                            "model.ffn_dim": 128, "model.patch_size": "[1,2,2]", **extra})


@pytest.mark.parametrize("nproc", [2, 4])
def test_wan_layouts_match_one_process(toy_dir, tmp_path, nproc):
    """Wan's own parallel code against one process: DDP and FSDP2 (2 processes), TP over its
    across-heads q/k norms, PP through its stage (models/wan/stage.py); HSDP on 4."""
    video = wan(toy_dir)
    if nproc == 2:
        runs = {"ddp": video + ["parallel.dp_replicate=2", "parallel.dp_shard=1"],
                "fsdp": video + ["parallel.dp_shard=2"],
                "tp": video + ["parallel.tp=2"],
                **{name: runs for name, runs in pipeline_schedules(video).items() if name != "pp_interleaved"}}
        accum = {"ddp": 2, "fsdp": 2, "tp": 1, "pp_gpipe": 1, "pp_1f1b": 1}
    else:
        runs = {"hsdp": video + ["parallel.dp_replicate=2", "parallel.dp_shard=2"]}
        accum = {"hsdp": 4}
    got = run_layouts(toy_dir, tmp_path, nproc, runs)
    references = {a: single_process(video + [f"train.grad_accum={a}"], tmp_path / f"ref{a}")
                  for a in sorted(set(accum.values()))}
    for name in runs:
        assert_matches(got[name], references[accum[name]])


@pytest.mark.parametrize("condition", ["frame masks", "i2v first frame", "i2v clip"])
def test_wan_image_conditioning_matches_one_process(toy_dir, tmp_path, condition):
    """Wan with a given first frame, three ways: TI2V's (the frame's tokens at time 0, a per-token
    modulation that Ulysses SP slices with its tokens), i2v's (mask and latents as input
    channels) and Wan 2.1 I2V's (also CLIP features, through k_img/v_img that TP shards by
    heads): FSDP2, SP, TP and PP (not with CLIP: refused) match one process."""
    clip = Path(__file__).parents[1] / "fixtures" / "wan_clip" / "diffusers"
    extra = {"frame masks": {"diffusion.mask_ratios": "{'image_head': 0.5}", "model.task": "ti2v"},
             "i2v first frame": {"model.task": "i2v", "data.num_frames": 5},
             "i2v clip": {"model.task": "i2v", "data.num_frames": 5, "model.image_dim": 32,
                          "image_encoder.path": str(clip)}}[condition]
    video = wan(toy_dir, **extra)
    runs = {"fsdp": video + ["parallel.dp_shard=2"], "sp": video + ["parallel.sp=2"], "tp": video + ["parallel.tp=2"]}
    if condition != "i2v clip":
        runs["pp"] = pipeline_schedules(video)["pp_1f1b"]
    got = run_layouts(toy_dir, tmp_path, 2, runs)
    reference = single_process(video, tmp_path / "ref")
    two_batches = single_process(video + ["train.grad_accum=2"], tmp_path / "ref2")   # FSDP's 2 ranks' batches
    for name in runs:
        assert_matches(got[name], two_batches if name == "fsdp" else reference)
    if condition == "frame masks":   # the masks did change the training
        unmasked = single_process(wan(toy_dir), tmp_path / "unmasked")
        assert max((unmasked[0][k] - v).abs().max().item() for k, v in reference[0].items()) > 1e-4
