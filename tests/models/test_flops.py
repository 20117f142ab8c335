"""The FLOP model (``videodit/models/flops.py``) against ``torch.utils.flop_counter.FlopCounterMode``
on forward + backward of real models of every family (STDiT within 3%, Wan exactly).

What the counter sees, and why the runs are set up as they are:

* FlopCounterMode counts matmul-like ops only (mm, addmm, bmm, convolution, the SDPA
  kernels); elementwise ops (norms, modulation, RoPE, softmax, GELU) count 0. The model
  leaves them out as well, so the two should agree exactly, not just within the tolerance.
* On CPU, SDPA's default kernel (``_scaled_dot_product_flash_attention_for_cpu``) has no
  FLOP formula in FlopCounterMode and would count 0; the runs force the math path
  (``SDPBackend.MATH``: two bmm forward, four backward), which is what model FLOPs count.
* The fused GPU kernels (flash/efficient/cudnn) are counted with a backward of 2.5x forward:
  they recompute QK^T. That is hardware FLOPs, checked here with the efficient-attention
  kernel on the meta device (CPU has no kernel for it; meta tensors carry shapes only).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from videodit.config import MODEL_PRESETS, MemoryConfig
from videodit.models.flops import block_costs, forward_flops, step_costs, train_step_flops
from videodit.models.stdit.flops import patch_grid
from videodit.models.families import spec_of
from videodit.models.layers import AttentionBackend
from videodit.models.spec import Conditions
from videodit.models.stdit.model import DiTGeometry, STDiT
from videodit.models.wan.model import WanDiT, WanGeometry
from videodit.parallel.activation_checkpoint import apply_activation_checkpointing

TOLERANCE = 0.03
EMBED = ("patch_embed", "t_embedder", "fps_embedder", "t_block", "caption_embedder", "caption_pool")


@pytest.fixture(autouse=True)
def one_thread():
    """The counts do not depend on speed; these matmuls are tiny, and two threads on a busy
    2-core machine spin (10x slower under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def geometry(preset: str, depth: int | None = None, **changes) -> DiTGeometry:
    """A model preset's width, heads and patch (fewer blocks are fine: blocks are identical)."""
    p = MODEL_PRESETS[preset]
    values = dict(in_channels=4, caption_channels=64, caption_length=8, depth=depth or p["depth"],
                  hidden_size=p["hidden_size"], num_heads=p["num_heads"], mlp_ratio=p["mlp_ratio"],
                  patch_size=tuple(p["patch_size"]))
    return DiTGeometry(**{**values, **changes})


# name: (geometry, (batch, latent frames, height, width), caption length)
CASES = {
    "tiny video, pooled caption": (geometry("tiny", pooled_caption=True), (2, 4, 16, 16), 8),
    "tiny image, odd grid (padded)": (geometry("tiny"), (2, 1, 18, 22), 8),
    "tiny, temporal patch 2, odd frames": (geometry("tiny", patch_size=(2, 4, 4), pooled_caption=True),
                                           (1, 5, 12, 12), 8),
    "S width, video, odd grid": (geometry("S", depth=2, caption_length=12), (1, 3, 9, 7), 12),
    "S width, image, pooled caption": (geometry("S", depth=2, pooled_caption=True), (2, 1, 16, 12), 8),
    "XL width, video, pooled caption": (geometry("XL", depth=1, caption_channels=256, caption_length=12,
                                                 pooled_caption=True), (1, 2, 8, 8), 12),
}


def wan_geometry(depth: int | None = None, **changes) -> WanGeometry:
    """wan-tiny's width, heads, FFN and patch, with small encoders (text_dim, text_len)."""
    p = MODEL_PRESETS["wan-tiny"]
    values = dict(dim=p["hidden_size"], ffn_dim=p["ffn_dim"], num_heads=p["num_heads"], num_layers=depth or p["depth"],
                  in_channels=4, out_channels=4, freq_dim=32, text_dim=48, text_len=12,
                  patch_size=tuple(p["patch_size"]))
    return WanGeometry(**{**values, **changes})


# name: (geometry, (batch, latent frames, height, width), caption tokens given: Wan pads them to text_len)
WAN_CASES = {
    "wan-tiny video, short captions": (wan_geometry(), (2, 3, 8, 6), 7),
    "wan-tiny image, full captions": (wan_geometry(), (1, 1, 8, 10), 12),
    "wan, temporal patch 2, no qk norm": (wan_geometry(depth=1, dim=96, num_heads=6, ffn_dim=160, qk_norm=False,
                                                       patch_size=(2, 2, 2), out_channels=8), (2, 4, 6, 6), 5),
    "wan i2v with CLIP features": (wan_geometry(task="i2v", in_channels=12, image_dim=40), (2, 3, 8, 6), 7),
    "wan ti2v, its image frame given": (wan_geometry(task="ti2v"), (2, 3, 8, 6), 7),
}


def caption_length(g) -> int:
    return g.text_len if isinstance(g, WanGeometry) else g.caption_length


def inputs(g, batch: int, frames: int, height: int, width: int, device="cpu", caption_tokens: int | None = None):
    """Model inputs as the Trainer gives them: fps, and caption dropout (one dropped caption);
    the first caption is padded (half of its tokens masked out). Wan's through its spec's
    ``model_inputs`` (x_t, t, context; a dropped caption is a zero context, without gradient)."""
    if isinstance(g, WanGeometry):
        length = caption_tokens or g.text_len
        drop = torch.zeros(batch, dtype=torch.bool, device=device)
        drop[-1] = batch > 1
        x_mask = None
        if g.task == "ti2v":   # latent frame 0 given, as TI2V trains image-to-video
            x_mask = torch.ones(batch, frames // g.patch_size[0], dtype=torch.bool, device=device)
            x_mask[:, 0] = False
        image = torch.randn(batch, g.image_tokens, g.image_dim, device=device) if g.image_dim else None
        cond = Conditions(y=torch.randn(batch, length, g.text_dim, device=device),
                          y_mask=torch.ones(batch, length, dtype=torch.bool, device=device), drop=drop,
                          x_mask=x_mask, image=image)
        x_t = torch.randn(batch, g.in_channels, frames, height, width, device=device)
        return list(spec_of(g).model_inputs(x_t, torch.rand(batch, device=device), cond)), {}
    length = g.caption_length
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[0, length // 2:] = False
    drop = torch.zeros(batch, dtype=torch.bool)
    drop[-1] = batch > 1
    tensors = (torch.randn(batch, g.in_channels, frames, height, width), torch.rand(batch),
               torch.randn(batch, length, g.caption_channels), mask)
    return [t.to(device) for t in tensors], dict(fps=torch.full((batch,), 24.0, device=device),
                                                 drop_caption=drop.to(device))


def counted(model: STDiT | WanDiT, batch: int, frames: int, height: int, width: int, device="cpu",
            caption_tokens: int | None = None):
    """FlopCounterMode's forward counts per module and its forward + backward total."""
    args, kwargs = inputs(model.geometry, batch, frames, height, width, device, caption_tokens)
    with FlopCounterMode(display=False) as forward:
        out = model(*args, **kwargs)
    with FlopCounterMode(display=False) as backward:
        out.square().mean().backward()
    by_module = {name: sum(ops.values()) for name, ops in forward.get_flop_counts().items()}
    return by_module, forward.get_total_flops() + backward.get_total_flops()


def build(g, device="cpu") -> STDiT | WanDiT:
    torch.manual_seed(0)
    with torch.device(device):
        return (WanDiT if isinstance(g, WanGeometry) else STDiT)(g)


def relative_error(predicted: float, counted_flops: float) -> float:
    return abs(predicted - counted_flops) / counted_flops


@pytest.mark.parametrize("name", CASES)
def test_flop_model_matches_the_counter(name):
    g, (batch, frames, height, width), length = CASES[name]
    with sdpa_kernel(SDPBackend.MATH):
        parts, total = counted(build(g), batch, frames, height, width)
    count = forward_flops(g, frames, height, width, length)
    step = train_step_flops(g, batch, frames, height, width, length, fused_attention=False)

    assert relative_error(step.model, total) <= TOLERANCE, (step.model, total)
    # Part by part, in the order the pipeline cuts: embedding, each block, final layer.
    embed = sum(parts.get(f"STDiT.{module}", 0) for module in EMBED)
    blocks = [parts[f"STDiT.{'temporal' if i % 2 else 'spatial'}_blocks.{i // 2}"] for i in range(2 * g.depth)]
    assert relative_error(batch * count.embed, embed) <= TOLERANCE
    for predicted, measured in zip(count.blocks, blocks, strict=True):
        assert relative_error(batch * predicted, measured) <= TOLERANCE
    assert relative_error(batch * count.final, parts["STDiT.final_layer"]) <= TOLERANCE
    assert relative_error(batch * count.total, parts["Global"]) <= TOLERANCE


@pytest.mark.parametrize("name", WAN_CASES)
def test_wan_flop_model_matches_the_counter_exactly(name):
    """Every matmul of a WanDiT is in the model: forward part by part and forward + backward
    (x_t, the time features and the text context enter without gradient) agree exactly."""
    g, (batch, frames, height, width), given = WAN_CASES[name]
    with sdpa_kernel(SDPBackend.MATH):
        parts, total = counted(build(g), batch, frames, height, width, caption_tokens=given)
    # The caption length the model is told does not matter: Wan always attends text_len tokens.
    count = forward_flops(g, frames, height, width, given)
    assert count == forward_flops(g, frames, height, width, g.text_len)
    step = train_step_flops(g, batch, frames, height, width, given, fused_attention=False)

    assert step.model == total
    assert batch * count.total == parts["Global"]
    blocks = [parts[f"WanDiT.blocks.{i}"] for i in range(g.num_layers)]
    assert [batch * f for f in count.blocks] == blocks
    assert batch * count.final == parts["WanDiT.head"]
    # The time MLPs run functionally (fp32_linear), so the embedding is what the rest leaves.
    assert batch * count.embed == parts["Global"] - sum(blocks) - parts["WanDiT.head"]
    assert parts["WanDiT.patch_embedding"] + parts["WanDiT.text_embedding"] < batch * count.embed


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("case", ["tiny video, pooled caption", "wan-tiny video, short captions"])
def test_hardware_flops_add_the_recompute_of_checkpointed_blocks(mode, case):
    g, (batch, frames, height, width), length = {**CASES, **WAN_CASES}[case]
    memory = MemoryConfig(checkpointing=mode, checkpoint_every=2)     # blocks 0, 2, ...
    model = build(g)
    blocks = len(model.blocks)
    assert apply_activation_checkpointing(model, memory) == memory.checkpointed_blocks(blocks)
    with sdpa_kernel(SDPBackend.MATH):
        _, total = counted(model, batch, frames, height, width, caption_tokens=length)
    step = train_step_flops(g, batch, frames, height, width, length, memory, fused_attention=False)
    count = forward_flops(g, frames, height, width, length)

    assert relative_error(step.hardware, total) <= TOLERANCE, (step.hardware, total)
    if isinstance(g, WanGeometry):
        assert step.hardware == total
    if mode == "full":   # every checkpointed block's forward runs twice
        recompute = batch * sum(count.blocks[i] for i in memory.checkpointed_blocks(blocks))
        assert step.hardware == pytest.approx(step.model + recompute)
    else:                # matmul and attention outputs are kept: no matmul is recomputed
        assert step.hardware == step.model


class EfficientAttention(AttentionBackend):
    """SDPA's fused memory-efficient kernel, as GPUs run it (here on meta tensors)."""

    def __call__(self, q, k, v, *, kind, attn_mask=None):
        bias = None
        if attn_mask is not None:   # the kernel takes an additive bias, not a bool mask
            bias = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill(~attn_mask, -1e4)
            bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True)[0]


def test_fused_attention_backward_is_counted_as_hardware_flops():
    g = dataclasses.replace(CASES["S width, video, odd grid"][0], pooled_caption=True)
    batch, frames, height, width = 2, 6, 30, 34
    model = build(g, "meta")
    for module in model.modules():
        if hasattr(module, "backend"):
            module.backend = EfficientAttention()
    _, total = counted(model, batch, frames, height, width, device="meta")
    step = train_step_flops(g, batch, frames, height, width, g.caption_length)

    assert relative_error(step.hardware, total) <= TOLERANCE, (step.hardware, total)
    count = forward_flops(g, frames, height, width, g.caption_length)
    assert step.hardware == pytest.approx(step.model + batch * sum(count.attention) / 2)


def test_pipeline_costs_are_the_step_flops_of_the_same_model():
    g = geometry("S", pooled_caption=True)
    frames, height, width, length = 15, 30, 40, 300
    tp, hp, wp = patch_grid(g, frames, height, width)
    costs = block_costs(g, tp, hp * wp, length)
    assert len(costs) == 2 * g.depth
    assert sum(costs) == pytest.approx(train_step_flops(g, 1, frames, height, width, length).hardware)
    # Temporal attention over 15 frames is cheaper than spatial attention over 300 positions.
    assert costs[1] < costs[2]
    assert costs == step_costs(forward_flops(g, frames, height, width, length))
