"""Write the golden fixtures of Open-Sora 1.2's VAE (tests/fixtures/opensora/vae/) with
Open-Sora's own code, so videodit's tests can check parity offline without it.

    /work/osenv/bin/python scripts/make_opensora_vae_fixtures.py --opensora /path/to/Open-Sora

Open-Sora v1.2.0 (tag v1.2.0) plus ``einops timm rotary_embedding_torch==0.5.3 mmengine
diffusers`` are needed; colossalai is replaced by import-only stubs. The script builds a tiny
``VideoAutoencoderPipeline`` (a tiny SD-VAE, a tiny ``VAE_Temporal``, 17-frame chunks), sets
every weight and the shift/scale buffers to random values, and writes:

* ``config.json`` + ``model.safetensors``: the released layout (``spatial_vae.module.*``,
  ``temporal_vae.*``, ``scale``, ``shift``); ``spatial_vae/config.json``: the tiny SD-VAE's
  diffusers config, which the released folder does not need (its SD-VAE is SDXL's);
* ``cases.safetensors``: for 1, 17, 20 (two clips) and 51 frames of 16x20 pixels (a width not
  divisible by 8): ``video_T`` (uint8 pixels; the VAE's input is ``video_T / 127.5 - 1``),
  Open-Sora's ``latents_T = encode(video)`` and ``decoded_T = decode(latents_T, num_frames=T)``
  (16x16: the SD-VAE floors 20 to 2 latents).

Open-Sora's encode samples both posteriors; here ``sample`` is replaced by ``mode`` (the mean),
which is what videodit's deterministic encode computes.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import torch

FRAMES = (1, 17, 20, 51)
HEIGHT, WIDTH = 16, 20
TINY_SD_VAE = dict(in_channels=3, out_channels=3, latent_channels=4, act_fn="silu",
                   block_out_channels=[8, 8, 16, 16], layers_per_block=1, norm_num_groups=4,
                   down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                   sample_size=32)
TINY_TEMPORAL = dict(type="VAE_Temporal", in_out_channels=4, latent_embed_dim=4, embed_dim=4, filters=4,
                     num_res_blocks=2, channel_multipliers=[1, 2, 2, 2],
                     temporal_downsample=[False, True, True], num_groups=2)


def import_opensora(root: Path):
    """Open-Sora's VAE modules, importable on CPU without colossalai or the model zoo."""
    for name, attrs in {"colossalai": {}, "colossalai.booster": {"Booster": object},
                        "colossalai.checkpoint_io": {"GeneralCheckpointIO": object},
                        "colossalai.utils": {"get_current_device": lambda: torch.device("cpu")}}.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        sys.modules[name] = module
    sys.path.insert(0, str(root))
    # opensora/models/__init__.py imports every model (and xformers); only the VAE is needed.
    models = types.ModuleType("opensora.models")
    models.__path__ = [str(root / "opensora" / "models")]
    sys.modules["opensora.models"] = models
    from opensora.models.vae import utils as vae_utils
    from opensora.models.vae.vae import VideoAutoencoderPipeline, VideoAutoencoderPipelineConfig
    return VideoAutoencoderPipeline, VideoAutoencoderPipelineConfig, vae_utils.DiagonalGaussianDistribution


def use_posterior_means(opensora_gaussian) -> None:
    """Open-Sora's encode calls ``.sample()`` on both posteriors; make it the mean."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
    DiagonalGaussianDistribution.sample = lambda self, generator=None: self.mode()
    opensora_gaussian.sample = lambda self: self.mode()


@torch.no_grad()
def randomise(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Every weight random (no zero or identity init left to hide a mistake), scaled so
    activations stay O(1): weights ~ N(0, 1/fan_in), norm affines ~ 1 + N(0, 0.1^2)."""
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=generator)
        if p.ndim > 1:
            p.copy_(noise / math.sqrt(p[0].numel()))
        elif "norm" in name and name.endswith("weight"):
            p.copy_(1 + 0.1 * noise)
        else:
            p.copy_(0.1 * noise)
    # Decoded pixels mostly inside [-1, 1], as a trained VAE's are: videodit clamps them.
    model.spatial_vae.module.decoder.conv_out.weight.mul_(0.6)
    channels = model.shift.numel()
    model.shift.copy_(0.5 * torch.randn(channels, generator=generator).reshape(model.shift.shape))
    model.scale.copy_((0.5 + 1.5 * torch.rand(channels, generator=generator)).reshape(model.scale.shape))


def build(opensora, workdir: Path, generator: torch.Generator):
    from diffusers import AutoencoderKL
    pipeline_cls, config_cls, _ = opensora
    AutoencoderKL(**TINY_SD_VAE).save_pretrained(workdir)   # Open-Sora loads its SD-VAE from a folder
    config = config_cls(vae_2d=dict(type="VideoAutoencoderKL", from_pretrained=str(workdir), micro_batch_size=4),
                        vae_temporal=dict(TINY_TEMPORAL), micro_frame_size=17, shift=[0.0] * 4, scale=[1.0] * 4)
    model = pipeline_cls(config).eval()
    randomise(model, generator)
    return model


def save_folder(model, out: Path) -> None:
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config["architectures"] = ["VideoAutoencoderPipeline"]
    config["vae_2d"]["from_pretrained"] = "spatial_vae"   # was a temporary folder
    config["shift"], config["scale"] = model.shift.flatten().tolist(), model.scale.flatten().tolist()
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    model.spatial_vae.module.save_config(out / "spatial_vae")
    spatial = json.loads((out / "spatial_vae" / "config.json").read_text())
    spatial.pop("_name_or_path", None)   # the temporary folder it was built in
    (out / "spatial_vae" / "config.json").write_text(json.dumps(spatial, indent=2, sort_keys=True) + "\n")


@torch.no_grad()
def cases(model, generator: torch.Generator) -> dict[str, torch.Tensor]:
    tensors = {}
    for frames in FRAMES:
        batch = 2 if frames == 20 else 1
        pixels = torch.randint(0, 256, (batch, 3, frames, HEIGHT, WIDTH), generator=generator, dtype=torch.uint8)
        latents = model.encode(pixels.float() / 127.5 - 1)
        decoded = model.decode(latents, num_frames=frames).contiguous()
        inside = (decoded.abs() < 1).float().mean().item()
        print(f"T={frames:2d}: latents {tuple(latents.shape)} std {latents.std():.3f}, decoded "
              f"{tuple(decoded.shape)} std {decoded.std():.3f}, {inside:.2%} inside [-1, 1]")
        tensors.update({f"video_{frames}": pixels, f"latents_{frames}": latents, f"decoded_{frames}": decoded})
    return tensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opensora", type=Path, required=True, help="an Open-Sora checkout (tag v1.2.0)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "tests/fixtures/opensora/vae")
    args = parser.parse_args()
    torch.set_num_threads(1)   # bitwise-stable reference outputs
    opensora = import_opensora(args.opensora.resolve())
    use_posterior_means(opensora[2])
    generator = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as workdir:
        model = build(opensora, Path(workdir), generator)
    save_folder(model, args.out)
    commit = subprocess.run(["git", "-C", str(args.opensora), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    from safetensors.torch import save_file
    import diffusers
    save_file(cases(model, generator), str(args.out / "cases.safetensors"),
              metadata={"opensora_commit": commit, "torch": torch.__version__, "diffusers": diffusers.__version__})
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"wrote {args.out} ({size / 1e6:.2f} MB, Open-Sora {commit[:7]})")


if __name__ == "__main__":
    main()
