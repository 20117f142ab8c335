"""LTX-2's objective and sampler as videodit runs them (``diffusion/ltx2_objective.py``): ``sample.py``'s
``denoise`` of an LTX-2 model is ``ltx2_sampler.sample`` over the model's own calls (CFG with the zero
text of a dropped caption, STG with one block's video self-attention skipped, the first frame given);
STG's skipped attention is ltx-core's (the values, gated, projected); the STG block and the clip rule."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from videodit.config import load_config
from videodit.diffusion import ltx2_sampler
from videodit.diffusion.ltx2_objective import check_clips, stg_block
from videodit.diffusion.rectified_flow import RectifiedFlow
from videodit.errors import UserError
from videodit.models.families import get_spec
from videodit.models.ltx2.geometry import LTX2_0, LTX2_3
from videodit.models.ltx2.spec import TINY
from videodit.sample import GivenFrames, denoise

SPEC = get_spec("ltx2")


def tiny_model(**changes):
    torch.manual_seed(0)
    return SPEC.build(dataclasses.replace(TINY, in_channels=4, **changes)).eval()


def test_denoise_is_ltxs_sampler_over_the_models_calls():
    model = tiny_model()
    cfg = load_config("tiny", ["model.preset=ltx2-tiny", "diffusion.prediction=velocity",
                               "diffusion.loss_space=velocity"])
    flow = RectifiedFlow(cfg.diffusion)
    noise, y = torch.randn(2, 4, 3, 2, 4), torch.randn(2, 6, 32)
    fps = torch.full((2,), 8.0)
    first = torch.randn(1, 4, 1, 2, 4)
    latents = torch.zeros(1, 4, 3, 2, 4)
    latents[:, :, :1] = first
    x_mask = torch.tensor([[False, True, True]])
    given = GivenFrames(latents, x_mask, ~x_mask[:, None, :, None, None])
    with torch.no_grad():
        got = denoise(model, flow, noise, y, None, steps=3, guidance=3.0, fps=fps, given=given)

        def call(text, skip=False):
            def v(x, sigma_tokens, sigma):
                model.blocks[1].skip_self_attention = skip   # TINY's 2 blocks: STG's block 28 of 48 -> 1
                try:
                    return model(x, sigma, text, fps, x_mask.expand(2, -1))
                finally:
                    model.blocks[1].skip_self_attention = False
            return v
        want = ltx2_sampler.sample(call(y), noise, ltx2_sampler.sigmas(3), ltx2_sampler.Guidance(3.0, 1.0, 0.7),
                                   uncond=call(torch.zeros_like(y)), perturbed=call(y, skip=True),
                                   first_frame=ltx2_sampler.FirstFrame(first))
    assert torch.equal(got, want)
    assert torch.equal(got[:, :, :1], first.expand(2, -1, -1, -1, -1))   # the given frame, as given
    with torch.no_grad():   # STG changes the result; stg_scale 0 leaves its branch out
        flow.cfg.stg_scale = 0.0
        plain = denoise(model, flow, noise, y, None, steps=3, guidance=3.0, fps=fps, given=given)
        want = ltx2_sampler.sample(call(y), noise, ltx2_sampler.sigmas(3), ltx2_sampler.Guidance(3.0, 0.0, 0.7),
                                   uncond=call(torch.zeros_like(y)), first_frame=ltx2_sampler.FirstFrame(first))
    assert torch.equal(plain, want) and not torch.allclose(plain, got)


@pytest.mark.parametrize("version", ["2.0", "2.3"])
def test_a_skipped_self_attention_passes_the_values(version):
    """ltx-core's all_perturbed: out = to_out(gate * v). Over one token attention already gives v
    (softmax of one key is 1), so skipping changes nothing there, and something over many."""
    changes = {} if version == "2.3" else {"caption_channels": 16, "gated_attention": False,
                                           "cross_attention_adaln": False}
    model = tiny_model(**changes)
    text = torch.randn(1, 5, changes.get("caption_channels", 32))
    with torch.no_grad():
        for shape, same in (((1, 4, 1, 1, 1), True), ((1, 4, 2, 2, 3), False)):
            x = torch.randn(shape)
            plain = model(x, torch.tensor([0.6]), text)
            with SPEC.skip_self_attention(model, 0):
                skipped = model(x, torch.tensor([0.6]), text)
            assert torch.allclose(plain, skipped, rtol=1e-5, atol=1e-6) == same
    assert not any(block.skip_self_attention for block in model.blocks)


def test_stg_block_is_the_releases_or_at_its_depth():
    assert stg_block(LTX2_0, None) == 29 and stg_block(LTX2_3, None) == 28
    assert stg_block(TINY, None) == 1 and stg_block(dataclasses.replace(LTX2_3, num_layers=24), None) == 14
    assert stg_block(TINY, 0) == 0
    with pytest.raises(UserError, match="0 to 1"):
        stg_block(TINY, 2)


def test_clip_sizes_follow_the_vaes_grid():
    ltx = SimpleNamespace(temporal_compression=8, spatial_compression=32)
    bucket = SimpleNamespace
    check_clips(ltx, [bucket(num_frames=49, height=544, width=960), bucket(num_frames=1, height=960, width=544)])
    check_clips(SimpleNamespace(temporal_compression=1, spatial_compression=1), [bucket(num_frames=8, height=9, width=7)])
    with pytest.raises(UserError) as err:
        check_clips(ltx, [bucket(num_frames=48, height=540, width=960)])
    assert "41 or 49 frames, 540 -> 544" in str(err.value) and "\n" not in str(err.value)
