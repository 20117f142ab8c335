"""lora.targets in a family's other naming: Wan's layers named as Wan names them (``self_attn.q``,
``ffn.0``) or as diffusers does (``attn1.to_q``, ``ffn.net.0.proj``) pick the same layers, and
the adapters carry Wan's names either way; STDiT's names resolve as before."""

import pytest
import torch

from videodit.config import LoraConfig
from videodit.config.schema import LORA_TARGETS
from videodit.errors import UserError
from videodit.models.families import get_spec
from videodit.models.lora import add_adapters, is_adapter_name, target_paths
from videodit.models.stdit.model import DiTGeometry, STDiT
from videodit.models.wan.model import WanDiT, WanGeometry


def wan_model() -> WanDiT:
    with torch.device("meta"):
        return WanDiT(WanGeometry(dim=64, ffn_dim=128, num_heads=4, num_layers=2, text_dim=32, freq_dim=32))


@pytest.mark.parametrize("wan, diffusers", [
    (["self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "ffn.0", "ffn.2"],   # the default targets
     ["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "ffn.net.0.proj", "ffn.net.2"]),
    (["cross_attn.q", "cross_attn.k", "cross_attn.v", "cross_attn.o"],
     ["attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0"]),
    (["blocks.1.self_attn.k", "text_embedding.0", "time_embedding.2", "time_projection.1", "head.head"],   # full paths
     ["blocks.1.attn1.to_k", "condition_embedder.text_embedder.linear_1", "condition_embedder.time_embedder.linear_2",
      "condition_embedder.time_proj", "proj_out"]),
    (["self_attn.q", "ffn.2"], ["self_attn.q", "ffn.net.2"]),   # mixed
])
def test_wan_and_diffusers_names_pick_the_same_layers(wan, diffusers):
    model = wan_model()
    want = target_paths(model, wan)
    assert want and target_paths(model, diffusers) == want
    assert len(want) == sum(1 if t.startswith(("blocks.", "text_", "time_", "head.")) else len(model.blocks)
                            for t in wan)


def test_diffusers_targets_train_adapters_under_wan_names():
    torch.manual_seed(0)
    geometry = WanGeometry(dim=32, ffn_dim=64, num_heads=2, num_layers=1, text_dim=16, freq_dim=16)
    names = []
    for targets in (LORA_TARGETS["wan"],
                    ["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "ffn.net.0.proj", "ffn.net.2"]):
        model = add_adapters(WanDiT(geometry), LoraConfig(rank=2, targets=targets))
        names.append(sorted(n for n, p in model.named_parameters() if p.requires_grad))
    assert names[0] == names[1] and all(is_adapter_name(n) for n in names[0])
    assert "blocks.0.self_attn.o.lora_A.default.weight" in names[0]


@pytest.mark.parametrize("target", ["attn1.to_out", "attn3.to_q", "ffn.net.1", "self_attn.norm_q", "attn.q"])
def test_unknown_wan_target_is_one_line(target):
    with pytest.raises(UserError) as info:
        target_paths(wan_model(), [target])
    message = str(info.value)
    assert "\n" not in message and repr(target) in message and "self_attn.q" in message


def test_stdit_targets_unchanged():
    spec = get_spec("stdit")
    assert spec.lora_target("attn1.to_q") == "attn1.to_q"
    with torch.device("meta"):
        model = STDiT(DiTGeometry(in_channels=3, caption_channels=16, caption_length=8, depth=1, hidden_size=32,
                                  num_heads=2))
    paths = target_paths(model, LORA_TARGETS["stdit"])
    assert len(paths) == len(model.blocks) * len(LORA_TARGETS["stdit"])
    with pytest.raises(UserError, match=r"'attn1.to_q' is not a Linear layer"):
        target_paths(model, ["attn1.to_q"])
