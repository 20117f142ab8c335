"""LTX-2's planner and FLOP hooks (``models/ltx2/spec.py``, ``flops.py``): the FLOP model against
FlopCounterMode on a tiny model called without and with its audio stream (forward, and forward +
backward as a training step runs them: the matmuls fed by data get no input gradient), exactly;
the audio tokens of a clip against the data side's soundtrack window encoded by an audio VAE.

FlopCounterMode counts matmuls only, as the model does; CPU's fused SDPA kernel has no FLOP
formula, so the runs force the math path (``tests/models/test_flops.py``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from videodit.data.audio import AudioSpec, clip_audio
from videodit.models.families import get_spec
from videodit.models.ltx2.flops import grid_flops
from videodit.models.ltx2.geometry import LTX2_0, LTX2_3
from videodit.models.ltx2.model import LTX2Model

FRAMES, POSITIONS, TEXT, AUDIO = 2, 12, 5, 7


def tiny(version: str) -> LTX2Model:
    base = LTX2_3 if version == "2.3" else LTX2_0
    g = dataclasses.replace(base, num_layers=2, num_heads=2, head_dim=16, audio_head_dim=8, in_channels=8,
                            audio_in_channels=8, caption_channels=None if version == "2.3" else 24)
    torch.manual_seed(0)
    return LTX2Model(g)


def call(model: LTX2Model, audio_tokens: int):
    """One text-to-video call (one time per sample), with ``audio_tokens`` audio tokens when > 0."""
    g = model.geometry
    x = torch.randn(1, g.in_channels, FRAMES, 3, 4)
    context = torch.randn(1, TEXT, g.caption_channels or g.dim)
    audio = {} if not audio_tokens else {"audio": torch.randn(1, audio_tokens, g.audio_in_channels),
                                         "audio_context": torch.randn(1, TEXT, g.caption_channels or g.audio_dim)}
    return model(x, torch.tensor([0.4]), context, **audio)


@pytest.mark.parametrize("audio", [0, AUDIO], ids=["video", "audio"])
@pytest.mark.parametrize("version", ["2.0", "2.3"])
def test_flops_equal_flop_counter(version, audio):
    model = tiny(version)
    g = model.geometry
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        call(model, audio)
    count = grid_flops(g, FRAMES * POSITIONS, TEXT, audio)
    assert count.total == counter.get_total_flops()
    spec = get_spec("ltx2")
    extra = {"audio_tokens": audio} if audio else {}
    assert spec.forward_flops(g, FRAMES, POSITIONS, TEXT, **extra) == count


@pytest.mark.parametrize("audio", [0, AUDIO], ids=["video", "audio"])
@pytest.mark.parametrize("version", ["2.0", "2.3"])
def test_training_step_flops_equal_flop_counter(version, audio):
    """Forward + backward: 2x forward, less the input gradients of the matmuls fed by data (the
    patch projections, the time MLPs' first layers, LTX-2.0's caption projections)."""
    model = tiny(version)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = call(model, audio)
        sum(o.square().mean() for o in (out if audio else (out,))).backward()
    count = grid_flops(model.geometry, FRAMES * POSITIONS, TEXT, audio)
    assert count.total + count.backward == counter.get_total_flops()


def test_audio_adds_its_stream_and_the_cross_modal_attentions_to_every_block():
    g = LTX2_3
    video, both = grid_flops(g, 3570, 1024), grid_flops(g, 3570, 1024, 52)
    assert len(both.blocks) == len(video.blocks) == 48
    assert both.blocks[0] > video.blocks[0] and both.attention[0] > video.attention[0]
    assert both.embed > video.embed and both.final > video.final and both.data_fed > video.data_fed


@pytest.fixture(scope="module")
def audio_vae(tmp_path_factory):
    from videodit.models.ltx2.audio_stand_ins import save_ltx2_audio_vae
    from videodit.models.ltx2.audio_vae import build_ltx2_audio
    pytest.importorskip("diffusers")
    folder = save_ltx2_audio_vae(tmp_path_factory.mktemp("audio_vae"), base_channels=16, latent_channels=1,
                                 mel_bins=64)
    return build_ltx2_audio(folder, vocoder=False)


@pytest.mark.parametrize("frames, fps, interval", [(49, 24, 1), (121, 24, 1), (121, 25, 1), (1, 24, 1), (8, 4, 2)])
def test_audio_tokens_are_the_encoded_soundtrack_window(audio_vae, frames, fps, interval):
    """The planner's audio tokens of a clip equal what training encodes: the data side's window
    under ``frames`` frames seen at ``fps``, taken every ``interval``-th frame of a source at
    ``fps x interval`` (silence of its length, as a clip without a soundtrack), through an audio
    VAE (LTX's 4x in time); ``round(25 s)`` of the window (sampling's rule) differs by one at most."""
    indices = list(range(0, (frames - 1) * interval + 1, interval))
    mel = clip_audio("clip.mp4", indices, AudioSpec(), known={"has_audio": False}, fps=fps * interval).audio
    encoded = audio_vae.encode(mel[None]).shape[2]
    tokens = get_spec("ltx2").audio_tokens(frames, fps, interval)
    assert tokens == encoded == audio_vae.latent_frames(mel.shape[1])
    seconds = (indices[-1] + 1) / (fps * interval)   # the window: first frame to the last's end
    assert abs(tokens - audio_vae.latent_size(seconds=seconds)[0]) <= 1
