import pytest

from videodit.cli import main
from videodit.config import MODEL_PRESETS, builtin_presets, from_dict, load_config, parse_override, to_yaml
from videodit.data.buckets import parse_bucket_config, resolve_bucket_config
from videodit.errors import UserError
import yaml


def test_default_is_tiny_preset_with_geometry_filled_in():
    cfg = load_config()
    assert cfg.model.preset == "tiny"
    assert cfg.model.hidden_size == MODEL_PRESETS["tiny"]["hidden_size"]
    assert cfg.model.patch_size == MODEL_PRESETS["tiny"]["patch_size"]


def test_overrides_apply_and_are_typed():
    cfg = load_config("tiny", ["train.max_steps=7", "train.lr=1e-3", "model.preset=S", "model.depth=2",
                               "train.betas=[0.8, 0.9]"])
    assert cfg.train.max_steps == 7 and isinstance(cfg.train.lr, float)
    assert cfg.model.hidden_size == MODEL_PRESETS["S"]["hidden_size"] and cfg.model.depth == 2
    assert cfg.train.betas == [0.8, 0.9]


def test_yaml_file_round_trip(tmp_path):
    cfg = load_config("tiny", ["train.seed=3"])
    path = tmp_path / "c.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(str(path)) == cfg
    assert from_dict(yaml.safe_load(to_yaml(cfg))) == cfg


@pytest.mark.parametrize("override, message", [
    ("train.max_step=5", "unknown config key train.max_step; did you mean train.max_steps?"),
    ("nonsense=1", "unknown config key nonsense"),
    ("train.max_steps=abc", "train.max_steps must be an integer"),
    ("train.max_steps=1.5", "train.max_steps must be an integer"),
    ("train.batch_size=-4", "train.batch_size=-4 is too small; it must be >= 1"),
    ("model.preset=XXL", "model.preset='XXL' is not allowed; choose one of: tiny, S, B, XL"),
    ("train.precision=fp8", "choose one of: auto, fp32, bf16"),
    ("model.num_heads=5", "model.num_heads=5 does not divide model.hidden_size=128"),
    ("memory.checkpointing=maybe", "memory.checkpointing"),
    ("model.patch_size=[1,2]", "model.patch_size must have 3 entries"),
    ("vae.kind=diffusers", "vae.path is required for vae.kind=diffusers"),
    ("vae.kind=opensora-v1.2", "vae.path is required for vae.kind=opensora-v1.2"),
    ("train", "must look like key.sub=value"),
    (f"train.batch_size={10**30}", f"train.batch_size={10**30} is too large; it must be <= 65536"),
    ("lora.rank=1e9", "lora.rank=1000000000 is too large; it must be <= 65536"),
    ("lora.alpha=-1", "lora.alpha=-1.0 is too small; it must be > 0.0"),
    ("lora.alpha=0", "lora.alpha=0.0 is too small; it must be > 0.0 (adapter"),
    ("model.task=ti2v", "model.task=ti2v / model.image_dim belong to the Wan family, not stdit"),
    ("diffusion.timestep_range=[0.9, 0.5]", "diffusion.timestep_range=[0.9, 0.5] is empty"),
])
def test_bad_values_name_the_key(override, message):
    with pytest.raises(UserError) as info:
        load_config("tiny", [override])
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("overrides, message", [
    (["model.preset=wan-tiny", "diffusion.mask_ratios={image_head: 0.5}"], "set model.task=ti2v (not t2v)"),
    (["model.preset=wan-tiny", "model.image_dim=1280"], "model.image_dim (CLIP features) needs model.task=i2v"),
])
def test_wan_variant_settings_that_do_not_fit_are_one_line(overrides, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config("tiny", overrides)


def test_unknown_preset_and_missing_file():
    with pytest.raises(UserError, match="neither a YAML file nor a preset"):
        load_config("nope")
    with pytest.raises(UserError, match="does not exist"):
        load_config("missing.yaml")


def test_parse_override_values():
    assert parse_override("a.b=3") == ("a.b", 3)
    assert parse_override("a.b=null") == ("a.b", None)
    assert parse_override("a.b=hello world") == ("a.b", "hello world")


@pytest.mark.parametrize("name", builtin_presets())
def test_every_builtin_config_loads_and_round_trips(name):
    cfg = load_config(name)
    assert cfg.name == name
    assert from_dict(yaml.safe_load(to_yaml(cfg))) == cfg


@pytest.mark.parametrize("alias, expected", [
    ("grad_checkpoint=true", "full"), ("grad_checkpoint=false", "none"),
    ("train.activation_checkpointing=true", "full"),   # the key of earlier runs' config.yaml
])
def test_checkpointing_aliases(alias, expected):
    assert load_config("tiny", [alias]).memory.checkpointing == expected


def test_checkpointing_alias_conflict_is_one_line():
    with pytest.raises(UserError, match="conflicts with grad_checkpoint=true"):
        load_config("tiny", ["grad_checkpoint=true", "memory.checkpointing=selective"])


def test_bad_bucket_config_is_one_line_where_the_data_is_built(capsys):
    # load_config leaves data.bucket_config to the data package (config does not import data/).
    cfg = load_config("tiny", ["data.bucket_config={'999p': {1: [1.0, 2]}}"])
    with pytest.raises(UserError) as info:
        parse_bucket_config(resolve_bucket_config(cfg.data))
    assert "unknown resolution '999p' in bucket_config" in str(info.value)
    assert "\n" not in str(info.value)
    assert main(["config", "show", "tiny", "data.bucket_config={'999p': {1: [1.0, 2]}}"]) == 2
    captured = capsys.readouterr()
    assert "unknown resolution '999p'" in captured.err and captured.out == ""


def _alias_bomb(levels: int = 9) -> str:
    """Flow YAML whose last alias expands to 9**levels values ("billion laughs")."""
    rows = ['&a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    rows += [f"&a{i} [{','.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return f"[{', '.join(rows)}]"


@pytest.mark.parametrize("key", ["diffusion.mask_ratios", "train.max_steps"])
@pytest.mark.parametrize("where", ["file", "override"])
def test_yaml_alias_bomb_is_refused_before_expansion(key, where, tmp_path, capsys):
    import resource
    import time
    section, name = key.split(".")
    if where == "file":
        path = tmp_path / "bomb.yaml"
        path.write_text(f"{section}:\n  {name}: {_alias_bomb()}\n")
        argv = ["config", "show", str(path)]
    else:
        argv = ["config", "show", "tiny", f"{key}={_alias_bomb()}"]
    before, start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.monotonic()
    assert main(argv) == 2
    assert time.monotonic() - start < 1.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 * 1024   # KiB: under 100 MiB
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "aliases (*name) expand to more than" in err and "\n" not in err and len(err) < 400
    assert captured.out == ""


@pytest.mark.parametrize("value", ["&a [*a]", "&a {k: [1, *a]}"])
def test_yaml_self_referencing_alias_is_refused(value, tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text(f"train:\n  betas: {value}\n")
    with pytest.raises(UserError, match="refers to a value that contains it"):
        load_config(str(path))
    with pytest.raises(UserError, match="refers to a value that contains it"):
        load_config("tiny", [f"train.betas={value}"])


def test_small_yaml_aliases_still_work(tmp_path):
    path = tmp_path / "anchors.yaml"
    path.write_text("train:\n  betas: [&b 0.8, *b]\n")
    assert load_config(str(path)).train.betas == [0.8, 0.8]
    assert load_config("tiny", ["train.betas=[&x 0.7, *x]"]).train.betas == [0.7, 0.7]


@pytest.mark.parametrize("override, shown", [
    ("train.max_steps=" + "x" * 10**6, "train.max_steps must be an integer, got 'xxx"),
    ("train.max_steps=[" + ",".join(["123456789"] * 10**5) + "]", "train.max_steps must be an integer, got [1234"),
    ("diffusion=" + "y" * 10**6, "diffusion must be a section (a mapping), got 'yyy"),
    ("train.lr=1" + "0" * 400, "train.lr=<an integer of about 401 digits> is too large"),
    ("train." + "z" * 10**6 + "=1", "unknown config key train.zzz"),
], ids=["string", "list", "section", "int-as-float", "key"])
def test_error_on_a_huge_value_quotes_it_truncated(override, shown):
    with pytest.raises(UserError) as info:
        load_config("tiny", [override])
    message = str(info.value)
    assert message.startswith(shown) and "\n" not in message
    assert "..." in message or "digits" in message
    assert len(message) < 1000   # the quoted value is cut to 200 characters with an ellipsis


def test_huge_numbers_in_a_yaml_file_are_one_line(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("train:\n  max_steps: 1" + "0" * 5000 + "\n")
    with pytest.raises(UserError, match="holds a value YAML cannot read: Exceeds the limit"):
        load_config(str(path))
    path.write_text("train:\n  max_steps: 1" + "0" * 400 + "\n  lr: 1" + "0" * 400 + "\n")
    with pytest.raises(UserError, match=r"train.lr=<an integer of about 401 digits> is too large"):
        load_config(str(path))
