"""Write the golden fixtures of LTX-2's audio VAE and vocoder (tests/fixtures/ltx2_audio_vae/) with
Lightricks' own code and diffusers'.

    python scripts/make_ltx2_audio_vae_fixtures.py /path/to/LTX-2 [--out tests/fixtures/ltx2_audio_vae]

The checkout is Lightricks/LTX-2 (commit 400fd31); ltx-core is imported on CPU
(``scripts/ltx2_reference.py``); diffusers is the installed one (0.42). ltx-core's ``audio_vae``
package imports torchaudio for its mel front end (``AudioProcessor``) alone, which no fixture runs:
the script lends it an empty ``torchaudio`` module for that import only (nothing else is needed:
torch, einops, safetensors).

Written into ``--out`` (every weight seeded random, rounded to bf16 as the releases store them):

- ``ltx2.0/ltx-2-audio-tiny.safetensors`` and ``ltx2.3/ltx-2-audio-tiny.safetensors``: the audio
  side of a release in its single-file layout: ``audio_vae.*`` (encoder, decoder and the shared
  ``per_channel_statistics``) and ``vocoder.*``, their ltx-core config as JSON in the metadata.
  The audio VAE: base 4 channels x (1, 1, 2), z = 2, 8 mel bins -> tokens of 2 x 2 = 4 features
  (ltx-core normalises the token features with ``ch`` statistics, so ``ch`` = z x bins / 4); 2 res
  blocks a level in LTX-2.3's, 1 in LTX-2.0's, which also has the mid-block attention (the releases
  have none: it checks diffusers' attention against ltx-core's). Vocoders at 64 mel bins (ltx-core's
  stereo input is fixed at 128 = 2 x 64): LTX-2.0's HiFi-GAN (resblock "1", 8x upsampling, two
  resblock kernels, tanh), LTX-2.3's BigVGAN-style first stage (AMP1 snake-beta, clamped) with a
  bandwidth extension (x3 over a causal STFT of hop 4, its DFT bases and mel filters stored in the
  file like the release's).
  Each file is read back by ltx-core's own ``SingleGPUModelBuilder`` with its key filters
  (``AUDIO_VAE_ENCODER/DECODER_COMFY_KEYS_FILTER``, ``VOCODER_COMFY_KEYS_FILTER``), checked to fill
  every tensor, and those modules give the outputs below.
- ``diffusers/audio_vae/`` and ``diffusers/vocoder/``: LTX-2.3's, as diffusers' converter lays them
  out (``convert_ltx2_audio_vae_to_diffusers``; the vocoder renamed with its converter script's
  table, ``final_act_fn: null`` as its LTX-2.3 config has), saved by ``save_pretrained`` (bf16).
- ``cases.safetensors`` + ``cases.json``: fp16-exact mel inputs (``mel`` [2, 2, 17, 8], ``mel_odd``
  [1, 2, 10, 8], ``vocoder_mel`` [1, 2, 6, 64]), random latents ``latents_in`` [1, 2, 3, 2], and per
  version: ltx-core's ``AudioEncoder`` latents (``latents``, ``latents_odd``), ``AudioDecoder`` mels
  (``decoded`` of ``latents``, ``decoded_in`` of ``latents_in``) and vocoder waveform
  (``waveform``); diffusers' (``diffusers_*``: its pipeline's ``_normalize_audio_latents`` /
  ``_pack_audio_latents`` around ``AutoencoderKLLTX2Audio``; its vocoder as converted).

tests/models/test_ltx2_audio_vae.py reads the fixtures; it never needs LTX-2's code.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import ltx2_reference as ref  # noqa: E402

DDCONFIG = dict(ch=4, ch_mult=[1, 1, 2], z_channels=2, mel_bins=8, in_channels=2, out_ch=2,
                resolution=256, double_z=True, norm_type="pixel", causality_axis="height", dropout=0.0)
AUDIO_VAE = {   # ltx-core's config["audio_vae"] layout (model_configurator.py)
    version: {"model": {"params": {"ddconfig": {**DDCONFIG, "mid_block_add_attention": version == "ltx2.0",
                                                "num_res_blocks": 1 if version == "ltx2.0" else 2},
                                   "sampling_rate": 16000}},
              "preprocessing": {"stft": {"hop_length": 160, "filter_length": 1024, "causal": True},
                                "mel": {"n_mel_channels": 8}}}
    for version in ("ltx2.0", "ltx2.3")}
_AMP = dict(resblock="AMP1", stereo=True, activation="snakebeta", use_tanh_at_final=False, use_bias_at_final=False,
            resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 2, 3]])
VOCODER = {
    # 100 mel frames a second x 8 = 800 Hz (the release: x 240 = 24 kHz)
    "ltx2.0": dict(resblock="1", stereo=True, upsample_initial_channel=8, upsample_rates=[4, 2],
                   upsample_kernel_sizes=[8, 4], resblock_kernel_sizes=[3, 5],
                   resblock_dilation_sizes=[[1, 3, 5], [1, 2, 3]], output_sampling_rate=800),
    # first stage x 8 = 800 Hz; BWE: a mel of hop 4 over it, x 12 = 3 x the rate (the release: x 160, hop 80,
    # 16 -> 48 kHz)
    "ltx2.3": {"vocoder": dict(_AMP, upsample_initial_channel=8, upsample_rates=[4, 2], upsample_kernel_sizes=[8, 4]),
               "bwe": dict(_AMP, upsample_initial_channel=4, upsample_rates=[3, 4], upsample_kernel_sizes=[7, 8],
                           apply_final_activation=False, input_sampling_rate=800, output_sampling_rate=2400,
                           hop_length=4, n_fft=16, win_size=16, num_mels=64)},
}
# diffusers' LTX2Vocoder / LTX2VocoderWithBWE configs of the same models, written as diffusers' converter
# script writes its release configs (scripts/convert_ltx2_to_diffusers.py: get_ltx2_vocoder_config)
_STAGE = dict(in_channels=128, out_channels=2, leaky_relu_negative_slope=0.1)
DIFFUSERS_VOCODER = {
    "ltx2.0": ("LTX2Vocoder", dict(_STAGE, hidden_channels=8, upsample_kernel_sizes=[8, 4], upsample_factors=[4, 2],
                                   resnet_kernel_sizes=[3, 5], resnet_dilations=[[1, 3, 5], [1, 2, 3]],
                                   act_fn="leaky_relu", antialias=False, final_act_fn="tanh", final_bias=True,
                                   output_sampling_rate=800)),
    "ltx2.3": ("LTX2VocoderWithBWE", dict(
        _STAGE, hidden_channels=8, upsample_kernel_sizes=[8, 4], upsample_factors=[4, 2], act_fn="snakebeta",
        resnet_kernel_sizes=[3], resnet_dilations=[[1, 2, 3]], antialias=True, antialias_ratio=2,
        antialias_kernel_size=12, final_act_fn=None, final_bias=False,
        bwe_in_channels=128, bwe_hidden_channels=4, bwe_out_channels=2, bwe_upsample_kernel_sizes=[7, 8],
        bwe_upsample_factors=[3, 4], bwe_resnet_kernel_sizes=[3], bwe_resnet_dilations=[[1, 2, 3]],
        bwe_act_fn="snakebeta", bwe_leaky_relu_negative_slope=0.1, bwe_antialias=True, bwe_antialias_ratio=2,
        bwe_antialias_kernel_size=12, bwe_final_act_fn=None, bwe_final_bias=False, filter_length=16, hop_length=4,
        window_length=16, num_mel_channels=64, input_sampling_rate=800, output_sampling_rate=2400)),
}
# diffusers' converter script's vocoder renames (substring replacements, in its order; 2.3 renames
# ".ups." separately, as its special-keys handler does)
DIFFUSERS_RENAMES = {"ltx2.0": {"ups": "upsamplers", "resblocks": "resnets", "conv_pre": "conv_in",
                                "conv_post": "conv_out"},
                     "ltx2.3": {"resblocks": "resnets", "conv_pre": "conv_in", "conv_post": "conv_out",
                                "act_post": "act_out", "downsample.lowpass": "downsample", ".ups.": ".upsamplers."}}
FILE = "ltx-2-audio-tiny.safetensors"


def import_audio(checkout: Path):
    """ltx-core's audio_vae package, torchaudio lent as an empty module for its import (module docstring)."""
    ref.import_ltx_core(checkout)
    import diffusers.pipelines.ltx2  # noqa: F401  (imported first: transformers probes for torchaudio itself)

    lent = "torchaudio" not in sys.modules
    if lent:
        sys.modules["torchaudio"] = types.ModuleType("torchaudio")
    try:
        import ltx_core.model.audio_vae as audio
    finally:
        if lent:
            del sys.modules["torchaudio"]
    return audio


def randomise(module: torch.nn.Module, seed: int) -> None:
    """Seeded values for every parameter and for the STFT / mel buffers (zeros in ltx-core until a
    checkpoint fills them); the anti-aliasing filters keep their computed kaiser windows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if not t.is_floating_point() or name.endswith(".filter"):
                continue
            fresh = torch.randn(t.shape, generator=g)
            if "std-of-means" in name:
                fresh = 0.5 + fresh.abs()
            elif name.endswith("mel_basis"):
                fresh = fresh.abs() / t.shape[-1]
            elif name.endswith(("alpha", "beta")):   # snake's log-scale frequencies: around exp(0) = 1
                fresh = 0.2 * fresh
            elif t.dim() >= 2:
                fresh = fresh / max(1, t[0].numel()) ** 0.5
            else:
                fresh = 0.1 * fresh
            t.copy_(fresh.to(t.dtype))
        for t in [*module.parameters(), *module.buffers()]:   # bf16-exact, as the releases store them
            if t.is_floating_point():
                t.copy_(t.to(torch.bfloat16).float())


def release_tensors(audio, version: str, seed: int) -> dict[str, torch.Tensor]:
    """A release file's audio_vae.* and vocoder.* tensors, from modules built by ltx-core's configurators."""
    meta = {"config": {"audio_vae": AUDIO_VAE[version], "vocoder": VOCODER[version]}}
    encoder = audio.AudioEncoderConfigurator.from_metadata(meta)
    decoder = audio.AudioDecoderConfigurator.from_metadata(meta)
    vocoder = audio.VocoderConfigurator.from_metadata(meta)
    for i, module in enumerate((encoder, decoder, vocoder)):
        randomise(module, seed + i)
    if version == "ltx2.3":   # quieter outputs (powers of 2: still bf16-exact): the first stage's peaks just
        with torch.no_grad():  # past [-1, 1], so its clamp acts while most samples stay unsaturated
            vocoder.vocoder.conv_post.weight.mul_(1 / 16)
            vocoder.bwe_generator.conv_post.weight.mul_(1 / 8)
    tensors = {f"audio_vae.encoder.{k}": v for k, v in encoder.state_dict().items() if "per_channel" not in k}
    tensors.update({f"audio_vae.decoder.{k}": v for k, v in decoder.state_dict().items() if "per_channel" not in k})
    # one set of statistics in the release, which ltx-core's filters hand to both halves
    tensors.update({f"audio_vae.per_channel_statistics.{k}": v
                    for k, v in encoder.per_channel_statistics.state_dict().items()})
    tensors.update({f"vocoder.{k}": v for k, v in vocoder.state_dict().items()})
    return {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}


def ltx_modules(audio, file: Path, tensors: dict):
    """ltx-core's encoder, decoder and vocoder read from ``file`` by its own builder (fp32), each checked
    to hold every tensor of the file's that its filter passes."""
    from ltx_core.loader import SingleGPUModelBuilder as Builder

    out = []
    for configurator, ops, prefix in ((audio.AudioEncoderConfigurator, audio.AUDIO_VAE_ENCODER_COMFY_KEYS_FILTER,
                                       "audio_vae.encoder."),
                                      (audio.AudioDecoderConfigurator, audio.AUDIO_VAE_DECODER_COMFY_KEYS_FILTER,
                                       "audio_vae.decoder."),
                                      (audio.VocoderConfigurator, audio.VOCODER_COMFY_KEYS_FILTER, "vocoder.")):
        module = Builder(model_path=str(file), model_class_configurator=configurator, model_sd_ops=ops).build(
            device=torch.device("cpu"), dtype=torch.float32).eval()
        state = module.state_dict()
        assert not any(t.is_meta for t in state.values()), f"{prefix}: ltx-core left tensors unfilled"
        mine = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        assert all(torch.equal(state[k].float(), v.float()) for k, v in mine.items()), prefix
        assert len(mine) + (2 if prefix != "vocoder." else 0) == len(state), prefix   # + the statistics
        out.append(module)
    return out


def diffusers_models(version: str, tensors: dict):
    """diffusers' AutoencoderKLLTX2Audio (its own converter) and vocoder (its converter script's renames)."""
    from diffusers import AutoencoderKLLTX2Audio
    from diffusers.loaders.single_file_utils import convert_ltx2_audio_vae_to_diffusers
    from diffusers.pipelines import ltx2

    dd = AUDIO_VAE[version]["model"]["params"]["ddconfig"]
    vae = AutoencoderKLLTX2Audio(base_channels=dd["ch"], output_channels=dd["out_ch"], ch_mult=tuple(dd["ch_mult"]),
                                 num_res_blocks=dd["num_res_blocks"], attn_resolutions=None, in_channels=2,
                                 resolution=256, latent_channels=dd["z_channels"], norm_type="pixel",
                                 causality_axis="height", mid_block_add_attention=dd["mid_block_add_attention"],
                                 mel_bins=dd["mel_bins"], double_z=True)
    converted = convert_ltx2_audio_vae_to_diffusers({k: v.float() for k, v in tensors.items()
                                                     if k.startswith("audio_vae.")})
    vae.load_state_dict(converted, strict=True)
    name, config = DIFFUSERS_VOCODER[version]
    vocoder = getattr(ltx2, name)(**config)
    renamed = {}
    for key, value in tensors.items():
        if key.startswith("vocoder."):
            key = key.removeprefix("vocoder.")
            for old, new in DIFFUSERS_RENAMES[version].items():
                key = key.replace(old, new)
            renamed[key] = value.float()
    vocoder.load_state_dict(renamed, strict=True)
    return vae.eval(), vocoder.eval()


def diffusers_encode(vae, mel: torch.Tensor) -> torch.Tensor:
    from diffusers import LTX2Pipeline

    means = vae.encode(mel).latent_dist.mode()
    packed = LTX2Pipeline._normalize_audio_latents(LTX2Pipeline._pack_audio_latents(means), vae.latents_mean,
                                                   vae.latents_std)
    return LTX2Pipeline._unpack_audio_latents(packed, means.shape[2], means.shape[3])


def diffusers_decode(vae, latents: torch.Tensor) -> torch.Tensor:
    from diffusers import LTX2Pipeline

    packed = LTX2Pipeline._denormalize_audio_latents(LTX2Pipeline._pack_audio_latents(latents), vae.latents_mean,
                                                     vae.latents_std)
    return vae.decode(LTX2Pipeline._unpack_audio_latents(packed, latents.shape[2], latents.shape[3])).sample


def fp16_exact(shape, seed: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale + shift).half()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", type=Path, help="a Lightricks/LTX-2 checkout")
    parser.add_argument("--out", type=Path, default=REPO / "tests/fixtures/ltx2_audio_vae")
    args = parser.parse_args()
    audio = import_audio(args.checkout)
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)

    # log-mel-like inputs (ln of magnitudes: around -4), 17 = 4 x 4 + 1 frames and an odd 10
    cases = {"mel": fp16_exact((2, 2, 17, 8), 1, 2.0, -4.0), "mel_odd": fp16_exact((1, 2, 10, 8), 2, 2.0, -4.0),
             "vocoder_mel": fp16_exact((1, 2, 6, 64), 3, 2.0, -4.0), "latents_in": fp16_exact((1, 2, 3, 2), 4)}
    info = {"commit": "400fd31", "audio_vae": AUDIO_VAE, "vocoder": VOCODER, "diffusers_vocoder": DIFFUSERS_VOCODER,
            "measured": {}}
    for i, version in enumerate(AUDIO_VAE):
        tensors = release_tensors(audio, version, 10 * (i + 1))
        file = args.out / version / FILE
        file.parent.mkdir(parents=True)
        save_file(tensors, str(file), metadata={"config": json.dumps({"audio_vae": AUDIO_VAE[version],
                                                                      "vocoder": VOCODER[version]})})
        encoder, decoder, vocoder = ltx_modules(audio, file, tensors)
        dvae, dvocoder = diffusers_models(version, tensors)
        with torch.no_grad():
            mel, odd, vmel, z_in = (cases[k].float() for k in ("mel", "mel_odd", "vocoder_mel", "latents_in"))
            out = {"latents": encoder(mel), "latents_odd": encoder(odd)}
            out.update(decoded=decoder(out["latents"]), decoded_in=decoder(z_in), waveform=vocoder(vmel))
            d = {"latents": diffusers_encode(dvae, mel), "latents_odd": diffusers_encode(dvae, odd),
                 "decoded": diffusers_decode(dvae, out["latents"]), "decoded_in": diffusers_decode(dvae, z_in),
                 "waveform": dvocoder(vmel)}
            if version == "ltx2.3":   # the first stage's clamp, which diffusers' converted config leaves out
                first = dvocoder.vocoder(vmel)
                info["measured"]["ltx2.3 first stage beyond [-1, 1]"] = float((first.abs() - 1).clamp(min=0).max())
        for name, value in out.items():
            cases[f"{version}/{name}"] = value.contiguous()
            cases[f"{version}/diffusers_{name}"] = d[name].contiguous()
            scale = float(value.abs().max()) or 1.0
            info["measured"][f"{version} {name}: diffusers vs ltx-core"] = float((d[name] - value).abs().max()) / scale
        if version == "ltx2.3":
            dvae.to(torch.bfloat16).save_pretrained(str(args.out / "diffusers" / "audio_vae"))
            dvocoder.to(torch.bfloat16).save_pretrained(str(args.out / "diffusers" / "vocoder"))
    save_file(cases, str(args.out / "cases.safetensors"))
    (args.out / "cases.json").write_text(json.dumps(info, indent=2) + "\n")
    for what, value in info["measured"].items():
        print(f"{what}: {value:.3g}")
    total = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"wrote {args.out} ({total / 1e3:.0f} kB)")


if __name__ == "__main__":
    main()
