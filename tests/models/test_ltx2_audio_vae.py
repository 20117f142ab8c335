"""LTX-2's audio VAE and vocoder (videodit/models/ltx2/audio_vae.py) against Lightricks' own code and
diffusers', on the tiny random models scripts/make_ltx2_audio_vae_fixtures.py wrote with ltx-core
(commit 400fd31) and diffusers 0.42: the audio side of an LTX-2.0 and an LTX-2.3 release file, and
LTX-2.3's as diffusers folders; plus the stand-in of videodit/models/ltx2/audio_stand_ins.py."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from tolerance import assert_close  # noqa: E402
from videodit.errors import UserError  # noqa: E402
from videodit.models.ltx2.audio_stand_ins import save_ltx2_audio_vae  # noqa: E402
from videodit.models.ltx2.audio_vae import audio_latents, audio_tokens, build_ltx2_audio  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "ltx2_audio_vae"
FILE = "ltx-2-audio-tiny.safetensors"
SOURCES = {"ltx2.0": FIXTURES / "ltx2.0" / FILE, "ltx2.3": FIXTURES / "ltx2.3" / FILE,
           "diffusers": FIXTURES / "diffusers"}
BOUND = 1e-5   # measured: 0 for every output (fp32 on the same bf16-exact weights)


@pytest.fixture(scope="module")
def cases():
    return load_file(FIXTURES / "cases.safetensors")


@pytest.fixture(scope="module", params=list(SOURCES))
def audio(request):
    return request.param, build_ltx2_audio(str(SOURCES[request.param]))


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message and message
    return message


def _release_copy(tmp_path: Path, tensors: dict | None = None, config: dict | None = None,
                  version: str = "ltx2.3") -> Path:
    """The fixture release file, its tensors or metadata config replaced."""
    source = SOURCES[version]
    with safe_open(str(source), "pt") as f:
        metadata = f.metadata()
    file = tmp_path / FILE
    save_file(load_file(source) if tensors is None else tensors, str(file),
              metadata=metadata if config is None else {"config": json.dumps(config)})
    return file


def _release_config(version: str = "ltx2.3") -> dict:
    with safe_open(str(SOURCES[version]), "pt") as f:
        return json.loads(f.metadata()["config"])


# ----------------------------------------------------------------------------- parity

def test_outputs_equal_ltx_and_diffusers(audio, cases):
    source, vae = audio
    version = "ltx2.3" if source == "diffusers" else source
    mel, odd, vmel, z_in = (cases[k].float() for k in ("mel", "mel_odd", "vocoder_mel", "latents_in"))
    got = {"latents": vae.encode(mel), "latents_odd": vae.encode(odd),
           "decoded": vae.decode(cases[f"{version}/latents"]), "decoded_in": vae.decode(z_in),
           "waveform": vae.vocode(vmel)}
    assert got["latents"].shape == (2, 2, 5, 2) and got["latents_odd"].shape == (1, 2, 3, 2)   # ceil(T / 4)
    assert got["decoded"].shape == (2, 2, 17, 8) and got["decoded_in"].shape == (1, 2, 9, 8)   # 4 T' - 3
    for name, value in got.items():
        assert value.dtype == torch.float32
        assert_close(value, cases[f"{version}/{name}"], BOUND, f"{source} {name} vs ltx-core")
        if not (version == "ltx2.3" and name == "waveform"):   # see the next test
            assert_close(value, cases[f"{version}/diffusers_{name}"], BOUND, f"{source} {name} vs diffusers")
    assert got["waveform"].abs().max() <= 1
    assert not any(p.requires_grad for p in vae.parameters())


def test_bwe_vocoder_clamps_its_first_stage_as_lightricks_does(cases):
    """diffusers' converted LTX-2.3 vocoder leaves out the first stage's clamp that Lightricks' VocoderWithBWE
    applies: that clamp is the whole difference (here the first stage reaches 1.85)."""
    vae = build_ltx2_audio(str(SOURCES["diffusers"]))
    assert vae.vocoder.vocoder.final_act_fn == "clamp"
    assert json.loads((FIXTURES / "diffusers" / "vocoder" / "config.json").read_text())["final_act_fn"] is None
    mel = cases["vocoder_mel"].float()
    assert (vae.vocode(mel) - cases["ltx2.3/diffusers_waveform"]).abs().max() > 0.1
    vae.vocoder.vocoder.final_act_fn = None   # diffusers' own
    assert_close(vae.vocode(mel), cases["ltx2.3/diffusers_waveform"], BOUND, "stock diffusers vocoder")


# ----------------------------------------------------------------------------- sizes and tokens

def test_sizes_rates_and_tokens(audio, cases):
    source, vae = audio
    version = "ltx2.3" if source == "diffusers" else source
    assert (vae.latent_channels, vae.mel_bins, vae.latent_mel_bins, vae.token_width) == (2, 8, 2, 4)
    assert (vae.sample_rate, vae.hop_length, vae.n_fft, vae.latents_per_second) == (16000, 160, 1024, 25.0)
    assert vae.output_sample_rate == (800 if version == "ltx2.0" else 2400)
    assert [vae.latent_frames(t) for t in (1, 4, 5, 17, 205)] == [1, 1, 2, 5, 52]
    assert [vae.mel_frames(t) for t in (1, 2, 5, 52)] == [1, 5, 17, 205]
    # a 49-frame clip at 24 fps: LTX generates round(2.0417 s x 25) = 51 latents; its mel (32666 samples //
    # 160 + 1 = 205 frames) encodes to 52
    assert vae.latent_size(seconds=49 / 24) == (51, 2) and vae.latent_size(mel_frames=205) == (52, 2)
    with pytest.raises(ValueError, match="exactly one"):
        vae.latent_size()
    latents = cases[f"{version}/latents"]
    tokens = vae.tokens(latents)
    assert tokens.shape == (2, 5, 4)
    assert torch.equal(tokens[1, 3], latents[1, :, 3, :].flatten())   # ltx-core's "b c t f -> b t (c f)"
    assert torch.equal(vae.untokens(tokens), latents) and torch.equal(audio_latents(audio_tokens(latents), 2), latents)


def test_a_clips_latents_ignore_the_silence_padded_after_it(cases):
    """Causal in time (the releases have no attention): a clip padded to a batch's longest mel encodes to
    its own latents followed by more, so a padded batch is cut to ``latent_frames(length)`` per clip."""
    vae = build_ltx2_audio(str(SOURCES["ltx2.3"]), vocoder=False)
    mel = cases["mel_odd"].float()
    padded = torch.cat([mel, torch.full((1, 2, 7, 8), -11.5129)], dim=2)   # log(1e-5): LTX's silence
    # equal up to the convolutions' summation order, which the input's length changes (measured 9e-8 to 2e-7)
    assert_close(vae.encode(padded)[:, :, :vae.latent_frames(10)], vae.encode(mel), BOUND, "padded clip's latents")


def test_frozen_and_shape_checks(audio):
    _, vae = audio
    vae.train()
    assert not vae.training and not vae.vae.training
    with pytest.raises(ValueError, match=r"mel \[B, 2, T, 8\]"):
        vae.encode(torch.zeros(1, 2, 9, 64))
    with pytest.raises(ValueError, match=r"latents \[B, 2, T, 2\]"):
        vae.decode(torch.zeros(1, 8, 3, 16))
    with pytest.raises(ValueError, match="C x bins = 128"):
        vae.vocode(torch.zeros(1, 2, 9, 8))


def test_without_vocoder(tmp_path):
    vae = build_ltx2_audio(str(SOURCES["ltx2.0"]), vocoder=False)
    assert vae.vocoder is None and vae.output_sample_rate is None
    with pytest.raises(UserError, match="without its vocoder") as exc:
        vae.vocode(torch.zeros(1, 2, 4, 64))
    _one_line(exc)
    folder = tmp_path / "LTX-2"
    shutil.copytree(FIXTURES / "diffusers" / "audio_vae", folder / "audio_vae")
    assert build_ltx2_audio(str(folder / "audio_vae"), vocoder=False).vocoder is None
    with pytest.raises(UserError, match=r"vocoder is missing") as exc:
        build_ltx2_audio(str(folder / "audio_vae"))
    _one_line(exc)


# ----------------------------------------------------------------------------- layouts and refusals

def test_layouts(tmp_path, cases):
    """The diffusers root, its audio_vae/ folder (vocoder beside it) and path + subfolder all load the same."""
    mel = cases["mel"].float()
    want = cases["ltx2.3/latents"]
    for path, subfolder in ((FIXTURES / "diffusers" / "audio_vae", None), (FIXTURES, "diffusers"),
                            (FIXTURES / "ltx2.3", FILE)):
        vae = build_ltx2_audio(str(path), subfolder)
        assert_close(vae.encode(mel), want, BOUND, f"{path.name} + {subfolder}")
        assert vae.output_sample_rate == 2400
    vae = build_ltx2_audio(str(SOURCES["ltx2.3"]), dtype=torch.bfloat16)
    assert vae.dtype == torch.bfloat16 and next(vae.vocoder.parameters()).dtype == torch.float32
    assert_close(vae.encode(mel), want, 0.05, "bf16 audio VAE")


def test_key_mismatch_is_one_line_naming_the_file(tmp_path):
    tensors = load_file(SOURCES["ltx2.3"])
    missing = {k: v for k, v in tensors.items() if k != "audio_vae.decoder.conv_out.conv.bias"}
    with pytest.raises(UserError, match=r"ltx-2-audio-tiny\.safetensors: tensor decoder\.conv_out\.conv\.bias is "
                                        "missing") as exc:
        build_ltx2_audio(str(_release_copy(tmp_path, missing)))
    _one_line(exc)
    extra = dict(tensors, **{"audio_vae.encoder.stray.weight": torch.zeros(2)})
    with pytest.raises(UserError, match=r"tensor encoder\.stray\.weight is not part of the "
                                        "AutoencoderKLLTX2Audio") as exc:
        build_ltx2_audio(str(_release_copy(tmp_path, extra)))
    _one_line(exc)
    wrong = dict(tensors, **{"vocoder.vocoder.conv_pre.weight": torch.zeros(8, 128, 5)})
    with pytest.raises(UserError, match=r"tensor vocoder\.conv_in\.weight has shape \(8, 128, 5\)") as exc:
        build_ltx2_audio(str(_release_copy(tmp_path, wrong)))
    _one_line(exc)
    stray = dict(tensors, **{"vocoder.bwe_generator.ups.9.weight": torch.zeros(1)})
    with pytest.raises(UserError, match=r"bwe_generator\.upsamplers\.9\.weight is not part of the LTX2VocoderWithBWE"):
        build_ltx2_audio(str(_release_copy(tmp_path, stray)))
    folder = tmp_path / "LTX-2"
    shutil.copytree(FIXTURES / "diffusers", folder)
    weights = folder / "vocoder" / "diffusion_pytorch_model.safetensors"
    state = load_file(weights)
    state["act_out.alpha"] = state.pop("vocoder.act_out.act.alpha")
    save_file(state, str(weights))
    with pytest.raises(UserError, match=r"LTX-2/vocoder: tensor vocoder\.act_out\.act\.alpha is missing") as exc:
        build_ltx2_audio(str(folder))
    _one_line(exc)


class _Planted:
    """Unpickling it would leave a file behind (what a malicious pickle does, harmlessly)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_a_pickle_is_never_loaded(tmp_path, monkeypatch):
    folder = tmp_path / "LTX-2"
    shutil.copytree(FIXTURES / "diffusers", folder)
    marker = tmp_path / "unpickled"
    (folder / "audio_vae" / "diffusion_pytorch_model.safetensors").unlink()
    (folder / "audio_vae" / "diffusion_pytorch_model.bin").write_bytes(pickle.dumps(_Planted(str(marker))))

    def refuse(*args, **kwargs):
        raise AssertionError("a pickle was opened")
    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    with pytest.raises(UserError, match=r"diffusion_pytorch_model\.bin, a pickle, which videodit never loads") as exc:
        build_ltx2_audio(str(folder))
    _one_line(exc)
    assert not marker.exists()
    # a release file is safetensors or nothing: a pickle under that name is refused unread
    fake = tmp_path / FILE
    fake.write_bytes(pickle.dumps(_Planted(str(marker))))
    with pytest.raises(UserError, match="cannot be read as safetensors") as exc:
        build_ltx2_audio(str(fake))
    _one_line(exc)
    assert not marker.exists()


def test_config_refusals_are_one_line(tmp_path):
    cases = []
    config = _release_config()
    config["vocoder"]["vocoder"]["resblock"] = "2"
    cases.append((config, r"vocoder\.vocoder\.resblock='2' is not 'AMP1'", "ltx2.3"))
    config = _release_config()
    config["audio_vae"]["model"]["params"]["ddconfig"]["causality_axis"] = "width"
    cases.append((config, r"audio_vae ddconfig\.causality_axis='width' is not 'height'", "ltx2.3"))
    config = _release_config()
    config["audio_vae"]["model"]["params"]["ddconfig"]["ch_mult"] = [1, 2, 2, 4]
    cases.append((config, r"ch_mult=\[1, 2, 2, 4\] is not a list of 3 whole numbers", "ltx2.3"))
    config = _release_config()
    config["vocoder"]["bwe"]["output_sampling_rate"] = 2000
    cases.append((config, "bandwidth extension does not fit its first stage", "ltx2.3"))
    config = _release_config("ltx2.0")
    config["vocoder"]["upsample_rates"] = [4, "2"]
    cases.append((config, r"vocoder\.upsample_rates=\[4, '2'\] is not a list of whole numbers", "ltx2.0"))
    cases.append(({"vae": {}}, "has no audio_vae config in its safetensors metadata", "ltx2.0"))
    for config, message, version in cases:
        with pytest.raises(UserError, match=message) as exc:
            build_ltx2_audio(str(_release_copy(tmp_path, config=config, version=version)))
        _one_line(exc)
    with pytest.raises(UserError, match="audio.path is required"):
        build_ltx2_audio(None)
    with pytest.raises(UserError, match="neither an LTX-2 release file nor a diffusers LTX-2 folder") as exc:
        build_ltx2_audio(str(tmp_path / "nowhere"))
    _one_line(exc)
    folder = tmp_path / "LTX-2"
    shutil.copytree(FIXTURES / "diffusers", folder)
    config_file = folder / "vocoder" / "config.json"
    config_file.write_text(config_file.read_text().replace("LTX2VocoderWithBWE", "HifiGan"))
    with pytest.raises(UserError, match="_class_name='HifiGan', not LTX2Vocoder or LTX2VocoderWithBWE") as exc:
        build_ltx2_audio(str(folder))
    _one_line(exc)
    config_file = folder / "audio_vae" / "config.json"
    config_file.write_text(config_file.read_text().replace('"base_channels": 4', '"base_channels": "four"'))
    with pytest.raises(UserError, match="does not build diffusers. AutoencoderKLLTX2Audio") as exc:
        build_ltx2_audio(str(folder), vocoder=False)
    _one_line(exc)


# ----------------------------------------------------------------------------- the stand-in

@pytest.mark.parametrize("bwe", [False, True])
def test_stand_in_feeds_a_tiny_ltx2_dit(tmp_path, bwe):
    from videodit.models.ltx2.geometry import LTX2Geometry
    from videodit.models.ltx2.model import LTX2Model

    vae = build_ltx2_audio(str(save_ltx2_audio_vae(tmp_path / "audio", bwe=bwe)))
    assert (vae.latent_channels, vae.latent_mel_bins, vae.token_width) == (2, 4, 8)
    assert vae.output_sample_rate == (48000 if bwe else 24000)
    mel = torch.randn(1, 2, 21, 16, generator=torch.Generator().manual_seed(0)) - 4
    latents = vae.encode(mel)
    assert latents.shape == (1, 2, 6, 4)
    decoded = vae.decode(latents)
    assert decoded.shape == (1, 2, 21, 16) and decoded.isfinite().all()
    waveform = vae.vocode(decoded)
    assert waveform.shape == (1, 2, 21 * vae.output_sample_rate // 100) and waveform.abs().max() <= 1
    g = LTX2Geometry(num_layers=1, num_heads=2, head_dim=16, audio_head_dim=8, in_channels=8,
                     audio_in_channels=vae.token_width, caption_channels=None, gated_attention=True,
                     cross_attention_adaln=True)
    model = LTX2Model(g)
    model.init_weights()
    with torch.no_grad():
        _, audio_velocity = model(torch.randn(1, 8, 2, 2, 2), torch.rand(1), torch.randn(1, 3, 32),
                                         audio=vae.tokens(latents), audio_context=torch.randn(1, 3, 16))
    assert audio_velocity.shape == (1, 6, 8) and vae.untokens(audio_velocity).shape == latents.shape
    with pytest.raises(ValueError, match="must equal latent_channels x mel_bins / 4"):
        save_ltx2_audio_vae(tmp_path / "bad", base_channels=4)
