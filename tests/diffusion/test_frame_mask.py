"""Open-Sora 1.2's frame masks (image/video conditioning) and the masked loss."""

import pytest
import torch

from videodit.config import DiffusionConfig
from videodit.diffusion.frame_mask import KINDS, FrameConditioning, check_mask_ratios, draw_mask, draw_masks
from videodit.diffusion.rectified_flow import RectifiedFlow
from videodit.errors import UserError

STAGE1 = {"random": 0.05, "intepolate": 0.005, "quarter_random": 0.005, "quarter_head": 0.005,
          "quarter_tail": 0.005, "quarter_head_tail": 0.005, "image_random": 0.025, "image_head": 0.05,
          "image_tail": 0.025, "image_head_tail": 0.025}   # Open-Sora 1.2 stage 1, as written


def given(kind: str, frames: int = 12, seed: int = 0) -> list[int]:
    mask = draw_mask(kind, frames, torch.Generator().manual_seed(seed))
    return [i for i, generated in enumerate(mask.tolist()) if not generated]


def test_each_kind_gives_the_frames_open_sora_gives():
    assert given("identity") == []
    assert given("image_head") == [0] and given("image_tail") == [11] and given("image_head_tail") == [0, 11]
    assert len(given("image_random")) == 1
    for seed in range(20):
        head = given("quarter_head", seed=seed)
        assert head == list(range(len(head))) and 1 <= len(head) <= 3
        tail = given("quarter_tail", seed=seed)
        assert tail == list(range(12 - len(tail), 12)) and 1 <= len(tail) <= 3
        both = given("quarter_head_tail", seed=seed)
        assert len(both) % 2 == 0 and both[0] == 0 and both[-1] == 11
        run = given("quarter_random", seed=seed)
        assert run == list(range(run[0], run[0] + len(run))) and 1 <= len(run) <= 3
        assert given("intepolate", seed=seed) in (list(range(0, 12, 2)), list(range(1, 12, 2)))
        assert len(given("random", seed=seed)) < 12   # at least one frame generated
    assert all(draw_mask(kind, 1, torch.Generator()).tolist() == [True] for kind in KINDS)


def test_ratios_pick_kinds_at_their_rates_and_the_same_seed_gives_the_same_masks():
    ratios = check_mask_ratios(STAGE1)
    assert ratios["identity"] == pytest.approx(0.8)
    masks = draw_masks(ratios, 4000, 15, torch.Generator().manual_seed(0))
    assert masks.shape == (4000, 15) and masks.all(1).float().mean().item() == pytest.approx(0.8, abs=0.03)
    again = draw_masks(ratios, 4000, 15, torch.Generator().manual_seed(0))
    assert torch.equal(masks, again)


@pytest.mark.parametrize("ratios, words", [
    ({"head": 0.1}, "unknown kind"), ({"random": 1.5}, "probabilities"), ({"random": 0.7, "image_head": 0.6}, "sum"),
    ([0.1], "mapping")])
def test_bad_ratios_are_refused_with_the_fix(ratios, words):
    with pytest.raises(UserError, match=words):
        check_mask_ratios(ratios)


def test_masked_loss_averages_each_sample_over_its_generated_frames():
    flow = RectifiedFlow(DiffusionConfig())
    out, x_t, target = (torch.randn(3, 4, 5, 2, 2) for _ in range(3))
    t = torch.rand(3)
    everything = torch.ones(3, 5, dtype=torch.bool)
    assert torch.allclose(flow.loss(out, x_t, t, target, everything), flow.loss(out, x_t, t, target))
    mask = everything.clone()
    mask[0, :2] = False
    mask[2, 4] = False
    expected = torch.stack([((out - target)[i][:, mask[i]] ** 2).mean() for i in range(3)]).mean()
    assert torch.allclose(flow.loss(out, x_t, t, target, mask), expected)


def test_conditioning_keeps_given_frames_clean_and_out_of_the_loss():
    flow = RectifiedFlow(DiffusionConfig())
    conditioning = FrameConditioning({"image_head": 1.0}, frames_per_patch=2)
    x0, x_t, out, target = (torch.randn(2, 4, 5, 2, 2) for _ in range(4))
    kept, x_mask = conditioning.apply(x_t, x0, torch.Generator().manual_seed(0))
    assert x_mask.tolist() == [[False, True, True]] * 2            # 5 latent frames -> 3 patched
    assert torch.equal(kept[:, :, :2], x0[:, :, :2]) and torch.equal(kept[:, :, 2:], x_t[:, :, 2:])
    loss = conditioning.loss(flow.loss)(out, kept, torch.rand(2), target, x_mask)
    assert torch.allclose(loss, ((out - target)[:, :, 2:] ** 2).mean())
