"""videodit's MMDiT against Open-Sora 2.0's own ``MMDiTModel``, through the golden fixtures of
tests/fixtures/opensora2 (written by scripts/make_opensora2_fixtures.py with Open-Sora's code; these
tests never need it): forward and gradient parity, both RoPE layouts, strict loading, export, the
spec's answers (parameter count, FLOPs, stages, inputs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from tolerance import assert_close, relative
from videodit.config.schema import LORA_TARGETS, ModelConfig
from videodit.errors import UserError
from videodit.models.families import get_spec, released_spec, spec_of
from videodit.models.mmdit import activations
from videodit.models.mmdit.layouts import (interleaved_to_rotate_half, load_opensora2, read_opensora2,
                                           rotate_half_to_interleaved)
from videodit.models.mmdit.model import MMDiT, MMDiTGeometry
from videodit.models.spec import Conditions, count_parameters

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "opensora2"
RELEASED = FIXTURE / "mmdit" / "Open_Sora_v2.safetensors"
CASES = ["t2v", "i2v", "one_frame", "nonsquare", "padded_nomask", "padded_mask", "random_cond"]
# Bounds on the deviation relative to the expected output's max: ten times the worst measured across
# CPUs (AVX-512, AVX2, scalar kernels), thread counts and torch/transformers releases (docs/testing.md).
FORWARD = 1e-4      # worst 8.7e-6
GRADIENT = 1e-3     # worst 6.7e-5


@pytest.fixture(scope="module")
def cases() -> dict[str, dict[str, torch.Tensor]]:
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(FIXTURE / "mmdit_cases.safetensors")).items():
        case, name = key.split(".", 1)
        grouped.setdefault(case, {})[name] = tensor
    return grouped


@pytest.fixture(scope="module")
def model() -> MMDiT:
    return load_opensora2(RELEASED).eval()


def forward(model, case, cond="given"):
    return model(case["x"], case["t"], case["y"], case["pooled"], case["cond"] if cond == "given" else None,
                 case.get("y_mask"))


@pytest.mark.parametrize("name", CASES)
def test_forward_matches_opensora(model, cases, name):
    with torch.no_grad():
        ours = forward(model, cases[name])
    assert ours.shape == cases[name]["out"].shape and ours.dtype == torch.float32
    assert_close(ours, cases[name]["out"], FORWARD, name)


def test_no_cond_is_the_all_zero_condition(model, cases):
    """t2v's condition is all zero (no frame given): leaving it out gives the same output."""
    with torch.no_grad():
        assert_close(forward(model, cases["t2v"], cond=None), cases["t2v"]["out"], FORWARD, "no cond")


def test_gradients_match_opensora(cases):
    model = load_opensora2(RELEASED)
    case = cases["grad"]
    leaves = {k: case[k].clone().requires_grad_() for k in ("x", "y", "pooled", "cond")}
    loss = F.mse_loss(model(leaves["x"], case["t"], leaves["y"], leaves["pooled"], leaves["cond"]),
                      case["target"])
    loss.backward()
    assert abs(loss.item() - case["loss"].item()) <= 1e-5 * case["loss"].item()
    for k, leaf in leaves.items():
        assert_close(leaf.grad, case[f"d{k}"], GRADIENT, k)
    params = dict(model.named_parameters())
    checked = [k[len("param."):] for k in case if k.startswith("param.")]
    assert len(checked) >= 10
    for name in checked:
        assert_close(params[name].grad, case[f"param.{name}"], GRADIENT, name)


def test_geometry_read_off_the_released_file():
    geometry, tensors = read_opensora2(RELEASED)
    tiny = json.loads((FIXTURE / "mmdit_cases.json").read_text())["tiny"]
    assert geometry == MMDiTGeometry(hidden_size=tiny["hidden_size"], num_heads=tiny["num_heads"], depth=tiny["depth"],
                                     depth_single_blocks=tiny["depth_single_blocks"], latent_channels=4,
                                     mlp_ratio=tiny["mlp_ratio"], patch_size=(1, 2, 2),
                                     vec_in_dim=tiny["vec_in_dim"], context_in_dim=tiny["context_in_dim"],
                                     axes_dim=tuple(tiny["axes_dim"]), qkv_bias=True, cond_embed=True)
    assert set(tensors) == set(MMDiT(geometry).state_dict())


def test_interleaved_layout_imports(cases):
    """Flux's RoPE layout (use_liger_rope=False): permuted on import, same outputs as Open-Sora's.
    The model patches 1 x 1 x 1 as the high-compression one does: the patch is read off cond_in."""
    model = load_opensora2(FIXTURE / "mmdit_flux" / "Open_Sora_v2.safetensors", layout="interleaved").eval()
    assert model.geometry.patch_size == (1, 1, 1) and model.geometry.latent_channels == 8
    case = cases["flux"]
    with torch.no_grad():
        assert_close(forward(model, case), case["out"], FORWARD, "interleaved")
    unpermuted = load_opensora2(FIXTURE / "mmdit_flux" / "Open_Sora_v2.safetensors").eval()
    with torch.no_grad():
        assert relative(forward(unpermuted, case), case["out"]) > 1e-3   # the layouts are not interchangeable


def test_rope_permutation_round_trips():
    weight = torch.randn(2 * 32, 5)
    name = "double_blocks.0.img_attn.q_proj.weight"
    there = rotate_half_to_interleaved(name, weight, 32)
    assert not torch.equal(there, weight)
    assert torch.equal(interleaved_to_rotate_half(name, there, 32), weight)
    assert torch.equal(rotate_half_to_interleaved("double_blocks.0.img_attn.v_proj.weight", weight, 32), weight)


def _copy_without(tmp_path: Path, drop=(), add=None) -> Path:
    tensors = load_file(str(RELEASED))
    for k in drop:
        tensors.pop(k)
    tensors.update(add or {})
    out = tmp_path / "Open_Sora_v2.safetensors"
    save_file(tensors, str(out))
    return out


@pytest.mark.parametrize("change, words", [
    (dict(drop=["single_blocks.1.linear2.bias"]), "1 missing (single_blocks.1.linear2.bias)"),
    (dict(add={"guidance_in.in_layer.weight": torch.zeros(64, 256)}), "1 unexpected (guidance_in.in_layer.weight)"),
    (dict(add={"final_layer.linear.bias": torch.zeros(7)}), "final_layer.linear.bias has shape [7]"),
])
def test_strict_loading_names_the_keys(tmp_path, change, words):
    with pytest.raises(UserError, match=None) as info:
        load_opensora2(_copy_without(tmp_path, **change))
    message = str(info.value)
    assert words in message and "\n" not in message


def test_training_checkpoint_reads_its_model_folder(tmp_path, model, cases):
    """Open-Sora 2.0's CheckpointIO.save: epochN-global_stepM/model/ with ColossalAI's shards + index."""
    tensors = load_file(str(RELEASED))
    names = sorted(tensors)
    folder = tmp_path / "epoch0-global_step10" / "model"
    folder.mkdir(parents=True)
    shards = {"model-00001.safetensors": names[: len(names) // 2], "model-00002.safetensors": names[len(names) // 2:]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(folder / shard))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}))
    (folder.parent / "running_states.json").write_text('{"epoch": 0, "global_step": 10}')
    assert released_spec(folder.parent) is SPEC and released_spec(folder) is SPEC   # not Open-Sora 1.2's layout
    loaded = load_opensora2(folder.parent).eval()
    with torch.no_grad():
        assert torch.equal(forward(loaded, cases["i2v"]), forward(model, cases["i2v"]))
    with pytest.raises(UserError, match="no ema.safetensors nor ema.pt"):
        read_opensora2(folder.parent, ema=True)
    torch.save({k: v * 2 for k, v in tensors.items()}, folder.parent / "ema.pt")   # Open-Sora's synchronous save
    ema = load_opensora2(folder.parent, ema=True)
    assert torch.equal(ema.img_in.weight, 2 * tensors["img_in.weight"])


# ----------------------------------------------------------------------------- the spec

SPEC = get_spec("mmdit")
SMALL = MMDiTGeometry(hidden_size=64, num_heads=2, depth=2, depth_single_blocks=3, latent_channels=4, vec_in_dim=8,
                      context_in_dim=16, axes_dim=(4, 14, 14))


def preset_geometry(preset: str) -> MMDiTGeometry:
    m = ModelConfig(preset=preset).resolved()
    return SPEC.geometry(m, *SPEC.released_encoders_of(m))


@pytest.mark.parametrize("preset, count", [("opensora-v2", 11_891_390_528), ("opensora-v2-hc", None)])
def test_released_presets_have_the_released_parameter_count(preset, count):
    with torch.device("meta"):
        model = SPEC.build(preset_geometry(preset))
    total = count_parameters(model)
    assert total == count if count else f"{total / 1e9:.2f}B" == "11.89B"
    assert len(model.blocks) == 57 == SPEC.blocks_of(ModelConfig(preset=preset).resolved())
    assert [SPEC.block_kind(b) for b in model.blocks] == ["double"] * 19 + ["single"] * 38


def small_inputs(batch=2, frames=3, height=8, width=6, tokens=7, mask=False, given=True, pooled=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    y_mask = None
    if mask:
        y_mask = torch.ones(batch, tokens, dtype=torch.bool)
        y_mask[0, tokens // 2:] = False
    cond = Conditions(y=torch.randn(batch, tokens, SMALL.context_in_dim, generator=g), y_mask=y_mask,
                      drop=torch.tensor([False, True][:batch]),
                      pooled=torch.randn(batch, SMALL.vec_in_dim, generator=g) if pooled else None,
                      given=torch.randn(batch, 5, frames, height, width, generator=g) if given else None)
    x_t = torch.randn(batch, 4, frames, height, width, generator=g)
    return SPEC.model_inputs(x_t, torch.rand(batch, generator=g), cond)


@pytest.mark.parametrize("mask", [False, True])
def test_flop_model_matches_the_counter_exactly(mask):
    torch.manual_seed(0)
    model = MMDiT(SMALL)
    inputs = small_inputs(mask=mask)
    with sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as forward_mode:
            out = model(*inputs)
        with FlopCounterMode(display=False) as backward_mode:
            out.square().mean().backward()
    count = SPEC.forward_flops(SMALL, 3, 4 * 3, 7)
    parts = {name: sum(ops.values()) for name, ops in forward_mode.get_flop_counts().items()}
    blocks = [parts[f"MMDiT.{kind}_blocks.{i}"] for kind, n in (("double", 2), ("single", 3)) for i in range(n)]
    assert [2 * f for f in count.blocks] == blocks
    assert 2 * count.final == parts["MMDiT.final_layer"]
    assert 2 * count.total == parts["Global"]
    assert 2 * count.backward == backward_mode.get_total_flops()   # x_t, y, pooled, cond, t enter without gradient


def test_model_inputs_are_all_tensors():
    x_t, t, y, pooled, cond, y_mask = small_inputs(mask=True)
    assert torch.equal(y[1], torch.zeros_like(y[1])) and torch.equal(pooled[1], torch.zeros_like(pooled[1]))
    assert y[0].abs().sum() > 0 and y_mask.dtype == torch.bool
    inputs = small_inputs(given=False, pooled=False)
    assert len(inputs) == 5 and inputs[3].shape == (2, 0)            # no pooled vector: the zero vector
    assert torch.equal(inputs[4], torch.zeros(2, 5, 3, 8, 6))        # nothing given: the all-zero condition
    torch.manual_seed(0)
    model = MMDiT(SMALL).eval()
    with torch.no_grad():
        absent = model(*inputs[:3])
        assert torch.equal(model(*inputs), absent)


def test_config_json_round_trips_and_weights_say_their_sizes():
    config = json.loads(json.dumps(SPEC.geometry_config(SMALL)))
    assert config["model_type"] == "videodit-mmdit" and SPEC.geometry_from_config(config) == SMALL
    state = MMDiT(SMALL).state_dict()
    assert SPEC.latent_channels(state) == 4 and SPEC.caption_channels(state) == 16
    assert spec_of(SMALL) is SPEC and spec_of(MMDiT(SMALL)) is SPEC
    with pytest.raises(UserError, match="not a videodit MMDiT config"):
        SPEC.geometry_from_config({**config, "hidden_size": None, "num_heads": None})


@pytest.mark.parametrize("field, value, words", [
    ("axes_dim", (4, 14, 12), "axes_dim=[4, 14, 12] must be 3 even sizes"),
    ("patch_size", (2, 2, 2), "patches 1 x p x p"),
    ("num_heads", 3, "not divisible by num_heads=3"),
])
def test_bad_geometry_is_one_line(field, value, words):
    with pytest.raises(UserError, match=None) as info:
        MMDiTGeometry(**{**SMALL.__dict__, field: value})
    assert words in str(info.value) and "\n" not in str(info.value)


def test_export_is_the_released_file():
    """What ``ckpt export --format opensora-v2`` writes: Open-Sora's names and layout, the very
    tensors of the file Open-Sora's MMDiTModel wrote (so it loads strictly there and matches)."""
    model = load_opensora2(RELEASED)
    tensors, files, name = SPEC.export_released("opensora-v2", model.geometry, model.state_dict())
    released = load_file(str(RELEASED))
    assert name == "Open_Sora_v2.safetensors" and tensors.keys() == released.keys()
    assert all(torch.equal(tensors[k], released[k]) for k in released)
    config = json.loads(files["opensora_model_config.json"])
    assert config["use_liger_rope"] and not config["fused_qkv"] and config["in_channels"] == 16
    tiny = json.loads((FIXTURE / "mmdit_cases.json").read_text())["tiny"]
    assert {k: config[k] for k in tiny if k in config} == {k: v for k, v in tiny.items() if k in config}


@pytest.mark.parametrize("cuts, mask", [([1], False), ([2], True), ([3], False), ([1, 4], True)])
def test_pipeline_stages_chain_to_the_model(cuts, mask):
    """Stage boundaries inside the double stack, between the stacks, inside the single stack."""
    torch.manual_seed(0)
    model = MMDiT(SMALL).eval()
    inputs = small_inputs(mask=mask)
    bounds = [0, *cuts, len(model.blocks)]
    stages = [SPEC.pipeline_stage(model, range(a, b), first=i == 0, last=b == len(model.blocks))
              for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    with torch.no_grad():
        out = inputs
        for stage in stages:
            io = SPEC.stage_io(stage, inputs, microbatches=1)
            out = stage(*out)
            want = io["output_args"] if isinstance(io["output_args"], tuple) else (io["output_args"],)
            got = out if isinstance(out, tuple) else (out,)
            assert [tuple(w.shape) for w in want] == [tuple(o.shape) for o in got]
            if not isinstance(out, tuple):
                out = SPEC.stage_latents(out, inputs[0].shape, SMALL)
        assert torch.equal(out, model(*inputs))
    names = [n for stage in stages for n in stage.state_dict()]
    assert sorted(names) == sorted(model.state_dict())   # stages add up to the model, names kept


def test_dynamic_dims_name_the_block_inputs():
    torch.manual_seed(0)
    model = MMDiT(SMALL)
    img, txt, vec, rope = model.embed(*small_inputs()[:5])
    mask = torch.ones(2, 7, dtype=torch.bool)
    dims = SPEC.dynamic_dims((img, txt, vec, rope, mask))
    assert [d for _, d in dims] == [[0, 1], [0, 1], [0], [0], [0, 1]]


def test_default_lora_targets_cover_both_kinds_of_blocks():
    from videodit.models.lora import target_paths
    model = MMDiT(SMALL)
    paths = target_paths(model, LORA_TARGETS["mmdit"])
    assert len(paths) == 2 * 12 + 3 * 4
    assert "double_blocks.1.txt_mlp.2" in paths and "single_blocks.2.v_mlp" in paths
    assert target_paths(model, ["attn.to_q", "proj_out"]) == [
        *(f"double_blocks.{i}.img_attn.q_proj" for i in range(2)), *(f"single_blocks.{i}.linear2" for i in range(3))]
    with pytest.raises(UserError, match="not a Linear layer"):
        target_paths(model, ["img_attn.norm"])


@pytest.mark.parametrize("bf16", [False, True])
def test_activation_profile_is_what_the_blocks_keep(bf16):
    """Bytes per text token kept by one block of each kind (saved_tensors_hooks, distinct storages)."""
    torch.manual_seed(0)
    model = MMDiT(SMALL)
    d = SMALL.hidden_size

    def kept(block, text_tokens):
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        img, txt = torch.randn(1, 16, d, requires_grad=True), torch.randn(1, text_tokens, d, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            block(img, txt, torch.randn(1, d, requires_grad=True), torch.randn(16, SMALL.head_dim // 2, 2))
        return sum(seen.values())
    for kind, block in (("double", model.double_blocks[0]), ("single", model.single_blocks[0])):
        per_token = (kept(block, 24) - kept(block, 8)) / 16 / (4 * d)
        assert per_token == activations.block_units(kind, bf16, SMALL.mlp_ratio, SMALL.num_heads, d), kind
    profile = SPEC.activation_profile(preset_geometry("opensora-v2"))
    assert sum(s.units for s in profile.block if s.per == "M" and s.on == "tokens") == pytest.approx(2.0)


# ----------------------------------------------------------------------------- import, export, training

def test_released_file_imports_loads_and_exports_through_the_cli(tmp_path, model, cases):
    from videodit.cli import main
    from videodit.models import load_pretrained
    assert released_spec(RELEASED) is SPEC and released_spec(FIXTURE / "mmdit") is None
    imported = tmp_path / "imported"
    assert main(["ckpt", "import", str(RELEASED), str(imported), "--config", "tiny", "model.preset=mmdit-tiny"]) == 0
    for source in (RELEASED, imported):
        loaded = load_pretrained(source).eval()
        with torch.no_grad():
            assert torch.equal(forward(loaded, cases["i2v"]), forward(model, cases["i2v"]))
    assert main(["ckpt", "export", str(imported), str(tmp_path / "os2"), "--format", "opensora-v2"]) == 0
    exported = load_file(str(tmp_path / "os2" / "Open_Sora_v2.safetensors"))
    released = load_file(str(RELEASED))
    assert exported.keys() == released.keys() and all(torch.equal(exported[k], released[k]) for k in released)


def test_tiny_mmdit_trains_exports_and_restarts_from_its_export(toy_dir, tmp_path):
    """mmdit-tiny with the toy encoders (pixels as latents, toy captions, no pooled vector) trains;
    its checkpoint exports as Open_Sora_v2.safetensors, which Open-Sora's layout reads strictly,
    ``ckpt import`` and ``model.init_from`` take."""
    from conftest import tiny_overrides
    from videodit.cli import main
    from videodit.config import load_config
    from videodit.models import load_pretrained
    from videodit.train.trainer import Trainer
    common = tiny_overrides(toy_dir, **{"model.preset": "mmdit-tiny", "model.hidden_size": 64, "model.patch_size":
                                        "[1,2,2]", "text.dim": 32, "train.max_steps": 2, "checkpoint.every_steps": 2,
                                        "sample.steps": 1})
    run = tmp_path / "run"
    Trainer(load_config("tiny", common), run).fit()
    ckpt = run / "checkpoints" / "step-0000002"
    assert main(["ckpt", "export", str(ckpt), str(tmp_path / "os2"), "--format", "opensora-v2"]) == 0
    released = tmp_path / "os2" / "Open_Sora_v2.safetensors"
    trained, theirs = load_file(str(ckpt / "model.safetensors")), load_opensora2(released).state_dict()
    assert trained.keys() == theirs.keys() and all(torch.equal(v, theirs[k]) for k, v in trained.items())
    assert main(["ckpt", "import", str(released), str(tmp_path / "imported"), "--config", "tiny",
                 "model.preset=mmdit-tiny"]) == 0
    assert load_pretrained(tmp_path / "imported").geometry == load_opensora2(released).geometry
    again = tmp_path / "again"
    Trainer(load_config("tiny", common + ["train.max_steps=1", f"model.init_from={released}"]), again).fit()
    assert (again / "checkpoints" / "step-0000001").is_dir()
    with pytest.raises(UserError, match="hidden_size=64 there, 32 here.*set model.hidden_size=64"):
        Trainer(load_config("tiny", common + ["model.hidden_size=32", "model.axes_dim=[4,6,6]",
                                              f"model.init_from={released}"]), tmp_path / "bad")


def test_export_refuses_a_rope_split_the_file_cannot_record():
    geometry = MMDiTGeometry(**{**SMALL.__dict__, "axes_dim": (8, 12, 12)})
    with pytest.raises(UserError, match="axes_dim=\\[8, 12, 12\\] is not the released RoPE split"):
        SPEC.export_released("opensora-v2", geometry, MMDiT(geometry).state_dict())


def test_bf16_timesteps_round_as_opensora_trains():
    """Open-Sora 2.0 trains in bf16: t arrives in bf16 and t*1000 is a bf16 product."""
    from videodit.models.layers import sinusoidal_embedding
    from videodit.models.mmdit.model import time_embedding_input
    t = torch.tensor([0.8709, 0.25])
    rounded = time_embedding_input(t, bf16=True)
    assert rounded.dtype == torch.bfloat16
    assert torch.equal(rounded, sinusoidal_embedding(torch.tensor([872.0, 250.0]), 256).to(torch.bfloat16))
    assert torch.equal(time_embedding_input(t), sinusoidal_embedding(t * 1000, 256))
    assert preset_geometry("opensora-v2").bf16_timesteps and not preset_geometry("mmdit-tiny").bf16_timesteps


def test_unconditional_branch_is_the_dropped_or_the_negative_caption():
    cond = Conditions(y=torch.randn(2, 7, 16), y_mask=None, pooled=torch.randn(2, 8),
                      drop=torch.tensor([False, False]))
    dropped = SPEC.unconditional(cond, None)
    _, _, y, pooled, _ = SPEC.model_inputs(torch.zeros(2, 4, 1, 2, 2), torch.rand(2), dropped)
    assert not y.any() and not pooled.any()
    negative = (torch.randn(1, 3, 16), torch.ones(1, 3, dtype=torch.bool), torch.randn(1, 8))
    inputs = SPEC.model_inputs(torch.zeros(2, 4, 1, 2, 2), torch.rand(2), SPEC.unconditional(cond, negative))
    assert torch.equal(inputs[2], negative[0].expand(2, -1, -1)) and torch.equal(inputs[3], negative[2].expand(2, -1))
    assert inputs[5].shape == (2, 3)
