"""Issue #35, import/export half: where outputs may go, what a sharded folder is, two-expert
folders, and refusals that leave nothing behind. Each case ends in one ``error:`` line (exit 2)
with nothing written, or works as the rest of the system reads it.

    1. outputs never inside folders videodit manages and deletes (a run's checkpoints/, a
       checkpoint, staging folders, a feature cache);
    3. a Wan 2.2 two-expert folder imports as the two-expert model folder sample and
       model.init_from read;
    5. a sharded folder is read exactly as its index names it;
    7. a refused export (or import) leaves nothing, so the same command runs again.

Values, headers and advice (items 2, 4, 6, 10, 11) are test_import_values_hardening.py's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import tiny_overrides
from videodit.checkpoint import save_checkpoint
from videodit.cli import main
from videodit.config import load_config, to_yaml

FIXTURES = Path(__file__).parents[1] / "fixtures"
WAN = FIXTURES / "wan" / "wan"
OS2 = FIXTURES / "opensora2" / "mmdit" / "Open_Sora_v2.safetensors"
STDIT = FIXTURES / "opensora" / "stdit3"
WAN_TINY = {"model.preset": "wan-tiny", "model.depth": 1, "model.num_heads": 2, "model.hidden_size": 32,
            "model.patch_size": "[1,2,2]", "diffusion.constant_shift": 3.0, "diffusion.prediction": "velocity",
            "diffusion.loss_space": "velocity", "text.max_length": 512}


def run_cli(capsys, *args) -> tuple[int, str]:
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err.strip()


def one_line(err: str, *words: str) -> None:
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert all(w in err for w in words), err


@pytest.fixture(scope="module")
def run(toy_dir, tmp_path_factory):
    """A finished tiny run: two steps, a checkpoint at each."""
    from videodit.train.trainer import Trainer

    out = tmp_path_factory.mktemp("hardening") / "run"
    Trainer(load_config("tiny", tiny_overrides(toy_dir, **{"train.max_steps": 2, "checkpoint.every_steps": 1})),
            out).fit()
    return out


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------- 1. managed folders

def managed_place(run: Path, tmp_path: Path, where: str) -> Path:
    """An output path inside a folder videodit manages and deletes in."""
    step = run / "checkpoints" / "step-0000002"
    if where == "checkpoint":
        return step / "sub"
    if where == "checkpoints":
        return run / "checkpoints" / "mine"
    if where == "staging":
        return tmp_path / ".staging-other-1" / "out"
    if where == "symlink":   # a link into a checkpoint is the checkpoint
        (tmp_path / "link").symlink_to(step, target_is_directory=True)
        return tmp_path / "link" / "sub"
    cache = tmp_path / "cache"   # a feature cache
    (cache / "shards").mkdir(parents=True)
    (cache / "manifest.json").write_text(json.dumps({"format": "videodit-feature-cache"}))
    return cache / "shards" / "sub"


@pytest.mark.parametrize("where", ["checkpoint", "checkpoints", "staging", "symlink", "cache"])
@pytest.mark.parametrize("command", ["export", "import"])
def test_outputs_inside_folders_videodit_deletes_are_refused(run, tmp_path, capsys, where, command):
    out = managed_place(run, tmp_path, where)
    before = tree(run)
    args = ["ckpt", "export", run, out] if command == "export" else ["ckpt", "import", WAN, out]
    code, err = run_cli(capsys, *args)
    assert code == 2
    one_line(err, str(out), "is inside", "may be deleted", f"{command} to a folder outside it")
    assert not out.exists() and tree(run) == before


def test_cache_build_inside_a_checkpoint_is_refused(run, toy_dir, capsys):
    out = run / "checkpoints" / "step-0000002" / "cache"
    code, err = run_cli(capsys, "cache", "build", "tiny", *tiny_overrides(toy_dir), "--out", out)
    assert code == 2
    one_line(err, "is inside the checkpoint", "build the cache in a folder outside it")
    assert not out.exists()


def test_an_export_beside_the_checkpoints_is_fine_and_retention_keeps_its_promise(run, tmp_path, capsys):
    assert main(["ckpt", "export", str(run), str(run / "exported")]) == 0   # the run folder itself is the user's
    assert (run / "exported" / "model.safetensors").is_file()
    shutil.rmtree(run / "exported")


# ---------------------------------------------------------------------------- 3. two experts

@pytest.fixture(scope="module")
def experts(toy_dir, tmp_path_factory):
    """A Wan 2.2 two-expert release made small (Wan's layout), sized for the tiny config's encoders."""
    from videodit.components import build_encoders, model_geometry
    from videodit.models.families import get_spec
    from videodit.models.wan.layouts import write_wan_folder

    cfg = load_config("tiny", tiny_overrides(toy_dir, **WAN_TINY))
    vae, text = build_encoders(cfg, torch.device("cpu"))
    geometry = model_geometry(cfg, vae.latent_channels, text.dim)
    root = tmp_path_factory.mktemp("experts")
    states = {}
    for seed, folder in enumerate(("high_noise_model", "low_noise_model")):
        torch.manual_seed(seed)
        model = get_spec("wan").build(geometry)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(std=0.1)
        states[folder] = model.state_dict()
        write_wan_folder(states[folder], geometry, root / "wan" / folder)
        write_wan_folder(states[folder], geometry, root / "diffusers" / ("transformer" if seed == 0 else
                                                                          "transformer_2"), layout="diffusers")
    (root / "diffusers" / "model_index.json").write_text("{}")
    return root, states


@pytest.mark.parametrize("layout", ["wan", "diffusers"])
def test_a_two_expert_release_imports_as_the_folder_sample_and_init_from_read(experts, toy_dir, tmp_path, capsys,
                                                                             layout):
    from videodit.models import load_pretrained
    from videodit.sample import Pipeline
    from videodit.train.trainer import Trainer

    root, states = experts
    common = tiny_overrides(toy_dir, **WAN_TINY)
    out = tmp_path / "imported"
    code = main(["ckpt", "import", str(root / layout), str(out), "--config", "tiny", *common,
                 "model.expert=both", "model.expert_boundary=0.75", "sample.expert_cfg=[2.0,5.0]"])
    assert code == 0, capsys.readouterr().err
    assert "imported two experts" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["high_noise_model", "low_noise_model"]
    for folder, state in states.items():
        model = load_pretrained(out / folder)
        assert all(torch.equal(t, state[name]) for name, t in model.state_dict().items())
        run_config = (out / folder / "run_config.yaml").read_text()
        assert f"expert: {folder.split('_')[0]}" in run_config
    # sample pairs them; init_from takes one expert or both
    pair = Pipeline(out / "high_noise_model", low_noise=out / "low_noise_model", device="cpu")
    assert pair.expert_guidance(torch.tensor([0.9])) == 5.0 and pair.expert_guidance(torch.tensor([0.5])) == 2.0
    assert pair(["a red circle moving right"], steps=2, seed=0).shape[0] == 1
    both = Trainer(load_config("tiny", common + [f"model.init_from={out}", "model.expert=both",
                                                 "model.expert_boundary=0.75", "train.max_steps=1"]),
                   tmp_path / "both")
    for name, t in both.model.state_dict().items():
        expert, _, rest = name.partition(".")
        assert torch.equal(t, states[expert][rest])
    high = Trainer(load_config("tiny", common + [f"model.init_from={out}", "model.expert=high",
                                                 "model.expert_boundary=0.75", "train.max_steps=1"]),
                   tmp_path / "high")
    assert all(torch.equal(t, states["high_noise_model"][n]) for n, t in high.model.state_dict().items())
    # the folder of both is not one model: sample says which folders to pass
    code, err = run_cli(capsys, "sample", "--ckpt", out, "--prompt", "x")
    assert code == 2
    one_line(err, "holds two experts' model folders", f"--ckpt {out / 'high_noise_model'} --low-noise-ckpt")


def test_a_two_expert_import_needs_the_boundary_and_writes_nothing_without_it(experts, toy_dir, tmp_path, capsys):
    root, _ = experts
    common = tiny_overrides(toy_dir, **WAN_TINY)
    out = tmp_path / "new" / "imported"
    code, err = run_cli(capsys, "ckpt", "import", root / "wan", out, "--config", "tiny", *common)
    assert code == 2
    one_line(err, "holds two experts", "add model.expert_boundary=B")
    assert not (tmp_path / "new").exists()
    code, _ = run_cli(capsys, "ckpt", "import", root / "wan", out, "--config", "tiny", *common,
                      "model.expert_boundary=0.75")   # the advice, followed
    assert code == 0 and (out / "low_noise_model" / "model.safetensors").is_file()


# ---------------------------------------------------------------------------- 5. sharded folders

def sharded(folder: Path, state: dict, index_name: str, edit: str) -> None:
    """``state`` in two safetensors shards beside ``index_name``, then damaged as ``edit`` says."""
    names = sorted(state)
    shards = {"part-00001.safetensors": names[: len(names) // 2], "part-00002.safetensors": names[len(names) // 2:]}
    first, second = shards
    victim = shards[first][0]
    tensors = {shard: {k: state[k] for k in keys} for shard, keys in shards.items()}
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    if edit == "in two shards":   # the later shard's copy differs: a loader that lets it win loads the wrong one
        tensors[second][victim] = torch.zeros_like(state[victim])
    elif edit == "index names another shard":
        weight_map[victim] = second
    elif edit == "unnamed tensor":
        tensors[first]["extra.weight"] = torch.zeros(2)
    elif edit == "shard outside":
        weight_map[victim] = "../" + first
    elif edit == "shard not a string":
        weight_map[victim] = 5
    folder.mkdir(parents=True, exist_ok=True)
    for shard, own in tensors.items():
        save_file(own, str(folder / shard))
    (folder / index_name).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def sharded_release(family: str, tmp_path: Path, edit: str) -> Path:
    if family == "wan":
        folder = tmp_path / "wan"
        folder.mkdir()
        shutil.copy(WAN / "config.json", folder)
        sharded(folder, load_file(str(WAN / "diffusion_pytorch_model.safetensors")),
                "diffusion_pytorch_model.safetensors.index.json", edit)
        return folder
    if family == "stdit":
        folder = tmp_path / "stdit3"
        folder.mkdir()
        shutil.copy(STDIT / "config.json", folder)
        sharded(folder, load_file(str(STDIT / "model.safetensors")), "model.safetensors.index.json", edit)
        return folder
    ckpt = tmp_path / "epoch0-global_step10"   # Open-Sora 2.0's training checkpoint: model/ with the shards
    sharded(ckpt / "model", load_file(str(OS2)), "model.safetensors.index.json", edit)
    (ckpt / "running_states.json").write_text("{}")
    return ckpt


EDITS = {"in two shards": "is in two shards", "index names another shard": "but it is in part-00001",
         "unnamed tensor": "which the index does not name", "shard outside": "which is not a file beside it",
         "shard not a string": "no weight_map of tensor names to shard files"}


@pytest.mark.parametrize("edit", list(EDITS))
@pytest.mark.parametrize("family", ["wan", "mmdit", "stdit"])
def test_a_sharded_folder_is_read_exactly_as_its_index_names_it(tmp_path, capsys, family, edit):
    config = {"wan": [], "mmdit": ["--config", "tiny", "model.preset=mmdit-tiny"], "stdit": []}[family]
    src = sharded_release(family, tmp_path, edit)
    code, err = run_cli(capsys, "ckpt", "import", src, tmp_path / "out", *config)
    assert code == 2
    one_line(err, EDITS[edit])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", ["wan", "mmdit", "stdit"])
def test_a_sharded_folder_as_its_index_names_it_imports(tmp_path, capsys, family):
    config = {"wan": [], "mmdit": ["--config", "tiny", "model.preset=mmdit-tiny"], "stdit": []}[family]
    assert main(["ckpt", "import", str(sharded_release(family, tmp_path, "")), str(tmp_path / "out"), *config]) == 0


# ---------------------------------------------------------------------------- 7. nothing left behind

def expert_checkpoint(root: Path, toy_dir, expert: str, range_: str):
    """A checkpoint of a one-expert run (model.expert=high|low), written as training writes one."""
    from videodit.components import build_model
    from types import SimpleNamespace

    cfg = load_config("tiny", tiny_overrides(toy_dir, **WAN_TINY, **{
        "model.expert": expert, "model.expert_boundary": 0.75, "diffusion.timestep_range": range_}))
    model = build_model(cfg, SimpleNamespace(latent_channels=3), SimpleNamespace(dim=64))
    return save_checkpoint(root / "checkpoints", 1, tensors={"model": model.state_dict()}, torch_states={},
                           json_state={"step": 1}, config_yaml=to_yaml(cfg))


def test_a_refused_expert_pair_export_leaves_nothing_and_runs_again(toy_dir, tmp_path, capsys):
    high = expert_checkpoint(tmp_path / "high", toy_dir, "high", "[0.75,1.0]")
    low = expert_checkpoint(tmp_path / "low", toy_dir, "low", "[0.0,0.75]")
    weights = low / "model.safetensors"
    good = weights.read_bytes()
    damaged = bytearray(good)
    damaged[-3] ^= 0xFF
    weights.write_bytes(bytes(damaged))
    out = tmp_path / "new" / "pair"
    code, err = run_cli(capsys, "ckpt", "export", high, out, "--low-noise-ckpt", low, "--format", "wan")
    assert code == 2
    one_line(err, "model.safetensors does not match its SHA-256")
    assert not (tmp_path / "new").exists()   # no high_noise_model/ left, nor the folders made for it
    weights.write_bytes(good)
    code, err = run_cli(capsys, "ckpt", "export", high, out, "--low-noise-ckpt", low, "--format", "wan")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["high_noise_model", "low_noise_model"]
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".staging-")]
