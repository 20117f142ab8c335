"""Tiny random models of every family with a forward to call, for tests that look inside blocks
(tests/models/test_residual_dtypes.py, tests/parallel/test_graph_breaks.py): ``build(name, depth)``
gives (model, run), ``run()`` calling the model on random inputs of its own shapes."""

import torch


def _stdit(depth: int):
    from videodit.models.stdit.model import DiTGeometry, STDiT
    model = STDiT(DiTGeometry(in_channels=3, caption_channels=8, caption_length=4, depth=depth, hidden_size=32,
                              num_heads=4))
    y_mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    return model, lambda: model(torch.randn(2, 3, 4, 8, 8), torch.rand(2), torch.randn(2, 4, 8), y_mask)


def _wan(depth: int):
    from videodit.models.wan.model import WanDiT, WanGeometry
    model = WanDiT(WanGeometry(dim=32, ffn_dim=64, num_heads=2, num_layers=depth, in_channels=4, out_channels=4,
                               freq_dim=32, text_dim=16, text_len=6))
    return model, lambda: model(torch.randn(2, 4, 3, 8, 8), torch.rand(2), torch.randn(2, 6, 16))


def _mmdit(depth: int, given: bool = True, masked: bool = False):
    """``given``: frames given (``cond``; None: cond_in's bias alone); ``masked``: a caption key mask."""
    from videodit.models.mmdit.model import MMDiT, MMDiTGeometry
    model = MMDiT(MMDiTGeometry(hidden_size=64, num_heads=2, depth=depth, depth_single_blocks=depth,
                                latent_channels=4, vec_in_dim=16, context_in_dim=32, axes_dim=(8, 12, 12)))
    cond = torch.randn(2, 5, 3, 8, 6) if given else None
    y_mask = torch.tensor([[True, True, True, False, False], [True] * 5]) if masked else None
    return model, lambda: model(torch.randn(2, 4, 3, 8, 6), torch.rand(2), torch.randn(2, 5, 32),
                                torch.randn(2, 16), cond, *([y_mask] if masked else []))


def _ltx2(depth: int, audio: bool = False):
    from videodit.models.ltx2.geometry import LTX2Geometry
    from videodit.models.ltx2.model import LTX2Model
    model = LTX2Model(LTX2Geometry(num_layers=depth, num_heads=2, head_dim=16, audio_head_dim=8, in_channels=8,
                                   audio_in_channels=8, caption_channels=None, gated_attention=True,
                                   cross_attention_adaln=True))
    video = (torch.randn(2, 8, 3, 4, 6), torch.rand(2), torch.randn(2, 5, 32))
    if not audio:
        return model, lambda: model(*video)
    return model, lambda: model(*video, audio=torch.randn(2, 7, 8), audio_context=torch.randn(2, 5, 16))


BUILDERS = {"stdit": _stdit, "wan": _wan, "mmdit": _mmdit, "ltx2": _ltx2}


def build(name: str, depth: int, **options):
    """(model, run) of family ``name`` with ``depth`` blocks (MMDiT: that many double and single)."""
    return BUILDERS[name](depth, **options)
