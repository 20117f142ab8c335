"""``ckpt export RUN_OR_CKPT OUT --extract-lora RANK``: a whole-weight run's change from its base,
factored by SVD in lightx2v's layout (checkpoint/lora_extract.py), checked on a tiny Wan:

- a "fine-tune" made here (an export whose run started from ``model.init_from``; some tensors changed,
  some not) and a one-step DMD2 run distilled from the same base (``distill.teacher``; its student is
  its EMA weights);
- the reconstruction at full rank (student - base, within fp32 rounding), the best rank-r
  approximation at a low rank (Eckart-Young), the keys through ComfyUI's LoRA key logic (its key map,
  recorded in tests/fixtures/comfyui/wan.json, and ``load_lora``'s rules), the sampler note;
- diffusers' Wan LoRA loader on the file: what it applies and what it drops;
- the refusals, one line each, nothing written.
All offline, fp32 on the CPU."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import tiny_overrides
from tolerance import assert_close, relative
from videodit.checkpoint.io import EXPORT_RECORD, EXPORT_RUN_CONFIG
from videodit.checkpoint.tools import write_model_folder
from videodit.cli import main
from videodit.components import model_geometry
from videodit.config import load_config, to_yaml
from videodit.distill.schedule import StudentSchedule
from videodit.models import load_pretrained
from videodit.models.families import get_spec
from videodit.train.trainer import Trainer

COMFYUI = json.loads((Path(__file__).parents[1] / "fixtures" / "comfyui" / "wan.json").read_text())
WAN = {"model.preset": "wan-tiny", "model.depth": 2, "model.num_heads": 4, "model.patch_size": "[1,2,2]",
       "diffusion.constant_shift": 5.0, "diffusion.prediction": "velocity", "diffusion.loss_space": "velocity"}
MIN_PARAMS = 1000   # the tiny model's 2-D weights hold 384 to 8192 values: all but head.head are factored
# Bounds: ten times the worst deviation measured here (2-core AVX-512, torch 2.14.1, diffusers 0.42.1), rounded up.
# Full rank: fp32 rounding of the SVD and of up @ down, which scales with the change's norm, not its largest
# entry (a DMD step's change is nearly flat, +-lr): max |up @ down - delta| / ||delta||_2, measured 6.1e-7.
FULL_RANK = 1e-5
# ... and the weights ComfyUI computes, base + up @ down against the student (assert_close): measured 3.8e-7.
WEIGHTS = 5e-6
# A low rank: the residual's Frobenius and spectral norms against float64's tail singular values. The
# truncated SVD is where the residual is smallest, so the factors' fp32 rounding moves it at second order
# only: measured 8.9e-13.
TAIL = 1e-8
# lightx2v's split, up^T up = down down^T = diag(S[:r]), in fp32 factors: measured 2.5e-6.
SPLIT = 3e-5
# A forward or a sample against videodit's own model: docs/testing.md's bound for LoRA exports loaded by
# diffusers / peft against the merged model (worst there 3.1e-6; here 1.5e-7 ComfyUI, 1.4e-6 diffusers).
MERGED = 5e-5
UNCHANGED = ("blocks.1.self_attn.k.bias", "text_embedding.2.weight", "text_embedding.2.bias", "head.modulation")


def random_wan(geometry, seed=0):
    torch.manual_seed(seed)
    model = get_spec("wan").build(geometry).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(std=0.1)
    return model


def export_folder(folder, tensors, cfg, geometry):
    """A videodit export (what ``ckpt export`` writes) of ``tensors`` with the run config ``cfg``."""
    files = {"config.json": json.dumps(get_spec("wan").geometry_config(geometry)), EXPORT_RUN_CONFIG: to_yaml(cfg),
             EXPORT_RECORD: json.dumps({"step": 7, "weights": "model", "dtype": "fp32", "source": "test"})}
    return write_model_folder(folder, tensors, files)


@pytest.fixture(scope="module")
def world(toy_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("extract")
    overrides = tiny_overrides(toy_dir, **WAN)
    cfg = load_config("tiny", overrides)
    geometry = model_geometry(cfg, 3, cfg.text.dim)
    base_model = random_wan(geometry)
    base = write_model_folder(root / "base", base_model.state_dict(),
                              {"config.json": json.dumps(get_spec("wan").geometry_config(geometry))})
    # The fine-tune: a change of full rank in every 2-D weight, biases, norms and modulations; some left as they were.
    g = torch.Generator().manual_seed(1)
    tuned = {k: (v if k in UNCHANGED else v + 0.02 * torch.randn(v.shape, generator=g))
             for k, v in base_model.state_dict().items()}
    cfg.model.init_from = str(base)
    finetune = export_folder(root / "finetune", tuned, cfg, geometry)
    cfg.model.init_from = None
    scratch = export_folder(root / "scratch", tuned, cfg, geometry)
    cfg.model.init_from = str(root / "gone")
    missing = export_folder(root / "missing", tuned, cfg, geometry)
    distilled = root / "dmd2"
    Trainer(load_config("tiny", overrides + [
        "distill.method=dmd2", f"distill.teacher={base}", "distill.generator_every=1", "distill.steps=[1000,500]",
        "train.max_steps=1", "train.lr=1e-2", "train.warmup_steps=1", "train.deterministic=true"]), distilled).fit()
    return {"root": root, "base": base, "finetune": finetune, "scratch": scratch, "missing": missing,
            "distilled": distilled, "geometry": geometry, "tuned": tuned,
            "student": load_file(str(distilled / "checkpoints" / "step-0000001" / "ema.safetensors"))}


def extract(world, which, rank, capsys, *extra, min_params=MIN_PARAMS):
    world["exports"] = world.get("exports", 0) + 1
    out = world["root"] / f"{which}_r{rank}_{world['exports']}"
    capsys.readouterr()
    assert main(["ckpt", "export", str(world[which]), str(out), "--extract-lora", str(rank),
                 "--min-params", str(min_params), *extra]) == 0
    return out, load_file(str(out / f"{out.name}.safetensors")), capsys.readouterr().out


def student_of(world, which):
    return world["tuned"] if which == "finetune" else world["student"]


def rebuilt(lora, base):
    """{videodit name: the change the file carries}, read by the key convention alone."""
    change = {}
    for key, tensor in lora.items():
        name = key.removeprefix("diffusion_model.")
        if name.endswith(".lora_up.weight"):
            module = name.removesuffix(".lora_up.weight")
            change[f"{module}.weight"] = tensor @ lora[f"diffusion_model.{module}.lora_down.weight"]
        elif name.endswith(".diff_b"):
            change[name.removesuffix(".diff_b") + ".bias"] = tensor
        elif name.endswith(".diff"):
            module = name.removesuffix(".diff")
            change[f"{module}.weight" if f"{module}.weight" in base else module] = tensor
    return change


# ----------------------------------------------------------------------------- the reconstruction


@pytest.mark.parametrize("which", ["finetune", "distilled"])
def test_full_rank_rebuilds_student_minus_base(world, capsys, which):
    out, lora, printed = extract(world, which, 64, capsys)   # 64 >= every weight's smaller side (<= 32)
    base, student = load_file(str(world["base"] / "model.safetensors")), student_of(world, which)
    changed = {k for k in student if not torch.equal(student[k], base[k])}
    change = rebuilt(lora, base)
    assert set(change) == changed and (which == "distilled" or not changed & set(UNCHANGED))   # unchanged: left out
    assert not any(k.endswith(".alpha") for k in lora)   # scale 1
    factored = {k for k in changed if base[k].dim() == 2 and base[k].numel() >= MIN_PARAMS}
    assert {f"diffusion_model.{k.removesuffix('.weight')}.lora_up.weight" for k in factored} == \
        {k for k in lora if k.endswith(".lora_up.weight")}
    assert "diffusion_model.head.head.diff" in lora   # 384 values < MIN_PARAMS: whole
    worst = [0.0, 0.0]
    for name, tensor in change.items():
        delta = student[name] - base[name]
        if name in factored:
            norm = torch.linalg.matrix_norm(delta.double(), 2)
            deviation = float((tensor.double() - delta.double()).abs().max() / norm)
            assert deviation <= FULL_RANK, f"{name}: {deviation:.3g} of its change's norm > {FULL_RANK:.3g}"
            rebuilt_weight = assert_close(base[name] + tensor, student[name], WEIGHTS, name)
            worst = [max(worst[0], deviation), max(worst[1], rebuilt_weight)]
        else:
            assert torch.equal(tensor, delta), name   # .diff / .diff_b: the difference itself
    print(f"full rank, worst deviation of up @ down / ||delta||_2: {worst[0]:.2g}; of the weights: {worst[1]:.2g}")
    weights = "ema" if which == "distilled" else "model"
    assert f"from the {weights} weights of" in printed and f"{len(factored)} weights as lora_up/lora_down" in printed
    record = json.loads(safe_open(str(out / f"{out.name}.safetensors"), "pt").metadata()["videodit_lora"])
    assert record["weights"] == weights and record["base"] == str(world["base"]) and record["extracted_rank"] == 64


def test_a_low_rank_is_the_best_rank_r_approximation(world, capsys):
    rank = 4
    _, lora, printed = extract(world, "finetune", rank, capsys)
    base, student = load_file(str(world["base"] / "model.safetensors")), world["tuned"]
    kept = total = 0.0
    for key in (k for k in lora if k.endswith(".lora_up.weight")):
        module = key.removeprefix("diffusion_model.").removesuffix(".lora_up.weight")
        up, down = lora[key].double(), lora[f"diffusion_model.{module}.lora_down.weight"].double()
        assert up.shape[1] == down.shape[0] == rank
        delta = (student[f"{module}.weight"] - base[f"{module}.weight"]).double()
        s = torch.linalg.svdvals(delta)
        residual = delta - up @ down
        # Eckart-Young: no rank-r matrix is closer, in either norm, than the truncated SVD, whose
        # residual is the tail: sqrt(sum of the tail's squares) (Frobenius), the first left out (spectral).
        got = torch.stack([torch.linalg.matrix_norm(residual), torch.linalg.matrix_norm(residual, ord=2)])
        assert_close(got, torch.stack([s[rank:].square().sum().sqrt(), s[rank]]), TAIL, module)
        # lightx2v's split: sqrt(S) on either side, so up^T up = down down^T = diag(S[:r]).
        assert_close(up.T @ up, torch.diag(s[:rank]), SPLIT, f"{module} up")
        assert_close(down @ down.T, torch.diag(s[:rank]), SPLIT, f"{module} down")
        kept, total = kept + float(s[:rank].square().sum()), total + float(s.square().sum())
    assert f"rank {rank}; {100 * kept / total:.2f}% of their change" in printed


# ----------------------------------------------------------------------------- ComfyUI, the note


def comfyui_patches(lora: dict, key_map: dict) -> tuple[dict, set]:
    """ComfyUI's ``load_lora`` (comfy/lora.py) on a LoRA file over its key map (``model_lora_keys_unet``):
    for each key ``x`` of the map, ``x.lora_up.weight`` + ``x.lora_down.weight`` patch the mapped weight
    with ``strength * alpha / rank * up @ down``, alpha / rank being 1 without ``x.alpha``
    (comfy/weight_adapter/lora.py); ``x.diff`` adds to the mapped tensor, ``x.diff_b`` to the bias beside
    the mapped ``.weight``. Returns ({model key: its change at strength 1}, the file's keys not loaded)."""
    patches, loaded = {}, set()
    for x, target in key_map.items():
        up, down = f"{x}.lora_up.weight", f"{x}.lora_down.weight"
        if up in lora and down in lora:
            alpha = lora[f"{x}.alpha"].item() / lora[down].shape[0] if f"{x}.alpha" in lora else 1.0
            patches[target] = alpha * (lora[up] @ lora[down])
            loaded |= {up, down}
        if f"{x}.diff" in lora:
            patches[target] = lora[f"{x}.diff"]
            loaded.add(f"{x}.diff")
        if f"{x}.diff_b" in lora:
            patches[target.removesuffix(".weight") + ".bias"] = lora[f"{x}.diff_b"]
            loaded.add(f"{x}.diff_b")
    return patches, set(lora) - loaded


@pytest.mark.parametrize("rank", [64, 4])
def test_keys_load_through_comfyuis_key_logic_and_rebuild_the_student(world, capsys, rank):
    _, lora, _ = extract(world, "distilled", rank, capsys)
    patches, not_loaded = comfyui_patches(lora, COMFYUI["lora_key_map"])
    assert not not_loaded   # ComfyUI would warn "lora key not loaded" for each
    base_model = load_pretrained(world["base"]).eval()
    patched, student = base_model.state_dict(), world["student"]
    assert set(patches) == {f"diffusion_model.{k}" for k in student if not torch.equal(student[k], patched[k])}
    for target, change in patches.items():
        name = target.removeprefix("diffusion_model.")
        assert change.shape == patched[name].shape, name   # ComfyUI skips a diff of another shape
        patched[name] = patched[name] + change
    model = get_spec("wan").build(world["geometry"]).eval()
    model.load_state_dict(patched)
    reference = get_spec("wan").build(world["geometry"]).eval()
    reference.load_state_dict(student)
    g = torch.Generator().manual_seed(2)
    inputs = torch.randn(1, 3, 2, 8, 8, generator=g), torch.tensor([0.7]), torch.randn(1, 8, 64, generator=g)
    with torch.no_grad():
        got, want, before = model(*inputs), reference(*inputs), base_model(*inputs)
    if rank == 64:
        assert_close(got, want, MERGED, "ComfyUI-patched model against the student")
    else:   # rank 4 of at most 32: closer to the student than the base is, not equal
        assert relative(got, want) < relative(before, want)


def test_the_sampler_note_is_written_for_a_distilled_run_only(world, capsys):
    out, _, printed = extract(world, "distilled", 8, capsys)
    schedule = StudentSchedule(steps=(1000, 500), shift=5.0, renoise=True)
    note = (out / "SAMPLING.md").read_text()
    assert schedule.describe() in note and schedule.describe() in printed
    assert "sigmas: 1.0000, 0.8333, then 0" in note and "cfg: 1" in note and str(world["base"]) in note
    out, _, printed = extract(world, "finetune", 8, capsys)
    assert sorted(p.name for p in out.iterdir()) == [f"{out.name}.safetensors"]
    assert "not a distilled run: no sampler note" in printed


def test_a_distilled_runs_whole_export_carries_its_sampler_note(world):
    """Every released format takes the same path (comfyui and diffusers refuse this test-size shape)."""
    from videodit.checkpoint.convert import export_released

    fmt = "wan"
    schedule = StudentSchedule(steps=(1000, 500), shift=5.0, renoise=True)
    out = export_released(world["distilled"] / "checkpoints" / "step-0000001", world["root"] / f"whole-{fmt}", fmt,
                          use_ema=True)
    assert schedule.describe() in (out / "SAMPLING.md").read_text()
    plain = export_released(world["finetune"], world["root"] / f"plain-{fmt}", fmt)   # not distilled: no note
    assert not (plain / "SAMPLING.md").exists()


# ----------------------------------------------------------------------------- diffusers


def test_diffusers_loads_the_file_but_drops_the_norm_modulation_and_patch_embedding_diffs(world, capsys):
    """diffusers' Wan loader (``_convert_non_diffusers_wan_lora_to_diffusers``, 0.42.1) takes lora_up /
    lora_down and ``diff_b`` (as lora_B.bias) of the blocks' linears, the time / text embedders, the time
    projection and the head (``head.head.diff`` as lora_A with an identity lora_B); it drops every norm's
    diff and diff_b, and every other ``.diff`` (patch_embedding, the modulations) with a log line only.
    So its 4-step student sample equals videodit's student sampler where those tensors stay the base's,
    and not the whole student. (A shared-base LoRA student trains Linear layers only, which diffusers
    loads whole: ``test_lora_export.py``'s distilled-LoRA test.)"""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    from videodit.models.wan import layouts

    out, _, _ = extract(world, "distilled", 64, capsys)
    base_model = load_pretrained(world["base"]).eval()
    transformer = WanTransformer3DModel.from_config(layouts.diffusers_config(world["geometry"]))
    transformer.load_state_dict(layouts.to_diffusers(base_model.state_dict()))
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=transformer.eval(),
                       scheduler=FlowMatchEulerDiscreteScheduler())
    pipe.load_lora_weights(str(out), weight_name=f"{out.name}.safetensors")
    dropped = [k for k in base_model.state_dict() if any(p in k for p in ("norm", "modulation", "patch_embedding"))]
    student = world["student"]
    assert all(not torch.equal(student[k], base_model.state_dict()[k]) for k in dropped)   # they did change
    partial = get_spec("wan").build(world["geometry"]).eval()
    partial.load_state_dict({**student, **{k: base_model.state_dict()[k] for k in dropped}})
    whole = get_spec("wan").build(world["geometry"]).eval()
    whole.load_state_dict(student)

    schedule = StudentSchedule(steps=(1000, 750, 500, 250), shift=5.0, renoise=True)   # lightx2v's 4 steps
    g = torch.Generator().manual_seed(3)
    noise, context = torch.randn(1, 3, 2, 8, 8, generator=g), torch.randn(1, 8, 64, generator=g)
    fresh = [torch.randn(1, 3, 2, 8, 8, generator=g) for _ in schedule.steps]

    def sample(velocity):
        with torch.no_grad():
            return schedule.sample(velocity, noise, lambda i: fresh[i])
    theirs = sample(lambda x, t: transformer(x, t * 1000, context).sample)   # diffusers' timesteps: 1000 t
    assert_close(theirs, sample(lambda x, t: partial(x, t, context)), 1e-5, "diffusers against the student "
                 "less what diffusers drops (the issue's bound)")
    assert relative(theirs, sample(lambda x, t: whole(x, t, context))) > 1e-4   # the dropped diffs matter


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("which, extra, words", [
    ("finetune", ["--extract-lora", "0"], "the rank must be a whole number >= 1"),
    ("finetune", ["--extract-lora", "-3"], "the rank must be a whole number >= 1"),
    ("finetune", ["--extract-lora", "4", "--min-params", "0"], "--min-params 0"),
    ("missing", ["--extract-lora", "4"], "does not exist"),
    ("scratch", ["--extract-lora", "4"], "names no base (neither distill.teacher nor model.init_from"),
    ("finetune", ["--extract-lora", "4", "--lora-format", "comfyui"], "leave out --lora-format"),
    ("finetune", ["--extract-lora", "4", "--format", "comfyui"], "leave out --format"),
    ("finetune", ["--min-params", "10"], "add --extract-lora RANK"),
])
def test_refusals_are_one_line_and_write_nothing(world, tmp_path, capsys, which, extra, words):
    capsys.readouterr()
    assert main(["ckpt", "export", str(world[which]), str(tmp_path / "out"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1, err
    assert not list(tmp_path.iterdir())   # no OUT, no staging folder
