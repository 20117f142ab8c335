"""``ckpt export --lora-format diffusers|comfyui|peft`` (a LoRA run's adapters alone) and the full
models other tools load (``--format diffusers`` dropped into a released pipeline folder,
``--format comfyui`` as one file), each checked in its target against videodit's merged model:

- diffusers: a tiny random WanPipeline folder made here (the run's base as its transformer, a tiny
  AutoencoderKLWan, a tiny umT5 with a word tokenizer) loads the LoRA with ``load_lora_weights``;
- comfyui: ComfyUI's own key map and loader outcome for Wan, recorded from a ComfyUI checkout by
  scripts/make_comfyui_lora_fixture.py (tests/fixtures/comfyui/wan.json), and ComfyUI's formula;
- peft: ``PeftModel.from_pretrained`` on the videodit base model.
All offline, fp32 on the CPU."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import tiny_overrides
from tolerance import assert_close, relative
from videodit.checkpoint.tools import write_model_folder
from videodit.cli import main
from videodit.components import model_geometry
from videodit.config import load_config
from videodit.models import load_pretrained
from videodit.models.families import get_spec
from videodit.train.trainer import Trainer

COMFYUI = json.loads((Path(__file__).parents[1] / "fixtures" / "comfyui" / "wan.json").read_text())
# An adapted model's output against videodit's merged model, relative to its max: ten times the worst
# deviation measured across CPUs, thread counts and releases (3.1e-6, diffusers' pipeline; docs/testing.md).
MERGED = 5e-5
# As tests/train/test_wan_train.py, with the tiny pipeline's encoders and diffusers' 512 caption tokens.
WAN = {"model.preset": "wan-tiny", "model.depth": 2, "model.num_heads": 4, "model.patch_size": "[1,2,2]",
       "diffusion.constant_shift": 5.0, "diffusion.prediction": "velocity", "diffusion.loss_space": "velocity",
       "text.kind": "umt5", "text.max_length": 512, "data.num_frames": 5, "sample.sampler": "unipc",
       "sample.negative_prompt": "a green square"}
# alpha != rank, so a format that drops or doubles the alpha / rank scale shows.
LORA = {"lora.rank": 4, "lora.alpha": 8, "train.lr": 1e-2, "train.max_steps": 2,
        "lora.targets": "[self_attn.q, self_attn.k, self_attn.v, self_attn.o, cross_attn.q, cross_attn.v, ffn.0, ffn.2]"}


def random_wan(geometry, seed=0):
    """A Wan with every weight random (a fresh one starts with a zero head: outputs would not move)."""
    spec = get_spec("wan")
    torch.manual_seed(seed)
    model = spec.build(geometry).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(std=0.1)
    return model


def save_model_folder(model, folder):
    """A videodit model folder (what ``ckpt export`` writes, less the run's config)."""
    config = get_spec("wan").geometry_config(model.geometry)
    return write_model_folder(folder, model.state_dict(), {"config.json": json.dumps(config)})


@pytest.fixture(scope="module")
def wan(toy_dir, tmp_path_factory, no_network):
    """A released-like WanPipeline folder (model_index.json, transformer/ = the base, vae/,
    text_encoder/, tokenizer/, scheduler/), a LoRA run on that base with the pipeline's encoders,
    and the run's adapters merged by videodit (``--merge-lora``)."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import AutoTokenizer, UMT5EncoderModel

    from videodit.toy.stand_ins import save_umt5, save_wan_vae

    root = tmp_path_factory.mktemp("lora_export")
    parts = root / "parts"
    save_wan_vae(parts / "vae", temperal_downsample=(True, True))   # 4x time, 4x space, 4 channels
    save_umt5(parts)                                                  # text_encoder/ + tokenizer/, 16 wide
    encoders = {"vae.kind": "wan2.1", "vae.path": str(parts / "vae"), "text.path": str(parts)}
    overrides = tiny_overrides(toy_dir, **WAN, **encoders)
    base = save_model_folder(random_wan(model_geometry(load_config("tiny", overrides), 4, 16)), root / "base")
    assert main(["ckpt", "export", str(base), str(root / "base_diffusers"), "--format", "diffusers"]) == 0
    released = root / "released"
    WanPipeline(tokenizer=AutoTokenizer.from_pretrained(parts / "tokenizer"),
                text_encoder=UMT5EncoderModel.from_pretrained(parts / "text_encoder"),
                vae=AutoencoderKLWan.from_pretrained(parts / "vae", scale_factor_spatial=4),   # its real factor
                transformer=WanTransformer3DModel.from_pretrained(root / "base_diffusers"),
                scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0)).save_pretrained(released)
    run = root / "run"
    Trainer(load_config("tiny", overrides + [f"model.init_from={base}", *(f"{k}={v}" for k, v in LORA.items())]),
            run).fit()
    assert main(["ckpt", "export", str(run), str(root / "merged"), "--merge-lora"]) == 0
    return {"root": root, "base": base, "released": released, "run": run, "merged": root / "merged",
            "overrides": overrides}


@pytest.fixture(scope="module")
def models(wan):
    """(the base, videodit's merged model), fp32, eval."""
    return load_pretrained(wan["base"]).eval(), load_pretrained(wan["merged"]).eval()


@pytest.fixture(scope="module")
def inputs():
    """Latents [1, 4, 2, 8, 8], a time, and a caption zero-padded to 512 tokens (as Wan pads it)."""
    g = torch.Generator().manual_seed(1)
    context = torch.zeros(1, 512, 16)
    context[:, :6] = torch.randn(1, 6, 16, generator=g)
    return torch.randn(1, 4, 2, 8, 8, generator=g), torch.tensor([0.7]), context


def export_lora(wan, fmt, *extra) -> Path:
    out = wan["root"] / f"lora-{fmt}-{len(extra)}"
    assert main(["ckpt", "export", str(wan["run"]), str(out), "--lora-format", fmt, *extra]) == 0
    return out


def keys(file) -> list[str]:
    with safe_open(str(file), framework="pt") as handle:
        return list(handle.keys())


def run_merged(models, inputs):
    base, merged = models
    with torch.no_grad():
        expected = merged(*inputs)
        assert relative(base(*inputs), expected) > 1e-3   # the adapters change the output
    return expected


def diffusers_pipeline(wan):
    from diffusers import WanPipeline
    return WanPipeline.from_pretrained(wan["released"]).to(torch.float32)


def diffusers_output(pipe, inputs):
    x, t, context = inputs
    with torch.no_grad():
        return pipe.transformer(x, t * 1000, context).sample


# ----------------------------------------------------------------------------- the three LoRA formats


def test_diffusers_lora_loads_in_wan_pipeline_and_matches_the_merged_model(wan, models, inputs):
    out = export_lora(wan, "diffusers")
    file = out / "pytorch_lora_weights.safetensors"   # diffusers' own name: load_lora_weights(OUT) finds it
    names = keys(file)
    assert names and all(n.startswith("transformer.blocks.") and n.endswith((".lora_A.weight", ".lora_B.weight"))
                         for n in names) and not any(".default" in n for n in names)
    assert "transformer.blocks.1.attn1.to_out.0.lora_A.weight" in names   # diffusers' module names
    assert "transformer.blocks.0.ffn.net.0.proj.lora_B.weight" in names
    with safe_open(str(file), framework="pt") as handle:
        meta = json.loads(handle.metadata()["lora_adapter_metadata"])
    assert meta["transformer.r"] == meta["transformer.lora_alpha"] == 4   # alpha / rank folded into lora_B
    pipe = diffusers_pipeline(wan)
    pipe.load_lora_weights(str(out), weight_name=file.name)   # weight_name: diffusers < 0.40 needs it offline
    assert_close(diffusers_output(pipe, inputs), run_merged(models, inputs), MERGED, "diffusers' pipeline")


def test_comfyui_lora_is_mapped_by_comfyuis_key_map_and_reproduces_the_merged_weights(wan, models, inputs):
    out = export_lora(wan, "comfyui")
    file = out / f"{out.name}.safetensors"   # named after OUT, as it shows in ComfyUI's LoRA list
    lora = load_file(str(file))
    assert not any(".default" in n for n in lora)
    key_map, loaded = COMFYUI["lora_key_map"], COMFYUI["lora_loaded"]
    base_state, merged_state = (model.state_dict() for model in models)
    prefixes = {n.rsplit(".", 2)[0] if n.endswith(".weight") else n.rsplit(".", 1)[0] for n in lora}
    assert {f"{p}.{s}" for p in prefixes for s in ("lora_down.weight", "lora_up.weight", "alpha")} == set(lora)
    patched = dict(base_state)
    for prefix in prefixes:
        # ComfyUI's map (model_lora_keys_unet) sends the prefix to the weight of the same Wan module ...
        target = key_map[prefix]
        assert target == f"{prefix}.weight" and loaded.get(prefix, target) == target
        name = target.removeprefix("diffusion_model.")
        down, up, alpha = lora[f"{prefix}.lora_down.weight"], lora[f"{prefix}.lora_up.weight"], lora[f"{prefix}.alpha"]
        assert alpha.item() == 8.0 and down.shape[0] == 4
        # ... and its LoRA adapter adds strength * alpha / rank * up @ down (rank: lora_down's rows).
        patched[name] = base_state[name] + alpha.item() / down.shape[0] * (up @ down)
    assert prefixes and not COMFYUI["lora_not_loaded"]
    assert max((patched[k] - merged_state[k]).abs().max().item() for k in merged_state) <= 1e-6
    model = load_pretrained(wan["base"]).eval()
    model.load_state_dict(patched)
    with torch.no_grad():
        assert_close(model(*inputs), run_merged(models, inputs), MERGED, "merged model")
    # diffusers reads ComfyUI's convention too (its Wan loader converts "diffusion_model." keys, alpha included).
    pipe = diffusers_pipeline(wan)
    pipe.load_lora_weights(str(file.parent), weight_name=file.name)
    assert_close(diffusers_output(pipe, inputs), run_merged(models, inputs), MERGED, "diffusers' pipeline")


def test_comfyuis_formula_as_recorded_from_its_code():
    f = {k: torch.tensor(v) if isinstance(v, list) else v for k, v in COMFYUI["formula"].items()}
    ours = f["w"] + f["strength"] * f["alpha"] / f["down"].shape[0] * (f["up"] @ f["down"])
    assert torch.allclose(ours, f["result"], atol=1e-6)
    parity = COMFYUI["parity"]   # ComfyUI's own model and loader, at fixture time: videodit's merge exactly
    assert parity["single_file_loaded_exactly"] and parity["patched_weights_max_abs_diff"] == 0.0
    assert parity["forward_max_relative_diff"] <= 1e-5


def test_peft_folder_loads_with_peftmodel_on_the_videodit_base(wan, models, inputs):
    from peft import LoraConfig, PeftModel, get_peft_model

    out = export_lora(wan, "peft")
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert not any(".default" in n for n in keys(out / "adapter_model.safetensors"))
    model = PeftModel.from_pretrained(load_pretrained(wan["base"]).eval(), out)
    with torch.no_grad():
        assert_close(model(*inputs), run_merged(models, inputs), MERGED, "merged model")
    # What peft itself writes for the same adapters: the same tensor names and config.
    config = json.loads((out / "adapter_config.json").read_text())
    theirs = wan["root"] / "peft-own"
    own = get_peft_model(load_pretrained(wan["base"]), LoraConfig(**{k: config[k] for k in (
        "r", "lora_alpha", "lora_dropout", "bias", "target_modules", "base_model_name_or_path")}))
    own.save_pretrained(theirs)
    assert set(keys(theirs / "adapter_model.safetensors")) == set(keys(out / "adapter_model.safetensors"))
    written = json.loads((theirs / "adapter_config.json").read_text())
    assert sorted(written.pop("target_modules")) == sorted(config.pop("target_modules"))
    assert written.pop("base_model_name_or_path") is None   # peft knows no path for a videodit model; ours: the base's
    assert config.pop("base_model_name_or_path") == str(wan["base"].resolve())
    assert written == config


def test_ema_and_bf16_exports(wan):
    out = export_lora(wan, "comfyui", "--ema", "--dtype", "bf16")
    lora = load_file(str(out / f"{out.name}.safetensors"))
    assert all(t.dtype == torch.bfloat16 for n, t in lora.items() if n.endswith(".weight"))
    ema = load_file(str(wan["run"] / "checkpoints" / "step-0000002" / "ema.safetensors"))
    name = "blocks.0.self_attn.q.lora_B.default.weight"
    assert torch.equal(lora["diffusion_model.blocks.0.self_attn.q.lora_up.weight"], ema[name].bfloat16())


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("extra, message", [
    ([], "is not a LoRA run"),                                     # the merged export: lora.rank 0
    (["--merge-lora"], "pass one of them"),
    (["--format", "wan"], "pass one of them"),
])
def test_bad_requests_are_one_line_and_write_nothing(wan, tmp_path, capsys, extra, message):
    source = wan["merged"] if not extra else wan["run"]
    capsys.readouterr()
    assert main(["ckpt", "export", str(source), str(tmp_path / "out"), "--lora-format", "peft", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists() and not any(p.name.startswith(".staging") for p in tmp_path.iterdir())


def test_stdit_lora_exports_for_peft_only(toy_dir, tmp_path, capsys):
    from peft import PeftModel

    from videodit.models.stdit.model import STDiT

    cfg = load_config("tiny", tiny_overrides(toy_dir))
    torch.manual_seed(0)
    stdit = STDiT(model_geometry(cfg, 3, cfg.text.dim))   # as tests/train/test_lora.py: identity VAE, toy captions
    with torch.no_grad():
        for param in stdit.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    base = stdit.save_pretrained(tmp_path / "base")
    run = tmp_path / "run"
    assert main(["train", "--out", str(run), *tiny_overrides(toy_dir, **{
        "lora.rank": 4, "model.init_from": str(base), "train.lr": 1e-2, "train.max_steps": 2})]) == 0
    capsys.readouterr()
    for fmt in ("diffusers", "comfyui"):
        assert main(["ckpt", "export", str(run), str(tmp_path / fmt), "--lora-format", fmt]) == 2
        err = capsys.readouterr().err.strip()
        assert "does not apply to a stdit LoRA run" in err and "--lora-format peft" in err and "\n" not in err
        assert not (tmp_path / fmt).exists()
    assert main(["ckpt", "export", str(run), str(tmp_path / "peft"), "--lora-format", "peft"]) == 0
    assert main(["ckpt", "export", str(run), str(tmp_path / "merged"), "--merge-lora"]) == 0
    model = PeftModel.from_pretrained(load_pretrained(base).eval(), tmp_path / "peft")
    merged = load_pretrained(tmp_path / "merged").eval()
    x = torch.randn(2, 3, 4, 16, 16)
    inputs = (x, torch.tensor([0.3, 0.8]), torch.randn(2, 8, 64), torch.ones(2, 8, dtype=torch.bool))
    with torch.no_grad():
        assert_close(model(*inputs), merged(*inputs), MERGED, "merged model")


# ----------------------------------------------------------------------------- two experts


def test_two_experts_export_as_a_high_and_a_low_noise_file(wan, tmp_path, capsys):
    runs = {}
    for expert, edges in (("high", "[0.875, 1.0]"), ("low", "[0.0, 0.875]")):
        runs[expert] = tmp_path / expert
        Trainer(load_config("tiny", wan["overrides"] + [f"model.init_from={wan['base']}", "train.max_steps=1",
                                                         f"diffusion.timestep_range={edges}",
                                                         *(f"{k}={v}" for k, v in LORA.items() if k != "train.max_steps")]),
                runs[expert]).fit()
    names = {"comfyui": ("pair_high_noise.safetensors", "pair_low_noise.safetensors"),
             "diffusers": ("pytorch_lora_weights_high_noise.safetensors", "pytorch_lora_weights_low_noise.safetensors"),
             "peft": ("high_noise_model/adapter_model.safetensors", "low_noise_model/adapter_model.safetensors")}
    for fmt, (high, low) in names.items():
        out = tmp_path / fmt / "pair"
        assert main(["ckpt", "export", str(runs["high"]), str(out), "--low-noise-ckpt", str(runs["low"]),
                     "--lora-format", fmt]) == 0
        for expert, name in (("high", high), ("low", low)):
            alone = tmp_path / fmt / expert
            assert main(["ckpt", "export", str(runs[expert]), str(alone), "--lora-format", fmt]) == 0
            single = next(alone.rglob("*.safetensors"))
            pair, own = load_file(str(out / name)), load_file(str(single))
            assert pair.keys() == own.keys() and all(torch.equal(pair[k], own[k]) for k in own)
    capsys.readouterr()
    assert main(["ckpt", "export", str(runs["low"]), str(tmp_path / "swapped"), "--low-noise-ckpt",
                 str(runs["high"]), "--lora-format", "comfyui"]) == 2
    assert "was not trained as a high-noise expert" in capsys.readouterr().err
    assert not (tmp_path / "swapped").exists()


# ----------------------------------------------------------------------------- full models


class WanGridEuler:
    """diffusers' FlowMatchEulerDiscreteScheduler handed Wan's sigmas and integer timesteps
    (``flow_unipc.grid``): diffusers' own grids differ from Wan's (docs/wan.md, "UniPC grid")."""

    @staticmethod
    def make(shift: float):
        from diffusers import FlowMatchEulerDiscreteScheduler

        from videodit.diffusion import flow_unipc

        class Scheduler(FlowMatchEulerDiscreteScheduler):
            def set_timesteps(self, num_inference_steps=None, device=None, **kwargs):
                sigmas, timesteps = flow_unipc.grid(num_inference_steps, shift)
                super().set_timesteps(sigmas=sigmas[:-1].tolist(), timesteps=timesteps.float().tolist(),
                                      device=device)
        return Scheduler(shift=1.0)


def test_diffusers_export_drops_into_the_pipeline_folder_and_one_step_matches_videodit_sample(wan, tmp_path):
    """The merged model exported with --format diffusers replaces the released pipeline's
    transformer/ (its other folders untouched); one WanPipeline step equals videodit's sampler
    (the run's UniPC, whose first step on Wan's grid is an Euler step) for the same seed."""
    from diffusers import WanPipeline

    from videodit.sample import Pipeline, denoise

    folder = tmp_path / "pipeline"
    shutil.copytree(wan["released"], folder)
    shutil.rmtree(folder / "transformer")
    assert main(["ckpt", "export", str(wan["merged"]), str(folder / "transformer"), "--format", "diffusers"]) == 0
    pipe = WanPipeline.from_pretrained(folder).to(torch.float32)
    pipe.scheduler = WanGridEuler.make(5.0)
    prompt, negative, guidance, seed = "a red circle moving right", "a green square", 3.0, 7
    theirs = pipe(prompt, negative_prompt=negative, height=16, width=16, num_frames=5, num_inference_steps=1,
                  guidance_scale=guidance, generator=torch.Generator().manual_seed(seed), output_type="latent").frames

    ours = Pipeline(wan["merged"])
    assert ours.cfg.sample.sampler == "unipc"
    shape = (1, ours.vae.latent_channels, *ours.vae.latent_size(5, 16, 16))
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed))   # as videodit sample draws it
    y, mask = ours.text.encode([prompt])
    with torch.no_grad():
        latents = denoise(ours.model, ours.flow, noise, y, mask, steps=1, guidance=guidance, ratio=5.0,
                          sampler="unipc", negative=ours.text.encode([negative]))
    assert theirs.shape == latents.shape and relative(theirs, latents) <= 1e-5


def test_comfyui_single_file_is_what_comfyui_builds(tmp_path, capsys):
    """--format comfyui: one file in Wan's names; for a model of a released Wan's shape (128-wide
    heads, 4096-wide text) ComfyUI detected Wan 2.1 and built exactly these tensors (fixture)."""
    from videodit.models.wan.model import WanGeometry

    geometry = WanGeometry(**{k: tuple(v) if isinstance(v, list) else v for k, v in COMFYUI["geometry"].items()})
    base = save_model_folder(random_wan(geometry), tmp_path / "base")
    out = tmp_path / "wan_finetune"
    assert main(["ckpt", "export", str(base), str(out), "--format", "comfyui", "--dtype", "bf16"]) == 0
    assert [p.name for p in out.iterdir()] == ["wan_finetune.safetensors"]
    state = load_file(str(out / "wan_finetune.safetensors"))
    assert {f"diffusion_model.{k}": list(v.shape) for k, v in state.items()} == COMFYUI["model_state"]
    assert all(v.dtype == torch.bfloat16 for v in state.values())
    detected = COMFYUI["detected"]
    assert detected["class"] == "WAN21_T2V"
    assert (detected["unet_config"]["dim"], detected["unet_config"]["num_heads"]) == (geometry.dim, geometry.num_heads)

    small = save_model_folder(random_wan(WanGeometry(dim=64, ffn_dim=128, num_heads=4, num_layers=1)), tmp_path / "s")
    capsys.readouterr()
    assert main(["ckpt", "export", str(small), str(tmp_path / "no"), "--format", "comfyui"]) == 2
    err = capsys.readouterr().err.strip()
    assert "head_dim=16 (ComfyUI assumes 128)" in err and "\n" not in err and not (tmp_path / "no").exists()


# ----------------------------------------------------------------------------- a distilled LoRA


def test_a_distilled_lora_samples_its_four_steps_in_diffusers_as_videodits_student_sampler(wan, tmp_path):
    """A shared-base LoRA DMD2 run on the pipeline's base (``train/shared_base.py``): its student's
    adapters, exported for diffusers and loaded with ``load_lora_weights``, sample the student's 4
    re-noised steps at cfg 1 as videodit's distilled sampler does, within the issue's 1e-5."""
    from videodit.distill.schedule import StudentSchedule
    from videodit.sample import Pipeline

    run, out = tmp_path / "dmd2", tmp_path / "dmd2-diffusers"
    distill = {**LORA, "distill.method": "dmd2", "distill.generator_every": 1, "train.deterministic": True}
    Trainer(load_config("tiny", wan["overrides"] + [f"model.init_from={wan['base']}",
                                                     *(f"{k}={v}" for k, v in distill.items())]), run).fit()
    # --ema: the weights videodit's own sampler (``Pipeline``) takes
    assert main(["ckpt", "export", str(run), str(out), "--lora-format", "diffusers", "--ema"]) == 0
    assert "4 steps" in (out / "SAMPLING.md").read_text()
    pipe = diffusers_pipeline(wan)
    pipe.load_lora_weights(str(out), weight_name="pytorch_lora_weights.safetensors")
    ours = Pipeline(run, device="cpu")
    schedule = StudentSchedule.of(ours.cfg)
    assert len(schedule.steps) == 4 and schedule.renoise

    g = torch.Generator().manual_seed(5)
    context = torch.zeros(1, 512, 16)
    context[:, :6] = torch.randn(1, 6, 16, generator=g)
    noise = torch.randn(1, 4, 2, 8, 8, generator=g)
    fresh = [torch.randn(1, 4, 2, 8, 8, generator=g) for _ in schedule.steps]

    def sample(velocity):
        with torch.no_grad():
            return schedule.sample(velocity, noise, lambda i: fresh[i])
    theirs = sample(lambda x, t: pipe.transformer(x, t * 1000, context).sample)   # diffusers' timesteps: 1000 t
    student = sample(lambda x, t: ours.model(x, t, context))
    teacher = sample(lambda x, t: load_pretrained(wan["base"]).eval()(x, t, context))
    assert relative(student, teacher) > 1e-4   # the distilled adapters change the samples (10x the bound)
    assert relative(theirs, student) <= 1e-5
