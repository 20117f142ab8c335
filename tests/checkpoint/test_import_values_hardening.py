"""Issue #35, import half: what a released or imported file may ask for. Each case ends in one
``error:`` line (exit 2) with nothing written, and every "set X" / "add X" / "pass X" in such a
line is followed here and works.

    2. names, indices and shapes are bounded before anything is allocated (a memory cap in a
       subprocess: one line, quickly);
    4. every config value read from a file is checked as the schema checks its own;
    6. model.init_from compares the source's architecture fields, not only shapes;
    10. advice that works where it is said (Open-Sora 2.0's RoPE split as model.axes_dim);
    11. imports record their own family's encoders; Open-Sora 2.0 files never end in a traceback
        nor in another family's message."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from videodit.cli import main
from videodit.config import load_config
from videodit.errors import UserError

FIXTURES = Path(__file__).parents[1] / "fixtures"
WAN = FIXTURES / "wan"
OS2 = FIXTURES / "opensora2" / "mmdit" / "Open_Sora_v2.safetensors"
STDIT = FIXTURES / "opensora" / "stdit3"
MMDIT_TINY = ["--config", "tiny", "model.preset=mmdit-tiny"]


def run_cli(capsys, *args) -> tuple[int, str]:
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err.strip()


def one_line(err: str, *words: str) -> None:
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert all(w in err for w in words), err


# ---------------------------------------------------------------------------- 2. bounded headers

CAP = 6 << 30   # address space: the CLI with torch needs ~4 GiB of it; a range of 10^12 indices needs far more


def capped_cli(*args, timeout: float = 120) -> tuple[int, str, float]:
    """The CLI in a subprocess under an address-space cap: (exit code, stderr, seconds)."""
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (CAP, CAP))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(Path(__file__).parents[2])}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "videodit", *map(str, args)], preexec_fn=cap, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stderr.strip(), time.monotonic() - started


def os2_with(tmp_path: Path, extra: dict) -> Path:
    tensors = load_file(str(OS2))
    tensors.update(extra)
    out = tmp_path / "Open_Sora_v2.safetensors"
    save_file(tensors, str(out))
    return out


def stdit_checkpoint_with(tmp_path: Path, extra: dict) -> Path:
    """An Open-Sora 1.2 training checkpoint as one weights file (no config.json: read off the names)."""
    tensors = load_file(str(STDIT / "model.safetensors"))
    tensors.update(extra)
    out = tmp_path / "ema.safetensors"
    save_file(tensors, str(out))
    return out


def wan_model_folder(tmp_path: Path, **config) -> Path:
    """A videodit model folder (an import of Wan's fixture) whose config.json then says ``config``."""
    assert main(["ckpt", "import", str(WAN / "wan"), str(tmp_path / "folder")]) == 0
    file = tmp_path / "folder" / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **config}))
    return tmp_path / "folder"


HEADERS = {
    "mmdit index 10^12": lambda tmp: ["ckpt", "import", os2_with(tmp, {
        "double_blocks.1000000000000.img_attn.proj.bias": torch.zeros(1)}), tmp / "out", *MMDIT_TINY],
    "mmdit 30000 blocks named": lambda tmp: ["ckpt", "import", os2_with(tmp, {
        f"double_blocks.{i}.img_attn.proj.bias": torch.zeros(1) for i in range(2, 30000)}), tmp / "out", *MMDIT_TINY],
    "stdit index 10^12": lambda tmp: ["ckpt", "import", stdit_checkpoint_with(tmp, {
        "spatial_blocks.1000000000000.attn.proj.bias": torch.zeros(1)}), tmp / "out"],
    "wan model folder num_layers 10^6": lambda tmp: ["ckpt", "export", wan_model_folder(tmp, num_layers=10**6),
                                                     tmp / "out", "--format", "diffusers"],
}


@pytest.mark.parametrize("case", list(HEADERS))
def test_what_names_and_configs_ask_for_is_bounded_under_a_memory_cap(tmp_path, case):
    code, err, seconds = capped_cli(*HEADERS[case](tmp_path))
    assert code == 2, err[-2000:]
    one_line(err.splitlines()[-1] if err else "")
    assert len(err.splitlines()) == 1 and seconds < 60, (err[-2000:], seconds)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------- 4. config values

WAN_VALUES = [   # (layout, config.json edit, the words of the one line)
    ("wan", {"eps": float("nan")}, "eps=nan is not a finite number"),
    ("wan", {"eps": "abc"}, "eps='abc' is not a number"),
    ("wan", {"eps": -1.0}, "eps=-1.0 is out of range"),
    ("wan", {"patch_size": [0, 0, 0]}, "patch_size=[0, 0, 0] is not a list of 3 whole numbers"),
    ("wan", {"freq_dim": 10**12}, "freq_dim=1000000000000 is out of range"),
    ("wan", {"text_len": 10**9}, "text_len=1000000000 is out of range"),
    ("wan", {"text_len": 0}, "text_len=0 is out of range"),
    ("wan", {"num_heads": 2.0}, "num_heads=2.0 is not a whole number"),
    ("wan", {"qk_norm": "yes"}, "qk_norm='yes' is not true or false"),
    ("diffusers", {"eps": float("nan")}, "eps=nan is not a finite number"),
    ("diffusers", {"patch_size": [0, 0, 0]}, "patch_size=[0, 0, 0] is not a list"),
    ("diffusers", {"freq_dim": 10**12}, "freq_dim=1000000000000 is out of range"),
    ("diffusers", {"num_attention_heads": -2, "attention_head_dim": -32}, "num_attention_heads=-2 is out of range"),
    ("diffusers", {"cross_attn_norm": "no"}, "cross_attn_norm='no' is not true or false"),
]


@pytest.mark.parametrize("layout, edit, words", WAN_VALUES)
def test_wan_config_values_are_checked_at_import(tmp_path, capsys, layout, edit, words):
    src = tmp_path / "src"
    shutil.copytree(WAN / layout, src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, **edit}))
    code, err = run_cli(capsys, "ckpt", "import", src, tmp_path / "out")
    assert code == 2
    one_line(err, "config.json", words, "restore the config.json of the Wan download")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit, words", [
    ({"eps": float("nan")}, "eps=nan is not a finite number"),
    ({"text_len": 10**9}, "text_len=1000000000 is out of range"),
    ({"num_heads": 0}, "not a videodit wan config"),
    ({"qk_norm": "false"}, "qk_norm='false' is not true or false"),
])
def test_a_model_folders_config_values_are_checked_when_it_is_read(tmp_path, capsys, edit, words):
    from videodit.models import load_pretrained

    folder = wan_model_folder(tmp_path, **edit)
    with pytest.raises(UserError, match=None) as error:
        load_pretrained(folder)
    one_line(f"error: {error.value}", words)
    code, err = run_cli(capsys, "ckpt", "export", folder, tmp_path / "out", "--format", "wan")
    assert code == 2 and not (tmp_path / "out").exists()
    one_line(err, words)


# ---------------------------------------------------------------------------- 6. init_from's architecture

def wan_run_model(overrides: list[str]):
    """The model a Wan run of these overrides builds, sized for the Wan fixture's encoders."""
    from videodit.components import build_model

    cfg = load_config("tiny", ["model.preset=wan-tiny", "model.depth=2", "model.hidden_size=64", *overrides])
    return build_model(cfg, SimpleNamespace(latent_channels=16), SimpleNamespace(dim=32))


@pytest.mark.parametrize("source", ["wan", "diffusers", "imported"])
def test_init_from_compares_the_architecture_and_its_advice_works(tmp_path, source):
    """The fixture has 2 heads; a 4-head run holds the same shapes but is another model."""
    from videodit.train.state import init_weights_from

    path = WAN / source if source != "imported" else wan_model_folder(tmp_path)
    with pytest.raises(UserError) as error:
        init_weights_from(wan_run_model(["model.num_heads=4"]), str(path))
    one_line(f"error: {error.value}", "num_heads=2 there, 4 here", "set model.num_heads=2")
    advice = str(error.value).split("; set ")[-1].split()
    model = wan_run_model(advice)   # the advice, followed
    assert init_weights_from(model, str(path))


def test_init_from_a_checkpoint_of_other_heads_is_refused(toy_dir, tmp_path):
    from conftest import tiny_overrides
    from videodit.train.trainer import Trainer

    common = tiny_overrides(toy_dir, **{"train.max_steps": 1, "checkpoint.every_steps": 1})
    Trainer(load_config("tiny", common), tmp_path / "run").fit()   # 2 heads of 16
    with pytest.raises(UserError, match=r"num_heads=2 there, 4 here\); set model.num_heads=2$"):
        Trainer(load_config("tiny", common + ["model.num_heads=4", f"model.init_from={tmp_path / 'run'}"]),
                tmp_path / "again")


# ---------------------------------------------------------------------------- 10. advice that works

def os2_head_24(tmp_path: Path) -> Path:
    """An Open-Sora 2.0 MMDiT trained at another size: heads of 24 channels (no released RoPE split)."""
    from videodit.models.mmdit.model import MMDiT, MMDiTGeometry

    geometry = MMDiTGeometry(hidden_size=48, num_heads=2, depth=1, depth_single_blocks=1, latent_channels=4,
                             vec_in_dim=8, context_in_dim=16, axes_dim=(4, 10, 10))
    model = MMDiT(geometry)
    out = tmp_path / "os2" / "Open_Sora_v2.safetensors"
    out.parent.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out))
    return out


@pytest.mark.parametrize("config", [[], ["--config", "opensora-v2-stage1"]])
def test_the_rope_split_advice_of_an_import_works(tmp_path, capsys, config):
    from videodit.models import load_pretrained

    src = os2_head_24(tmp_path)
    code, err = run_cli(capsys, "ckpt", "import", src, tmp_path / "out", *config)
    assert code == 2 and not (tmp_path / "out").exists()
    one_line(err, "heads of 24 channels", "give one with model.axes_dim=[frames,rows,columns]", "summing to 24")
    code, err = run_cli(capsys, "ckpt", "import", src, tmp_path / "out", *config, "model.axes_dim=[4,10,10]")
    assert code == 0, err
    assert load_pretrained(tmp_path / "out").geometry.axes_dim == (4, 10, 10)


def test_the_rope_split_of_init_from_comes_from_the_run(tmp_path):
    from videodit.components import build_model
    from videodit.train.state import init_weights_from

    src = os2_head_24(tmp_path)
    cfg = load_config("tiny", ["model.preset=mmdit-tiny", "model.hidden_size=48", "model.num_heads=2", "model.depth=1",
                               "model.depth_single=1", "model.vec_in_dim=8", "model.axes_dim=[4,10,10]"])
    model = build_model(cfg, SimpleNamespace(latent_channels=4), SimpleNamespace(dim=16))
    assert init_weights_from(model, str(src)).startswith("Open-Sora 2.0 weights")


def test_a_config_of_another_family_is_refused_and_the_advice_works(tmp_path, capsys):
    code, err = run_cli(capsys, "ckpt", "import", WAN / "wan", tmp_path / "out", "--config", "tiny")
    assert code == 2 and not (tmp_path / "out").exists()
    one_line(err, "--config tiny describes a stdit model", "pass a wan config (e.g. --config "
             "wan2.1-t2v-1.3b-finetune) or leave --config out")
    assert main(["ckpt", "import", str(WAN / "wan"), str(tmp_path / "a"), "--config", "wan2.1-t2v-1.3b-finetune"]) == 0
    assert main(["ckpt", "import", str(WAN / "wan"), str(tmp_path / "b")]) == 0


# ---------------------------------------------------------------------------- 11. weak spots

@pytest.mark.parametrize("src, vae, text", [(WAN / "wan", "wan2.1", "umt5"), (WAN / "diffusers", "wan2.1", "umt5"),
                                            (OS2, "hunyuan", "t5-clip"), (STDIT, "opensora-v1.2", "transformers")])
def test_an_import_records_its_own_familys_encoders(tmp_path, src, vae, text):
    import yaml

    assert main(["ckpt", "import", str(src), str(tmp_path / "out")]) == 0
    run_config = yaml.safe_load((tmp_path / "out" / "run_config.yaml").read_text())
    assert (run_config["vae"]["kind"], run_config["text"]["kind"]) == (vae, text)


OS2_SHAPES = {   # an edit of the released file -> the words of its one line
    "img_in 1-D": ({"img_in.weight": torch.zeros(64)}, "img_in.weight has shape [64]"),
    "q norm a scalar": ({"double_blocks.0.img_attn.norm.query_norm.scale": torch.zeros(())}, "has shape []"),
    "vector_in 1-D": ({"vector_in.in_layer.weight": torch.zeros(64)}, "vector_in.in_layer.weight has shape [64]"),
    "cond_in 1-D": ({"cond_in.weight": torch.zeros(64)}, "cond_in.weight has shape [64]"),
    "cond_in narrower": ({"cond_in.weight": torch.zeros(64, 10)}, "fit no square patch"),
    "cond_in as wide": ({"cond_in.weight": torch.zeros(64, 16)}, "fit no square patch"),
    "no width": ({"img_in.weight": torch.zeros(0, 16)}, "img_in.weight has shape [0, 16]"),
    "txt_in 1-D": ({"txt_in.weight": torch.zeros(64)}, "txt_in.weight has shape [64]"),
    "heads wider than the model": ({"double_blocks.0.img_attn.norm.query_norm.scale": torch.zeros(128)},
                                   "heads of 128 channels"),
}


@pytest.mark.parametrize("case", list(OS2_SHAPES))
def test_open_sora_2_files_of_odd_shapes_end_in_one_line(tmp_path, capsys, case):
    edit, words = OS2_SHAPES[case]
    code, err = run_cli(capsys, "ckpt", "import", os2_with(tmp_path, edit), tmp_path / "out", *MMDIT_TINY)
    assert code == 2
    one_line(err, words, "Open_Sora_v2.safetensors")


@pytest.mark.parametrize("missing", ["txt_in.weight", "img_in.weight"])
def test_an_incomplete_open_sora_2_file_is_named_as_one(tmp_path, capsys, missing):
    tensors = load_file(str(OS2))
    del tensors[missing]
    src = tmp_path / "Open_Sora_v2.safetensors"
    save_file(tensors, str(src))
    code, err = run_cli(capsys, "ckpt", "import", src, tmp_path / "out")
    assert code == 2
    one_line(err, f"lacks {missing}, which every Open-Sora 2.0 MMDiT has")
