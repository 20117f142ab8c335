"""Wan 2.1 (``model.preset=wan-tiny``) through the whole system on one process: training,
exact resume, export in Wan's and diffusers' layouts read back by ``load_pretrained``, and
sampling with Wan's UniPC and a negative prompt (``denoise`` against the sampler itself)."""

import json
from pathlib import Path

import pytest
import torch

from conftest import tiny_overrides
from videodit.checkpoint import export_released
from videodit.cli import main
from videodit.config import load_config
from videodit.diffusion import flow_unipc
from videodit.diffusion.rectified_flow import RectifiedFlow
from videodit.models import load_pretrained
from videodit.sample import denoise
from videodit.train.trainer import Trainer

WAN = {"model.preset": "wan-tiny", "model.depth": 2, "model.num_heads": 4, "diffusion.constant_shift": 5.0,
       "diffusion.prediction": "velocity", "diffusion.loss_space": "velocity"}   # as Wan trains


def losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_wan_trains_resumes_exactly_and_exports(toy_dir, tmp_path):
    # 512 caption tokens, as diffusers' pipeline pads them: a diffusers folder cannot say otherwise.
    common = tiny_overrides(toy_dir, **WAN, **{"train.max_steps": 4, "train.deterministic": True,
                                                "checkpoint.every_steps": 2, "text.max_length": 512})
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    Trainer(load_config("tiny", common), straight).fit()
    Trainer(load_config("tiny", common + ["train.max_steps=2"]), resumed).fit()
    Trainer(load_config("tiny", common + ["resume=auto"]), resumed).fit()
    assert losses(resumed)[-2:] == losses(straight)[-2:]   # bitwise: the resumed run is the same run

    ckpt = straight / "checkpoints" / "step-0000004"
    exported = {fmt: export_released(ckpt, tmp_path / fmt, fmt) for fmt in ("wan", "diffusers")}
    assert (exported["diffusers"] / "diffusion_pytorch_model.safetensors").is_file()
    ours, from_diffusers = load_pretrained(exported["wan"]), load_pretrained(exported["diffusers"])
    assert ours.state_dict().keys() == from_diffusers.state_dict().keys()
    assert all(torch.equal(v, from_diffusers.state_dict()[k]) for k, v in ours.state_dict().items())
    assert main(["ckpt", "export", str(ckpt), str(tmp_path / "os"), "--format", "opensora"]) == 2
    short = tmp_path / "short"   # 8 caption tokens: Wan's layout only, in one line
    Trainer(load_config("tiny", common + ["text.max_length=8", "train.max_steps=1"]), short).fit()
    assert main(["ckpt", "export", str(short), str(tmp_path / "d8"), "--format", "diffusers"]) == 2
    assert not (tmp_path / "d8").exists()


def test_wan_samples_with_unipc_and_a_negative_prompt():
    from videodit.models.families import get_spec
    cfg = load_config("tiny", [f"{k}={v}" for k, v in WAN.items()])
    spec = get_spec("wan")
    torch.manual_seed(0)
    model = spec.build(spec.geometry(cfg.model, 4, 16, 8)).eval()
    for p in model.parameters():   # Wan starts from a zero head: make the output depend on the input
        torch.nn.init.normal_(p, std=0.1)
    flow = RectifiedFlow(cfg.diffusion)
    noise, y = torch.randn(2, 4, 3, 8, 8), torch.randn(2, 8, 16)
    mask = torch.ones(2, 8, dtype=torch.bool)
    negative = (torch.randn(1, 8, 16), torch.ones(1, 8, dtype=torch.bool))
    with torch.no_grad():
        got = denoise(model, flow, noise, y, mask, steps=4, guidance=3.0, ratio=5.0, sampler="unipc",
                      negative=negative)
        expected = flow_unipc.sample(lambda x, t: model(x, t, y), noise, 4, 5.0, 3.0,
                                     lambda x, t: model(x, t, negative[0].expand(2, -1, -1)))
        euler = denoise(model, flow, noise, y, mask, steps=4, guidance=3.0, ratio=5.0, negative=negative)
    assert torch.equal(got, expected)
    assert not torch.allclose(got, euler, atol=1e-3)


def test_wan_folders_import_and_load_in_both_layouts(tmp_path):
    from pathlib import Path

    from videodit.checkpoint import import_released
    fixtures = Path(__file__).parents[1] / "fixtures" / "wan"
    models = {layout: load_pretrained(fixtures / layout) for layout in ("wan", "diffusers")}
    imported = load_pretrained(import_released(fixtures / "diffusers", tmp_path / "imported", "name: wan\n"))
    for model in (models["diffusers"], imported):
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in models["wan"].state_dict().items())
    assert json.loads((tmp_path / "imported" / "export.json").read_text())["format"] == "wan2.1"


def test_wan_ti2v_trains_with_its_image_frame_given_and_samples_from_a_reference(toy_dir, tmp_path):
    """TI2V (model.task=ti2v): image-conditioned samples (diffusion.mask_ratios image_head) give
    latent frame 0 clean at time 0, left out of the loss; resume is exact; the export says ti2v;
    sampling from a reference keeps its frame."""
    import numpy as np

    from videodit.data.video_write import write_video
    from videodit.sample import Pipeline

    common = tiny_overrides(toy_dir, **WAN, **{"model.task": "ti2v", "diffusion.mask_ratios": "{'image_head': 0.5}",
                                                "train.max_steps": 4, "train.deterministic": True,
                                                "checkpoint.every_steps": 2, "data.num_frames": 5})
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    Trainer(load_config("tiny", common), straight).fit()
    Trainer(load_config("tiny", common + ["train.max_steps=2"]), resumed).fit()
    Trainer(load_config("tiny", common + ["resume=auto"]), resumed).fit()
    assert losses(resumed)[-2:] == losses(straight)[-2:]
    exported = export_released(straight / "checkpoints" / "step-0000004", tmp_path / "wan", "wan")
    assert json.loads((exported / "config.json").read_text())["model_type"] == "ti2v"

    reference = tmp_path / "ref.png"
    write_video(reference, np.full((1, 16, 16, 3), 200, dtype=np.uint8), fps=8)
    clips = Pipeline(straight)(["a red circle moving right"], steps=2, seed=0, reference=str(reference))
    assert clips.shape[1] == 5 and abs(float(clips[0, 0].mean()) - 200) < 3   # the given frame, identity VAE


@pytest.mark.parametrize("clip", [False, True], ids=["i2v", "i2v-clip"])
def test_wan_i2v_trains_on_its_first_frame_and_samples_from_an_image(toy_dir, tmp_path, capsys, clip):
    """An i2v model (Wan 2.2 I2V-A14B's kind: 36 channels = latent, mask, given frame's latents; with
    ``clip``, Wan 2.1 I2V's: also CLIP features of that frame) trains with each clip's first frame
    given as Wan builds it, resumes exactly, exports as i2v, and samples only from an image."""
    import numpy as np

    from videodit.data.video_write import write_video
    from videodit.errors import UserError
    from videodit.sample import Pipeline

    image = {"model.image_dim": 32, "image_encoder.path": str(CLIP_ENCODER)} if clip else {}   # the tiny CLIP's width
    common = tiny_overrides(toy_dir, **WAN, **{"model.task": "i2v", "train.max_steps": 4, "train.deterministic": True,
                                                "checkpoint.every_steps": 2, "data.num_frames": 5, **image})
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    trainer = Trainer(load_config("tiny", common), straight)
    assert trainer.model.geometry.in_channels == 2 * 3 + 4   # identity VAE: 3 latent channels
    trainer.fit()
    Trainer(load_config("tiny", common + ["train.max_steps=2"]), resumed).fit()
    Trainer(load_config("tiny", common + ["resume=auto"]), resumed).fit()
    assert losses(resumed)[-2:] == losses(straight)[-2:]
    exported = export_released(straight / "checkpoints" / "step-0000004", tmp_path / "wan", "wan")
    config = json.loads((exported / "config.json").read_text())
    assert (config["model_type"], config["in_dim"]) == ("i2v", 10)

    pipeline = Pipeline(straight)
    with pytest.raises(UserError, match="--ref IMAGE"):
        pipeline(["a red circle"], steps=2, seed=0)
    reference = tmp_path / "ref.png"
    write_video(reference, np.full((1, 16, 16, 3), 200, dtype=np.uint8), fps=8)
    capsys.readouterr()
    clips = pipeline(["a red circle moving right"], steps=2, seed=0, reference=str(reference))
    assert clips.shape[1] == 5 and "warning" not in capsys.readouterr().err
    if clip:   # the image features entered the model: the same run without them samples otherwise
        assert pipeline.image_encoder is not None
        pipeline.image_encoder = ZeroFeatures(pipeline.image_encoder)
        assert not (pipeline(["a red circle moving right"], steps=2, seed=0, reference=str(reference)) == clips).all()
        missing = [o for o in common if not o.startswith("image_encoder.path")]
        assert main(["train", "--out", str(tmp_path / "no-clip"), *missing]) == 2
        assert "set image_encoder.path" in capsys.readouterr().err and not (tmp_path / "no-clip").exists()


CLIP_ENCODER = Path(__file__).parents[1] / "fixtures" / "wan_clip" / "diffusers"


class ZeroFeatures(torch.nn.Module):
    """An image encoder whose features are all zero (the shape of ``encoder``'s)."""

    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder

    def encode(self, frames):
        return torch.zeros_like(self.encoder.encode(frames))


def test_two_experts_trained_apart_sample_together(toy_dir, tmp_path, capsys):
    """Wan 2.2 A14B's way: each expert trains on its timestep range; `sample --ckpt HIGH
    --low-noise-ckpt LOW` switches at the boundary and guides each with its own sample.cfg."""
    from videodit.sample import Pipeline

    common = tiny_overrides(toy_dir, **{**WAN, "train.max_steps": 2, "data.num_frames": 5, "text.max_length": 512,
                                        "sample.sampler": "unipc", "diffusion.constant_shift": 12.0})
    runs = {}
    for expert, edges, cfg in (("high", "[0.875, 1.0]", 4.0), ("low", "[0.0, 0.875]", 3.0)):
        runs[expert] = tmp_path / expert
        Trainer(load_config("tiny", common + [f"diffusion.timestep_range={edges}", f"sample.cfg={cfg}"]),
                runs[expert]).fit()
    pair = Pipeline(runs["high"], low_noise=runs["low"])
    assert pair.model.boundary == 0.875 and pair.expert_guidance(torch.tensor([0.9])) == 4.0
    assert pair.expert_guidance(torch.tensor([0.5])) == 3.0
    together = pair(["a red circle moving right"], steps=4, seed=0)
    alone = {name: Pipeline(run)(["a red circle moving right"], steps=4, seed=0) for name, run in runs.items()}
    assert together.shape == alone["high"].shape
    assert not (together == alone["high"]).all() and not (together == alone["low"]).all()

    capsys.readouterr()
    assert main(["sample", "--ckpt", str(runs["low"]), "--low-noise-ckpt", str(runs["high"]), "--prompt", "x",
                 "--out", str(tmp_path / "x.mp4")]) == 2
    assert "was not trained as a high-noise expert" in capsys.readouterr().err

    # Exported as the release lays its experts out; each folder is a Wan DiT, the pair is refused whole.
    from videodit.errors import UserError
    from videodit.models.wan import load_wan
    for fmt, folders in (("wan", ("high_noise_model", "low_noise_model")), ("diffusers", ("transformer", "transformer_2"))):
        out = tmp_path / f"a14b-{fmt}"
        assert main(["ckpt", "export", str(runs["high"]), str(out), "--low-noise-ckpt", str(runs["low"]),
                     "--format", fmt, "--ema"]) == 0   # the pair above sampled with the EMA weights
        experts = [load_wan(out / folder) for folder in folders]
        for expert, ours in zip(experts, (pair.model.high_noise_model, pair.model.low_noise_model)):
            assert all(torch.equal(v, ours.state_dict()[k]) for k, v in expert.state_dict().items())
        with pytest.raises(UserError, match="two experts"):
            load_wan(out)
