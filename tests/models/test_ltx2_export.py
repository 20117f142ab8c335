"""LTX-2's exports (issue #34): ``videodit ckpt export --format ltx2|comfyui|diffusers`` of an LTX-2
model and ``--lora-format diffusers|comfyui|peft`` of an LTX-2 LoRA run, each loaded where it is
meant to be, offline on the CPU (every computation fp32):

- ``ltx2`` / ``comfyui``: the release's single-file layout (``model.diffusion_model.*``, the config in
  the safetensors metadata), checked against the fixture release file written by Lightricks' code
  (tests/fixtures/ltx2; ltx-core's strict load of this layout: ``cases.json``'s ``export_checks``)
  and read back by ``videodit ckpt import`` to the same tensors and config;
- ``diffusers``: loaded strictly by diffusers' ``LTX2VideoTransformer3DModel.from_pretrained``,
  computing videodit's output;
- LoRA: a tiny LTX-2 LoRA run's adapters loaded by diffusers' ``LTX2Pipeline.load_lora_weights``
  (its own keys and LTX's), by ``PeftModel`` and by ltx-core's / ComfyUI's rule (``strength * B @ A``
  on ``diffusion_model.<module>.weight``), each equal to videodit's merged model (``--merge-lora``).

Bounds (``tests/tolerance.py``): a forward against diffusers 1e-5 of the output's largest value, as
tests/models/test_ltx2_model.py; an adapted model against the merged one 5e-5, as
tests/checkpoint/test_lora_export.py."""

from __future__ import annotations

import json
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
from videodit.models.ltx2 import layouts
from videodit.models.ltx2.release_config import geometry_from_release
from videodit.train.trainer import Trainer

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "ltx2"
VERSIONS = ("ltx2.0", "ltx2.3")
# LTX-2.0 has no recipe of its own: its import records the 2.3 one at the 2.0 preset.
IMPORT_CONFIG = {"ltx2.0": ["--config", "ltx2.3-22b-lora", "model.preset=ltx2-19b"], "ltx2.3": []}
FORWARD, MERGED = 1e-5, 5e-5
SPEC = get_spec("ltx2")
# As tests/train/test_ltx2_train.py: the identity VAE (3 channels) and 32-wide toy captions, 8x8 x 4 frames.
LTX2 = {"model.preset": "ltx2-tiny", "model.patch_size": "[1,1,1]", "text.dim": 32, "data.height": 8,
        "data.width": 8, "diffusion.prediction": "velocity", "diffusion.loss_space": "velocity"}
# alpha != rank, so a file that drops or doubles alpha / rank shows.
LORA = {"lora.rank": 4, "lora.alpha": 8, "train.lr": 1e-2, "train.max_steps": 2}


def close(got: torch.Tensor, want: torch.Tensor, bound: float, what: str) -> None:
    """``assert_close`` of a model output (made contiguous: VIDEODIT_PERTURB perturbs it through a view)."""
    assert_close(got.contiguous(), want, bound, what)


def release(version: str) -> Path:
    return FIXTURE / version / "ltx-2-tiny.safetensors"


def cli(*args) -> None:
    assert main([str(arg) for arg in args]) == 0


def header(file: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """({name: shape}, metadata) of a safetensors file."""
    with safe_open(str(file), framework="pt") as handle:
        return {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}, handle.metadata() or {}


def release_config_of(metadata: dict) -> dict:
    return json.loads(metadata["config"])["transformer"]


@pytest.fixture(scope="module")
def imported(tmp_path_factory, no_network) -> dict[str, Path]:
    """Each fixture release file through ``videodit ckpt import``: a videodit model folder."""
    root = tmp_path_factory.mktemp("ltx2_import")
    for version in VERSIONS:
        cli("ckpt", "import", release(version), root / version, *IMPORT_CONFIG[version])
    return {version: root / version for version in VERSIONS}


# ----------------------------------------------------------------------------- the release's single file


@pytest.mark.parametrize("fmt", ["ltx2", "comfyui"])
@pytest.mark.parametrize("version", VERSIONS)
def test_single_file_has_the_release_layout_and_reimports_to_the_same_model(imported, tmp_path, version, fmt):
    """In bf16 (the release's dtype) the file's DiT is the fixture release's, name for name and bit for
    bit; its metadata config describes the same model; ``ckpt import`` reads it back to the folder it
    came from."""
    out = tmp_path / f"ltx2_{fmt}"
    cli("ckpt", "export", imported[version], out, "--format", fmt, "--dtype", "bf16")
    file = out / f"{out.name}.safetensors"   # named after OUT, as ComfyUI lists it
    extra = {"ltx2": ["ltx2_config.json"], "comfyui": []}[fmt]
    assert sorted(p.name for p in out.iterdir()) == sorted([file.name, *extra])
    shapes, metadata = header(file)
    theirs, their_metadata = header(release(version))
    dit = {k: v for k, v in theirs.items() if k.startswith(layouts.PREFIX) and "embeddings_connector." not in k}
    assert shapes == dit   # the DiT alone: the text side and the decoders stay in the release file
    ours, reference = load_file(str(file)), load_file(str(release(version)))
    assert all(torch.equal(ours[k], reference[k]) for k in ours)
    config, their_config = release_config_of(metadata), release_config_of(their_metadata)
    assert geometry_from_release(json.loads(metadata["config"]), "x") == \
        geometry_from_release(json.loads(their_metadata["config"]), "y")
    assert all(config[k] == their_config[k] for k in config.keys() & their_config.keys())
    if fmt == "ltx2":
        assert json.loads((out / "ltx2_config.json").read_text()) == json.loads(metadata["config"])
    # The file layouts.write_release writes, which ltx-core loaded strictly at fixture time (deviation 0).
    assert metadata == layouts.release_metadata(load_pretrained(imported[version]).geometry)
    assert json.loads((FIXTURE / "cases.json").read_text())["export_checks"][version]["ltx2"] == 0.0

    again = tmp_path / "again"
    cli("ckpt", "import", file, again, *IMPORT_CONFIG[version])
    first, second = (load_file(str(folder / "model.safetensors")) for folder in (imported[version], again))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    configs = [json.loads((folder / "config.json").read_text()) for folder in (imported[version], again)]
    assert configs[0] == configs[1]


@pytest.mark.parametrize("version", VERSIONS)
def test_comfyui_file_is_the_ltx2_file_as_comfyui_detects_it(imported, tmp_path, version):
    """ComfyUI's Load Diffusion Model strips ``model.diffusion_model.`` (more than 5 keys carry it),
    takes an ``adaln_single`` model with ``audio_adaln_single.linear.weight`` for LTX-2's AV model and
    assumes 32 heads unless the metadata config says otherwise (comfy/model_detection.py): the
    metadata carries the sizes."""
    for fmt in ("ltx2", "comfyui"):
        cli("ckpt", "export", imported[version], tmp_path / fmt, "--format", fmt)
    ltx2, comfyui = (tmp_path / fmt / f"{fmt}.safetensors" for fmt in ("ltx2", "comfyui"))
    a, b = load_file(str(ltx2)), load_file(str(comfyui))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert header(ltx2)[1] == header(comfyui)[1]
    keys = [k.removeprefix(layouts.PREFIX) for k in b]
    assert all(k.startswith(layouts.PREFIX) for k in b)
    assert {"adaln_single.emb.timestep_embedder.linear_1.bias", "audio_adaln_single.linear.weight"} <= set(keys)
    config = release_config_of(header(comfyui)[1])
    geometry = load_pretrained(imported[version]).geometry
    assert (config["num_attention_heads"], config["attention_head_dim"], config["num_layers"]) == \
        (geometry.num_heads, geometry.head_dim, geometry.num_layers)


# ----------------------------------------------------------------------------- diffusers' folder


def diffusers_forward(model, geometry, x, t, context, fps: float = 24.0):
    """diffusers' forward of videodit's video-only inputs (times x 1000 as its pipelines pass them, the
    cross-modal attentions off, a dummy audio stream and its text beside; its own RoPE coordinates)."""
    b, _, frames, height, width = x.shape
    audio, audio_text = torch.zeros(b, 2, geometry.audio_in_channels), geometry.caption_channels or geometry.audio_dim
    out, _ = model(x.flatten(2).transpose(1, 2), audio, context, torch.zeros(b, context.shape[1], audio_text),
                   timestep=t[:, None].expand(b, frames * height * width) * 1000,
                   audio_timestep=t[:, None].expand(b, 2) * 1000, sigma=t * 1000, audio_sigma=t * 1000,
                   num_frames=frames, height=height, width=width, fps=fps, audio_num_frames=2,
                   isolate_modalities=True, use_cross_timestep=True, return_dict=False)
    return out.transpose(1, 2).reshape(x.shape)


def inputs_for(geometry, batch: int = 2, seed: int = 0):
    """Latents [B, C, 3, 4, 5], per-sample times and 6 caption tokens as wide as the DiT takes them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, geometry.in_channels, 3, 4, 5, generator=g)
    context = torch.randn(batch, 6, geometry.caption_channels or geometry.dim, generator=g)
    return x, torch.tensor([0.3, 0.8][:batch]), context


@pytest.mark.parametrize("version", VERSIONS)
def test_diffusers_folder_loads_strictly_and_computes_videodits_output(imported, tmp_path, version):
    from diffusers import LTX2VideoTransformer3DModel

    out = tmp_path / "transformer"
    cli("ckpt", "export", imported[version], out, "--format", "diffusers")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", layouts.WEIGHTS_NAME]
    model, info = LTX2VideoTransformer3DModel.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info   # nothing missing, unexpected or mismatched
    ours = load_pretrained(imported[version]).eval()
    x, t, context = inputs_for(ours.geometry)
    with torch.no_grad():
        close(diffusers_forward(model.eval(), ours.geometry, x, t, context), ours(x, t, context), FORWARD,
                     f"{version} --format diffusers vs videodit")


# ----------------------------------------------------------------------------- a LoRA run


def random_ltx2(geometry, seed: int = 0):
    """A tiny LTX-2 with every weight random (zero-initialised gates and heads would hide the adapters)."""
    torch.manual_seed(seed)
    model = SPEC.build(geometry).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn_like(param)
            if "norm" in name:
                param.copy_(1 + 0.1 * noise)
            elif param.dim() == 2:
                param.copy_(noise / param.shape[1] ** 0.5)
            else:
                param.copy_(0.2 * noise)
    return model


@pytest.fixture(scope="module")
def lora_run(toy_dir, tmp_path_factory, no_network) -> dict[str, Path]:
    """A random tiny LTX-2 base (a videodit folder and its diffusers export), a 2-step LoRA run on it
    (rank 4, alpha 8, the family's default targets) and the run merged by videodit."""
    root = tmp_path_factory.mktemp("ltx2_lora")
    overrides = tiny_overrides(toy_dir, **LTX2)
    geometry = model_geometry(load_config("tiny", overrides), 3, 32)
    base = write_model_folder(root / "base", random_ltx2(geometry).state_dict(),
                              {"config.json": json.dumps(SPEC.geometry_config(geometry))})
    cli("ckpt", "export", base, root / "base_diffusers", "--format", "diffusers")
    Trainer(load_config("tiny", overrides + [f"model.init_from={base}", *(f"{k}={v}" for k, v in LORA.items())]),
            root / "run").fit()
    cli("ckpt", "export", root / "run", root / "merged", "--merge-lora")
    return {"root": root, "base": base, "base_diffusers": root / "base_diffusers", "run": root / "run",
            "merged": root / "merged"}


@pytest.fixture(scope="module")
def merged_output(lora_run):
    """(inputs, videodit's merged model's output), with the adapters shown to move it."""
    base, merged = (load_pretrained(lora_run[k]).eval() for k in ("base", "merged"))
    inputs = inputs_for(merged.geometry)
    with torch.no_grad():
        expected = merged(*inputs)
        assert relative(base(*inputs), expected) > 1e-3
    return inputs, expected


def export_lora(lora_run, fmt: str) -> Path:
    out = lora_run["root"] / f"lora_{fmt}"
    if not out.exists():
        cli("ckpt", "export", lora_run["run"], out, "--lora-format", fmt)
    return out


def adapter_modules(lora_run) -> list[str]:
    """The adapted modules of the run (videodit's and the release's names)."""
    names = load_file(str(sorted((lora_run["run"] / "checkpoints").glob("step-*"))[-1] / "model.safetensors"))
    return sorted({name.split(".lora_")[0] for name in names})


def diffusers_with_lora(lora_run, folder: Path, weight_name: str):
    """diffusers' LTX2Pipeline (the base as its transformer, nothing else) after ``load_lora_weights``."""
    from diffusers import LTX2Pipeline, LTX2VideoTransformer3DModel

    transformer = LTX2VideoTransformer3DModel.from_pretrained(lora_run["base_diffusers"]).eval()
    pipe = LTX2Pipeline(scheduler=None, vae=None, audio_vae=None, text_encoder=None, tokenizer=None,
                        connectors=None, transformer=transformer, vocoder=None)
    pipe.load_lora_weights(str(folder), weight_name=weight_name)   # weight_name: offline, no hub lookup
    return pipe.transformer


def check_every_adapter_matched(transformer, lora_run, file: Path, prefix: str, file_name) -> None:
    """Each adapted module of the run carries one diffusers adapter whose A is the file's; no other does."""
    from peft.tuners.lora import LoraLayer

    tensors = load_file(str(file))
    modules = adapter_modules(lora_run)
    adapted = {name for name, module in transformer.named_modules() if isinstance(module, LoraLayer)}
    assert adapted == {layouts.diffusers_name(m) for m in modules}
    for module in modules:
        (adapter,) = transformer.get_submodule(layouts.diffusers_name(module)).lora_A.values()
        assert torch.equal(adapter.weight, tensors[f"{prefix}{file_name(module)}.lora_A.weight"])


LORA_FILES = {   # format -> (file in OUT, key prefix of its tensors, module names)
    "diffusers": ("pytorch_lora_weights.safetensors", "transformer.", layouts.diffusers_name),
    "comfyui": ("lora_comfyui.safetensors", "diffusion_model.", lambda module: module),
}


@pytest.mark.parametrize("fmt", LORA_FILES)
def test_lora_loads_in_diffusers_ltx2_pipeline_and_computes_the_merged_model(lora_run, merged_output, fmt):
    """``--lora-format diffusers`` (diffusers' keys) and ``comfyui`` (LTX's own keys, which diffusers'
    LTX-2 loader converts) through ``LTX2Pipeline.load_lora_weights``: every adapter matched, the
    adapted transformer computing videodit's merged model."""
    name, prefix, rename = LORA_FILES[fmt]
    out = export_lora(lora_run, fmt)
    assert [p.name for p in out.iterdir()] == [name]
    file = out / name
    keys = header(file)[0]
    assert all(k.startswith(prefix) and k.endswith((".lora_A.weight", ".lora_B.weight")) for k in keys)
    assert len(keys) == 2 * len(adapter_modules(lora_run)) and not any(".default" in k for k in keys)
    transformer = diffusers_with_lora(lora_run, out, name)
    check_every_adapter_matched(transformer, lora_run, file, prefix, rename)
    (x, t, context), expected = merged_output
    geometry = load_pretrained(lora_run["base"]).geometry
    with torch.no_grad():
        got = diffusers_forward(transformer, geometry, x, t, context)
    close(got, expected, MERGED, f"diffusers + --lora-format {fmt}")


def test_ltx_lora_file_is_what_ltx_core_and_comfyui_apply(lora_run, merged_output):
    """LTX's LoRA keys: ltx-core's ``apply_loras`` adds ``strength * B @ A`` to the weight named by
    the key less ``diffusion_model.`` and ``.lora_A/B``; ComfyUI maps ``diffusion_model.<module>``
    onto ``diffusion_model.<module>.weight`` and, with no ``.alpha`` key, adds the same. Both
    reproduce videodit's merged weights."""
    lora = load_file(str(export_lora(lora_run, "comfyui") / "lora_comfyui.safetensors"))
    base, merged = (load_pretrained(lora_run[k]).eval() for k in ("base", "merged"))
    base_state, merged_state = base.state_dict(), merged.state_dict()
    patched = dict(base_state)
    for key in (k for k in lora if k.endswith(".lora_A.weight")):
        module = key.removeprefix("diffusion_model.").removesuffix(".lora_A.weight")
        down, up = lora[key], lora[f"diffusion_model.{module}.lora_B.weight"]
        patched[f"{module}.weight"] = base_state[f"{module}.weight"] + 1.0 * (up @ down)   # strength 1
    assert sorted(k.removesuffix(".weight") for k in patched if not torch.equal(patched[k], base_state[k])) == \
        adapter_modules(lora_run)
    assert max(relative(patched[k], merged_state[k]) for k in merged_state) <= 1e-6
    base.load_state_dict(patched)
    (x, t, context), expected = merged_output
    with torch.no_grad():
        close(base(x, t, context), expected, MERGED, "ltx-core / ComfyUI rule on --lora-format comfyui")


def test_peft_lora_loads_with_peftmodel_on_the_videodit_base(lora_run, merged_output):
    from peft import PeftModel

    out = export_lora(lora_run, "peft")
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    keys = header(out / "adapter_model.safetensors")[0]
    assert {k.removeprefix("base_model.model.").split(".lora_")[0] for k in keys} == set(adapter_modules(lora_run))
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8)
    model = PeftModel.from_pretrained(load_pretrained(lora_run["base"]).eval(), out)
    (x, t, context), expected = merged_output
    with torch.no_grad():
        close(model(x, t, context), expected, MERGED, "PeftModel + --lora-format peft")


def test_merged_run_exports_as_a_release_file_that_loads_back(lora_run, tmp_path):
    """A trained run's model (the LoRA run merged) as ``--format ltx2``: the file loads back as the
    same LTX-2 model (``load_pretrained`` reads the release layout)."""
    cli("ckpt", "export", lora_run["merged"], tmp_path / "finetune", "--format", "ltx2")
    again = load_pretrained(tmp_path / "finetune" / "finetune.safetensors")
    merged = load_pretrained(lora_run["merged"])
    assert again.geometry == merged.geometry
    state = merged.state_dict()
    assert all(torch.equal(v, state[k]) for k, v in again.state_dict().items())


# ----------------------------------------------------------------------------- refusals


BAD_REQUESTS = {   # case -> (source, extra arguments, what the one line says)
    "wan format": ("imported", ["--format", "wan"],
                   "--format wan does not apply to a ltx2 model; it exports as: videodit, ltx2, comfyui, diffusers"),
    "mmdit format": ("imported", ["--format", "opensora-v2"], "it exports as: videodit, ltx2, comfyui, diffusers"),
    "lora run unmerged": ("run", ["--format", "ltx2"], "is a LoRA checkpoint (adapters only): pass --merge-lora"),
    "merge and format": ("run", ["--format", "comfyui", "--merge-lora"], "--merge-lora writes a videodit model folder"),
    "lora of an import": ("imported", ["--lora-format", "comfyui"], "holds a whole model, not a LoRA run's adapters"),
    "lora of a merged run": ("merged", ["--lora-format", "peft"], "is not a LoRA run"),
    "lora and format": ("run", ["--lora-format", "comfyui", "--format", "ltx2"], "pass one of them"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_requests_are_one_line_and_write_nothing(imported, lora_run, tmp_path, capsys, case):
    source, extra, message = BAD_REQUESTS[case]
    path = imported["ltx2.3"] if source == "imported" else lora_run[source]
    capsys.readouterr()
    assert main(["ckpt", "export", str(path), str(tmp_path / "out"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists() and not any(p.name.startswith(".staging") for p in tmp_path.iterdir())
