"""Write the golden fixtures of Wan 2.1's VAE (tests/fixtures/wan_vae/) with Wan's own code, so
videodit's tests check parity offline without it.

    python scripts/make_wan_vae_fixtures.py /path/to/Wan2.1 [--commit 9737cba]

Only ``wan/modules/vae.py`` of the checkout is used: it is loaded as a lone module file (the
``wan`` package imports flash-attention, the DiT and more). It needs ``einops``; without it, a
stand-in for the two ``rearrange`` patterns that file uses is installed. The script builds Wan's
``WanVAE_`` at a tiny size with the released topology (4 stages, 2 residual blocks per stage,
temporal downsampling ``[False, True, True]``, so 8x spatial and 4x causal temporal
compression, z_dim 16) but base dim 4, sets every weight to a random value, and writes:

* ``Wan2.1_VAE_tiny.pth``: its state dict in Wan's original layout, a plain dict of tensors as
  ``Wan2.1_VAE.pth`` is (loadable with ``weights_only=True``), and the same tensors as
  ``Wan2.1_VAE_tiny.safetensors``;
* ``cases.safetensors``: for 1, 5 and 9 frames (two clips) of 32x32 pixels, ``video_T`` (uint8;
  the VAE's input is ``video_T / 127.5 - 1``), Wan's posterior mean ``mu_T`` (un-normalised),
  ``latents_T`` (normalised with Wan's 16-value mean/std tables, through Wan's ``WanVAE`` wrapper,
  which encodes clip by clip) and ``decoded_T`` (``WanVAE.decode(latents_T)``, clamped to
  [-1, 1] as Wan does), plus the tables as ``latents_mean`` / ``latents_std``;
* ``meta.json``: the architecture arguments and where the outputs came from.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import subprocess
import sys
import types
from pathlib import Path

import torch

FRAMES = {1: 1, 5: 1, 9: 2}   # frame count -> clips
SIZE = 32
TINY = dict(dim=4, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=2, attn_scales=[],
            temperal_downsample=[False, True, True], dropout=0.0)


def _einops_stand_in() -> None:
    """``einops.rearrange`` for the patterns wan/modules/vae.py (2.1) and vae2_2.py (2.2) use (only
    when einops is absent)."""
    def rearrange(x: torch.Tensor, pattern: str, **sizes: int) -> torch.Tensor:
        pattern = " ".join(pattern.replace("->", " -> ").split())
        if pattern == "b c t h w -> (b t) c h w":
            b, c, t, h, w = x.shape
            return x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
        if pattern == "(b t) c h w -> b c t h w":
            t = sizes["t"]
            bt, c, h, w = x.shape
            return x.reshape(bt // t, t, c, h, w).permute(0, 2, 1, 3, 4)
        if pattern == "b c f (h q) (w r) -> b (c r q) f h w":
            q, r = sizes["q"], sizes["r"]
            b, c, f, hq, wr = x.shape
            x = x.reshape(b, c, f, hq // q, q, wr // r, r)
            return x.permute(0, 1, 6, 4, 2, 3, 5).reshape(b, c * r * q, f, hq // q, wr // r)
        if pattern == "b (c r q) f h w -> b c f (h q) (w r)":
            q, r = sizes["q"], sizes["r"]
            b, crq, f, h, w = x.shape
            x = x.reshape(b, crq // (r * q), r, q, f, h, w)
            return x.permute(0, 1, 4, 5, 3, 6, 2).reshape(b, crq // (r * q), f, h * q, w * r)
        raise NotImplementedError(pattern)

    sys.modules["einops"] = types.ModuleType("einops")
    sys.modules["einops"].rearrange = rearrange


def import_wan_vae(checkout: Path):
    """wan/modules/vae.py as a stand-alone module."""
    if importlib.util.find_spec("einops") is None:
        _einops_stand_in()
    path = checkout / "wan" / "modules" / "vae.py"
    spec = importlib.util.spec_from_file_location("wan_reference_vae", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, path


@torch.no_grad()
def randomise(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Every weight random (Wan zero-initialises its attention projections, which would hide a
    mis-mapped tensor): conv weights ~ N(0, 1/fan_in), RMS-norm gammas ~ 1 + N(0, 0.1^2),
    biases ~ N(0, 0.1^2)."""
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=generator)
        if name.endswith("gamma"):
            p.copy_(1 + 0.1 * noise)
        elif p.ndim > 1:
            p.copy_(noise / math.sqrt(p[0].numel()))
        else:
            p.copy_(0.1 * noise)
    # With these scales ~98.5% of the decoded pixels land inside [-1, 1], as a trained VAE's do
    # (Wan clamps the rest), so the decode comparison is not hidden by clamping.


def build(wan, generator: torch.Generator):
    model = wan.WanVAE_(**TINY).eval()
    randomise(model, generator)
    return model


def wrapper(wan, weights: Path):
    """Wan's own ``WanVAE`` (its mean/std tables, clip-by-clip encode, clamped decode) around the
    tiny checkpoint: its ``_video_vae`` hard-codes the released sizes, so add the tiny ones."""
    original = wan._video_vae

    def tiny_video_vae(pretrained_path=None, z_dim=None, device="cpu", **kwargs):
        sizes = {k: v for k, v in TINY.items() if k != "z_dim"}
        return original(pretrained_path=pretrained_path, z_dim=z_dim, device=device, **sizes, **kwargs)

    wan._video_vae = tiny_video_vae
    try:
        return wan.WanVAE(z_dim=TINY["z_dim"], vae_pth=str(weights), dtype=torch.float32, device="cpu")
    finally:
        wan._video_vae = original


@torch.no_grad()
def cases(model, vae, generator: torch.Generator) -> dict[str, torch.Tensor]:
    tensors = {"latents_mean": vae.mean.clone(), "latents_std": vae.std.clone()}
    for frames, clips in FRAMES.items():
        pixels = torch.randint(0, 256, (clips, 3, frames, SIZE, SIZE), generator=generator, dtype=torch.uint8)
        video = pixels.float() / 127.5 - 1
        mu = torch.cat([model.encode(clip[None], [0.0, 1.0]) for clip in video])
        latents = torch.stack(vae.encode(list(video)))
        decoded = torch.stack(vae.decode(list(latents)))
        inside = (decoded.abs() < 1).float().mean().item()
        print(f"T={frames}: latents {tuple(latents.shape)} std {latents.std():.3f}, decoded "
              f"{tuple(decoded.shape)} std {decoded.std():.3f}, {inside:.1%} inside (-1, 1)")
        tensors.update({f"video_{frames}": pixels, f"mu_{frames}": mu.contiguous(),
                        f"latents_{frames}": latents.contiguous(), f"decoded_{frames}": decoded.contiguous()})
    return tensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wan", type=Path, help="a Wan2.1 checkout (github.com/Wan-Video/Wan2.1)")
    parser.add_argument("--commit", default=None, help="the checkout's commit (default: ask git)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "tests/fixtures/wan_vae")
    args = parser.parse_args()
    torch.set_num_threads(1)   # bitwise-stable reference outputs
    wan, source = import_wan_vae(args.wan.resolve())
    generator = torch.Generator().manual_seed(0)
    model = build(wan, generator)

    from safetensors.torch import save_file
    args.out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    torch.save(state, args.out / "Wan2.1_VAE_tiny.pth")
    save_file(state, str(args.out / "Wan2.1_VAE_tiny.safetensors"), metadata={"format": "pt"})

    vae = wrapper(wan, args.out / "Wan2.1_VAE_tiny.pth")
    commit = args.commit or subprocess.run(["git", "-C", str(args.wan), "rev-parse", "HEAD"], capture_output=True,
                                           text=True).stdout.strip() or "unknown"
    save_file(cases(vae.model, vae, generator), str(args.out / "cases.safetensors"),
              metadata={"wan_commit": commit, "torch": torch.__version__})
    meta = {"wan_commit": commit, "source": "wan/modules/vae.py",
            "source_sha256": hashlib.sha256(source.read_bytes()).hexdigest(), "WanVAE_": TINY,
            "frames": {str(k): v for k, v in FRAMES.items()}, "size": SIZE, "torch": torch.__version__,
            "einops": "stand-in" if not hasattr(sys.modules["einops"], "__version__") else
            sys.modules["einops"].__version__}
    (args.out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"wrote {args.out} ({size / 1e6:.2f} MB, Wan {commit[:7]}, {sum(v.numel() for v in state.values())} "
          "parameters)")


if __name__ == "__main__":
    main()
