"""Both experts of a two-expert Wan (Wan 2.2 A14B's layout) trained in one run
(``model.expert=both``): each step trains one expert, on its side of the boundary, the same on
every rank; resume, LoRA, sampling and export hold both."""

import json

import pytest
import torch

from conftest import tiny_overrides, torchrun
from videodit.checkpoint import LoadedCheckpoint, export, export_released
from videodit.cli import main
from videodit.config import load_config
from videodit.errors import UserError
from videodit.train.trainer import Trainer

# A boundary where both experts get a fair share of the steps (shift 3, logit-normal(0, 1)).
BOTH = {"model.preset": "wan-tiny", "model.depth": 2, "model.num_heads": 4, "diffusion.constant_shift": 3.0,
        "diffusion.logit_mean": 0.0, "diffusion.prediction": "velocity", "diffusion.loss_space": "velocity",
        "model.expert": "both", "model.expert_boundary": 0.75, "data.num_frames": 5, "text.max_length": 512,
        "train.deterministic": True, "sample.expert_cfg": "[2.0, 5.0]"}


def losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def both(toy_dir, **extra):
    return tiny_overrides(toy_dir, **{**BOTH, **extra})


def test_each_step_trains_the_expert_its_timesteps_belong_to(toy_dir, tmp_path):
    trainer = Trainer(load_config("tiny", both(toy_dir, **{"train.batch_size": 2})), tmp_path / "run")
    assert 0.3 < trainer.routing.high_share < 0.7
    batches = trainer.batches()
    experts = []
    for _ in range(6):
        route = trainer.routing.route(trainer.step)
        before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
        batch = next(batches)
        inputs, _ = trainer.prepare(batch, route.time_range)
        low, high = route.time_range
        assert bool(((inputs[1] >= low) & (inputs[1] <= high)).all())
        trainer.train_step([batch])
        trainer.state.progress.step += 1
        changed = {name.split(".")[0] for name, p in trainer.model.named_parameters() if not torch.equal(p, before[name])}
        assert changed == {f"{route.expert}_noise_model"}
        experts.append(route.expert)
    assert set(experts) == {"high", "low"}


def test_both_experts_resume_exactly_sample_and_export(toy_dir, tmp_path, capsys):
    from videodit.models import load_pretrained
    from videodit.models.wan import load_wan
    from videodit.sample import Pipeline

    common = both(toy_dir, **{"train.max_steps": 4, "checkpoint.every_steps": 2})
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    Trainer(load_config("tiny", common), straight).fit()
    Trainer(load_config("tiny", common + ["train.max_steps=2"]), resumed).fit()
    Trainer(load_config("tiny", common + ["resume=auto"]), resumed).fit()
    assert losses(resumed)[-2:] == losses(straight)[-2:]

    ckpt = straight / "checkpoints" / "step-0000004"
    tensors = LoadedCheckpoint(ckpt).tensors("model")
    assert {name.split(".")[0] for name in tensors} == {"high_noise_model", "low_noise_model"}
    pipeline = Pipeline(straight, use_ema=False)   # the weights export takes
    assert pipeline.expert_guidance(torch.tensor([0.9])) == 5.0 and pipeline.expert_guidance(torch.tensor([0.5])) == 2.0
    clips = pipeline(["a red circle moving right"], steps=3, seed=0)
    assert clips.shape[1] == 5

    # videodit's format: a one-expert folder each, which sample pairs again as two runs trained apart
    ours = export(ckpt, tmp_path / "ours")
    assert sorted(p.name for p in ours.iterdir()) == ["high_noise_model", "low_noise_model"]
    pair = Pipeline(ours / "high_noise_model", low_noise=ours / "low_noise_model")
    assert (pair(["a red circle moving right"], steps=3, seed=0) == clips).all()
    # the release's layouts: each expert loads as a Wan DiT with its own weights
    for fmt, folders in (("wan", ("high_noise_model", "low_noise_model")), ("diffusers", ("transformer", "transformer_2"))):
        out = export_released(ckpt, tmp_path / fmt, fmt)
        for folder, prefix in zip(folders, ("high_noise_model.", "low_noise_model.")):
            model = load_wan(out / folder)
            assert all(torch.equal(t, tensors[prefix + name]) for name, t in model.state_dict().items())
    assert main(["sample", "--ckpt", str(straight), "--low-noise-ckpt", str(straight), "--prompt", "x",
                 "--out", str(tmp_path / "x.mp4")]) == 2
    assert "holds both experts already" in capsys.readouterr().err
    # a folder of two experts starts a run of both; one expert's run takes its own folder
    again = Trainer(load_config("tiny", common + [f"model.init_from={tmp_path / 'wan'}", "train.max_steps=1"]),
                    tmp_path / "again")
    assert all(torch.equal(t, tensors[name]) for name, t in again.model.state_dict().items())
    high = Trainer(load_config("tiny", common + [f"model.init_from={tmp_path / 'diffusers'}", "model.expert=high",
                                                 "sample.expert_cfg=null", "train.max_steps=1"]), tmp_path / "high")
    assert high.cfg.model.init_from.endswith("transformer") and high.cfg.diffusion.timestep_range == [0.75, 1.0]
    assert all(torch.equal(t, tensors["high_noise_model." + name]) for name, t in high.model.state_dict().items())
    with pytest.raises(UserError, match="holds a two-expert model; set model.expert"):
        Trainer(load_config("tiny", common + [f"model.init_from={tmp_path / 'wan'}", "model.expert=null",
                                              "sample.expert_cfg=null"]), tmp_path / "one")
    assert load_pretrained(ours / "low_noise_model").geometry == high.model.geometry


def test_lora_on_both_experts_saves_both_adapters_and_resumes_exactly(toy_dir, tmp_path):
    base = tmp_path / "base"
    Trainer(load_config("tiny", both(toy_dir, **{"train.max_steps": 1})), tmp_path / "full").fit()
    export_released(tmp_path / "full", base, "wan")
    common = both(toy_dir, **{"train.max_steps": 4, "checkpoint.every_steps": 2, "model.init_from": str(base),
                              "lora.rank": 4, "lora.alpha": 4})
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    Trainer(load_config("tiny", common), straight).fit()
    Trainer(load_config("tiny", common + ["train.max_steps=2"]), resumed).fit()
    Trainer(load_config("tiny", common + ["resume=auto"]), resumed).fit()
    assert losses(resumed)[-2:] == losses(straight)[-2:]
    adapters = LoadedCheckpoint(straight / "checkpoints" / "step-0000004").tensors("model")
    assert {name.split(".")[0] for name in adapters} == {"high_noise_model", "low_noise_model"}
    assert all(".lora_" in name for name in adapters)
    merged = export(straight, tmp_path / "merged", merge_lora=True)
    assert sorted(p.name for p in merged.iterdir()) == ["high_noise_model", "low_noise_model"]
    # the adapters alone, one file per expert as ComfyUI's Wan 2.2 workflows name them
    assert main(["ckpt", "export", str(straight), str(tmp_path / "lora"), "--lora-format", "diffusers"]) == 0
    files = sorted(p.name for p in (tmp_path / "lora").iterdir())
    assert len(files) == 2 and "high_noise" in files[0] and "low_noise" in files[1], files


@pytest.mark.parametrize("args, message", [
    (["model.expert=both", "diffusion.timestep_range=[0.5, 1.0]"], "remove diffusion.timestep_range"),
    (["model.expert=high", "diffusion.timestep_range=[0.5, 1.0]", "sample.expert_cfg=null"],
     "is not the high-noise expert's"),
    (["model.expert=high"], "sample.expert_cfg is for model.expert=both"),
    (["model.expert=low", "model.expert_boundary=null"], "needs a two-expert model"),
    (["model.expert=null"], "sample.expert_cfg guides the two experts"),
    (["parallel.pp=2"], "cannot split a model.expert=both run"),
])
def test_expert_settings_that_cannot_work_are_refused(toy_dir, tmp_path, args, message, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")   # sizes are checked against the world before it is joined
    monkeypatch.setenv("RANK", "0")
    assert main(["train", "--out", str(tmp_path / "run"), *both(toy_dir), *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("layout", ["fsdp", "fsdp_sp"])
def test_both_experts_under_fsdp_match_one_process(toy_dir, tmp_path, layout):
    """2 ranks x batch 2 = 1 process x batch 2 x grad_accum 2: the same steps route alike."""
    common = both(toy_dir, **{"train.max_steps": 3, "train.batch_size": 2, "train.log_every": 1})
    extra = {"fsdp": ["parallel.dp_shard=2"], "fsdp_sp": ["parallel.dp_shard=1", "parallel.sp=2"]}[layout]
    batch = ["train.grad_accum=2"] if layout == "fsdp" else []
    Trainer(load_config("tiny", common + batch), tmp_path / "one").fit()
    result = torchrun(2, "-m", "videodit", "train", "--out", str(tmp_path / "two"), *common, *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-5, abs=1e-6)
