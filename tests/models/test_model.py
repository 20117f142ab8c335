import pytest
import torch

from videodit.models.spec import count_parameters
from videodit.models.stdit.model import DiTGeometry, STDiT
from videodit.models.layers import AttentionBackend


def tiny_model(**kw):
    g = dict(in_channels=4, caption_channels=16, caption_length=6, depth=2, hidden_size=32, num_heads=4,
             patch_size=(1, 2, 2))
    g.update(kw)
    torch.manual_seed(0)
    return STDiT(DiTGeometry(**g))


def inputs(b, c, t, h, w, length=6, dim=16):
    y = torch.randn(b, length, dim)
    mask = torch.ones(b, length, dtype=torch.bool)
    mask[0, 3:] = False
    return torch.randn(b, c, t, h, w), torch.rand(b), y, mask


@pytest.mark.parametrize("t, h, w", [(1, 16, 16), (1, 12, 20), (4, 16, 16), (5, 8, 24), (3, 18, 10),
                                     (8, 6, 6)])
def test_output_shape_matches_input_for_images_and_videos(t, h, w):
    model = tiny_model()
    x, tt, y, mask = inputs(2, 4, t, h, w)
    out = model(x, tt, y, mask, fps=torch.tensor([8.0, 24.0]))
    assert out.shape == x.shape
    assert torch.isfinite(out).all()


def test_temporal_patch_pads_and_crops_back():
    model = tiny_model(patch_size=(2, 2, 2))
    x, tt, y, mask = inputs(2, 4, 5, 10, 14)
    assert model(x, tt, y, mask).shape == x.shape


@pytest.mark.parametrize("pooled", [False, True])
def test_gradients_reach_every_parameter(pooled):
    model = tiny_model(pooled_caption=pooled)
    # The zero-initialised output layers block gradients to everything else at step 0.
    torch.nn.init.normal_(model.final_layer.proj.weight, std=0.02)
    for block in model.blocks:
        torch.nn.init.normal_(block.cross_attn.proj.weight, std=0.02)
    x, tt, y, mask = inputs(2, 4, 3, 8, 8)
    model(x, tt, y, mask, fps=torch.tensor([8.0, 8.0]), drop_caption=torch.tensor([True, False])).square().mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


def test_caption_and_time_change_the_output():
    model = tiny_model()
    torch.nn.init.normal_(model.final_layer.proj.weight, std=0.02)
    for block in model.blocks:
        torch.nn.init.normal_(block.cross_attn.proj.weight, std=0.02)
    x, tt, y, mask = inputs(2, 4, 2, 8, 8)
    base = model(x, tt, y, mask)
    assert not torch.allclose(base, model(x, tt, torch.randn_like(y), mask))
    assert not torch.allclose(base, model(x, tt + 0.3, y, mask))
    dropped = model(x, tt, y, mask, drop_caption=torch.tensor([True, True]))
    assert torch.allclose(dropped, model(x, tt, torch.randn_like(y), mask, drop_caption=torch.tensor([True, True])))


def test_temporal_attention_mixes_frames_and_spatial_does_not_leak_across_batch():
    model = tiny_model()
    torch.nn.init.normal_(model.final_layer.proj.weight, std=0.02)
    x, tt, y, mask = inputs(2, 4, 4, 8, 8)
    base = model(x, tt, y, mask)
    x2 = x.clone()
    x2[:, :, 0] += 1.0                      # change frame 0 of both samples
    changed = model(x2, tt, y, mask)
    assert not torch.allclose(base[:, :, 3], changed[:, :, 3])   # frame 3 sees frame 0
    x3 = x.clone()
    x3[1] += 1.0                            # change sample 1 only
    assert torch.allclose(model(x3, tt, y, mask)[0], base[0], atol=1e-6)


def test_attention_backend_is_the_seam():
    calls = []

    class Recording(AttentionBackend):
        def __call__(self, q, k, v, *, kind, attn_mask=None):
            calls.append(kind)
            return super().__call__(q, k, v, kind=kind, attn_mask=attn_mask)

    model = tiny_model(depth=1)
    backend = Recording()
    for module in model.modules():
        if hasattr(module, "backend"):
            module.backend = backend
    model(*inputs(1, 4, 2, 8, 8))
    assert sorted(calls) == ["cross", "cross", "spatial", "temporal"]


def test_xl_preset_has_open_soras_1_21b_parameters():
    # Open-Sora's code builds STDiT3-XL/2 with 1,207,643,972 parameters (not the "1.1B" of its report):
    # its state dict as videodit exports it, less the null caption (a buffer there), counts the same.
    # videodit's own count differs by the null caption (a parameter here, 300 x 4096), the unused
    # pred_sigma outputs and the RoPE frequencies (a parameter there).
    from videodit.models.stdit.opensora_stdit import to_opensora

    g = DiTGeometry(in_channels=4, caption_channels=4096, caption_length=300, depth=28, hidden_size=1152,
                    num_heads=16, patch_size=(1, 2, 2), position_embedding="opensora", null_caption_mask="prompt")
    with torch.device("meta"):
        model = STDiT(g)
        opensora = to_opensora(model.state_dict(), g)
    assert sum(t.numel() for name, t in opensora.items() if name != "y_embedder.y_embedding") == 1_207_643_972
    assert count_parameters(model) == 1_207_643_972 + 300 * 4096 - (1152 * 16 + 16) - 36 == 1_208_854_288


def test_model_info_counts_each_preset(capsys):
    from videodit.cli import main

    assert main(["model", "info"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    notes = [line for line in lines if line.split()[0].endswith(":")]   # what a family's counts cover
    rows = {line.split()[0]: int(line.split()[-1].replace(",", "")) for line in lines if line not in notes}
    assert rows["ltx2.3-22b"] == 18_988_838_144 and notes == [next(n for n in notes if n.startswith("ltx2: counts"))]
    assert "not the text connectors" in notes[0]
    assert rows["tiny"] < rows["S"] < rows["B"] < rows["XL"]
    assert rows["XL"] == rows["opensora-v1.2"] == 1_208_854_288
    # Wan's releases, counted by their own code (the model study's meta-device counts)
    assert rows["wan2.1-t2v-14b"] == rows["wan2.2-t2v-a14b"] == 14_288_491_584   # one A14B expert
    assert rows["wan2.1-i2v-14b"] == 16_394_878_784      # 36 channels in, CLIP's img_emb, k_img/v_img
    assert rows["wan2.2-i2v-a14b"] == 14_288_901_184     # 36 channels in, no CLIP
    assert rows["wan2.2-ti2v-5b"] == 4_999_787_712       # on the 48-channel VAE


def test_absolute_frame_embedding_breaks_the_symmetry_between_identical_frames():
    # With temporal RoPE alone, identical frames give identical outputs: attention over
    # identical values cannot tell frames apart. The absolute frame embedding can.
    x, tt, y, mask = inputs(1, 4, 1, 8, 8)
    video = x.repeat(1, 1, 4, 1, 1)
    for absolute in (False, True):
        model = tiny_model(temporal_pos_embed=absolute)
        torch.nn.init.normal_(model.final_layer.proj.weight, std=0.02)
        out = model(video, tt, y, mask)
        assert torch.allclose(out[:, :, 0], out[:, :, 3], atol=1e-5) != absolute


def test_pooled_caption_drives_adaln_and_the_switch_keeps_the_old_model():
    # With every cross-attention output at zero (its init), the caption can only reach the
    # output through the pooled caption added to the timestep embedding.
    x, tt, y, mask = inputs(2, 4, 2, 8, 8)
    other = y.clone()
    other[:, 1] = torch.randn_like(other[:, 1])    # change one valid token of each caption
    padded = y.clone()
    padded[0, 3:] = torch.randn_like(padded[0, 3:])  # change only sample 0's padding
    for pooled in (False, True):
        model = tiny_model(pooled_caption=pooled)
        torch.nn.init.normal_(model.final_layer.proj.weight, std=0.02)
        assert (model.caption_pool is not None) == pooled
        assert any("caption_pool" in n for n, _ in model.named_parameters()) == pooled
        base = model(x, tt, y, mask)
        assert torch.allclose(base, model(x, tt, other, mask)) != pooled
        assert torch.allclose(base, model(x, tt, padded, mask), atol=1e-6)     # padding is not pooled
        # A dropped caption pools the null caption, whatever the caption was.
        drop = torch.tensor([True, True])
        dropped = model(x, tt, y, mask, drop_caption=drop)
        assert torch.allclose(dropped, model(x, tt, other, mask, drop_caption=drop), atol=1e-6)
        assert torch.allclose(dropped, base) != pooled


def test_pooled_caption_state_dict_is_the_old_one_plus_the_pool():
    old, new = tiny_model(), tiny_model(pooled_caption=True)
    extra = set(new.state_dict()) - set(old.state_dict())
    assert set(old.state_dict()) <= set(new.state_dict())
    assert extra and all(k.startswith("caption_pool.") for k in extra)


def live_model(**kw):
    """A tiny model whose zero-initialised output projection is not zero (so outputs tell inputs apart)."""
    model = tiny_model(**kw)
    torch.nn.init.normal_(model.final_layer.proj.weight, std=0.02)
    return model


def test_x_mask_all_generated_is_no_x_mask_and_given_frames_differ():
    model = live_model()
    x, tt, y, mask = inputs(2, 4, 3, 8, 8)
    base = model(x, tt, y, mask)
    assert torch.equal(model(x, tt, y, mask, x_mask=torch.ones(2, 3, dtype=torch.bool)), base)
    partly = model(x, tt, y, mask, x_mask=torch.tensor([[False, True, True], [True, True, True]]))
    assert not torch.allclose(partly[0], base[0]) and torch.equal(partly[1], base[1])
    with pytest.raises(ValueError, match="one flag per patched frame"):
        model(x, tt, y, mask, x_mask=torch.ones(2, 4, dtype=torch.bool))


def test_bf16_timesteps_round_t_times_1000():
    x, _, y, mask = inputs(2, 4, 2, 8, 8)
    rounding, exact = live_model(bf16_timesteps=True), live_model()
    assert torch.equal(rounding(x, torch.full((2,), 0.870), y, mask), rounding(x, torch.full((2,), 0.872), y, mask))
    assert not torch.equal(exact(x, torch.full((2,), 0.870), y, mask), exact(x, torch.full((2,), 0.872), y, mask))


def test_opensora_positions_need_the_pixel_size():
    from videodit.errors import UserError

    model = live_model(position_embedding="opensora")
    x, tt, y, mask = inputs(2, 4, 2, 7, 9)
    with pytest.raises(UserError, match="pass height= and width="):
        model(x, tt, y, mask)
    same = model(x, tt, y, mask, height=56, width=72)
    assert torch.equal(model(x, tt, y, mask, height=torch.tensor([56, 56]), width=torch.tensor([72, 72])), same)
    mixed = model(x, tt, y, mask, height=torch.tensor([56, 52]), width=torch.tensor([72, 70]))
    assert torch.equal(mixed[0], same[0]) and not torch.equal(mixed[1], same[1])
