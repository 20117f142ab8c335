"""Write the golden fixtures of Wan 2.2's VAE (tests/fixtures/wan22_vae/) with Wan's own code, so
videodit's tests check parity offline without it.

    python scripts/make_wan22_vae_fixtures.py /path/to/Wan2.2 [--commit 42bf4cf] \\
        [--diffusers-converter /path/to/diffusers/scripts/convert_wan_to_diffusers.py]

Only ``wan/modules/vae2_2.py`` of the checkout is used: it is loaded as a lone module file (the
``wan`` package imports flash-attention, the DiT and more). It needs ``einops``; without it, a
stand-in for the ``rearrange`` patterns that file uses is installed. The script builds Wan's
``WanVAE_`` (Wan 2.2's: 2x2 pixel patches in, so 12 input and output channels; residual
``AvgDown3D`` / ``DupUp3D`` shortcuts around each stage; a decoder wider than the encoder) at a
tiny size with the released topology where it costs nothing (4 stages, 2 residual blocks per
encoder stage and 3 per decoder stage, temporal downsampling ``[False, True, True]``: 16x spatial
and 4x causal temporal compression; z_dim 48, so Wan's own 48-value latent tables apply) but base
widths 4 (encoder) and 3 (decoder; the release has 160 and 256) and widths ``[1, 2, 2, 2]``
(the release has ``[1, 2, 4, 4]``, which would make the fixture 3x bigger), sets every weight to a
random value, and writes:

* ``Wan2.2_VAE_tiny.pth``: its state dict in Wan's original layout, a plain dict of tensors as
  ``Wan2.2_VAE.pth`` is (loadable with ``weights_only=True``), and the same tensors as
  ``Wan2.2_VAE_tiny.safetensors``;
* ``cases.safetensors``: for 1, 5 (two clips) and 9 frames of 32x48 pixels (non-square, so a
  swapped height and width shows), ``video_T`` (uint8; the VAE's input is ``video_T / 127.5 - 1``),
  Wan's posterior mean ``mu_T`` (un-normalised, ``WanVAE_.encode(x, [0, 1])``), ``latents_T``
  (through Wan's ``Wan2_2_VAE`` wrapper, clip by clip: ``(mu - mean) * (1 / std)`` with its 48-value
  tables) and ``decoded_T`` (``Wan2_2_VAE.decode(latents_T)``: the inverse normalisation, then
  clamped to [-1, 1] as Wan does), plus the wrapper's tables as ``latents_mean`` and
  ``latents_inv_std`` (``Wan2_2_VAE.scale``: Wan keeps ``1 / std``, not ``std``);
* ``diffusers/vae/``: the same weights as a diffusers ``AutoencoderKLWan`` folder, converted by
  diffusers' own ``convert_vae_22`` (``--diffusers-converter``: diffusers' script
  ``scripts/convert_wan_to_diffusers.py``, or any file defining its ``convert_vae_22`` and
  ``vae22_diffusers_config``; it is not part of the installed diffusers package). Its download is
  replaced by the tiny ``.pth`` and its config's sizes by the tiny ones; config keys the installed
  ``AutoencoderKLWan`` does not take are dropped (listed in meta.json). Without the converter the
  folder is not written and meta.json says so;
* ``released_names.json``: diffusers' converter's renaming of every tensor name of the *released*
  Wan 2.2 VAE (``WanVAE_`` as ``Wan2_2_VAE`` builds it, on the meta device: names and shapes, no
  weights) and the converter's released config, so the tests check videodit's own renaming and
  architecture reading on the real checkpoint's names and shapes, offline;
* ``meta.json``: the architecture arguments, where the outputs came from, and the parity of the
  converted diffusers model against Wan's outputs.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import inspect
import json
import subprocess
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_wan_vae_fixtures import _einops_stand_in, randomise  # noqa: E402  (shared with the 2.1 fixtures)

FRAMES = {1: 1, 5: 2, 9: 1}   # frame count -> clips
HEIGHT, WIDTH = 32, 48
TINY = dict(dim=4, dec_dim=3, z_dim=48, dim_mult=[1, 2, 2, 2], num_res_blocks=2, attn_scales=[],
            temperal_downsample=[False, True, True], dropout=0.0)
# ``Wan2_2_VAE`` (wan/modules/vae2_2.py) builds WanVAE_(dim=c_dim=160, dim_mult=[1, 2, 4, 4],
# temperal_downsample=[False, True, True], z_dim=48) and leaves dec_dim at WanVAE_'s default 256.
RELEASED = dict(dim=160, dec_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                temperal_downsample=[False, True, True], dropout=0.0)


def import_wan_vae(checkout: Path):
    """wan/modules/vae2_2.py as a stand-alone module."""
    if importlib.util.find_spec("einops") is None:
        _einops_stand_in()
    path = checkout / "wan" / "modules" / "vae2_2.py"
    spec = importlib.util.spec_from_file_location("wan_reference_vae2_2", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, path


def wrapper(wan, weights: Path):
    """Wan's own ``Wan2_2_VAE`` (its 48-value tables, clip-by-clip encode, clamped decode) around
    the tiny checkpoint: it passes only ``dim``, ``dim_mult``, ``temperal_downsample`` and ``z_dim``
    on to ``_video_vae``, so add the tiny decoder width (WanVAE_'s default is the released 256)."""
    original = wan._video_vae

    def tiny_video_vae(pretrained_path=None, z_dim=None, dim=None, device="cpu", **kwargs):
        kwargs.update(dec_dim=TINY["dec_dim"], num_res_blocks=TINY["num_res_blocks"])
        return original(pretrained_path=pretrained_path, z_dim=z_dim, dim=dim, device=device, **kwargs)

    wan._video_vae = tiny_video_vae
    try:
        return wan.Wan2_2_VAE(z_dim=TINY["z_dim"], c_dim=TINY["dim"], vae_pth=str(weights),
                              dim_mult=TINY["dim_mult"], temperal_downsample=TINY["temperal_downsample"],
                              dtype=torch.float32, device="cpu")
    finally:
        wan._video_vae = original


@torch.no_grad()
def cases(vae, generator: torch.Generator) -> dict[str, torch.Tensor]:
    model = vae.model
    tensors = {"latents_mean": vae.scale[0].clone(), "latents_inv_std": vae.scale[1].clone()}
    for frames, clips in FRAMES.items():
        pixels = torch.randint(0, 256, (clips, 3, frames, HEIGHT, WIDTH), generator=generator, dtype=torch.uint8)
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


# --------------------------------------------------------------------------- diffusers' converter


def load_converter(path: Path):
    spec = importlib.util.spec_from_file_location("diffusers_convert_wan", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "convert_vae_22", None)) or not isinstance(
            getattr(module, "vae22_diffusers_config", None), dict):
        raise RuntimeError(f"{path} defines no convert_vae_22 / vae22_diffusers_config")
    if inspect.signature(module.convert_vae_22).parameters:
        raise RuntimeError(f"{path}: convert_vae_22 takes arguments; this script drives the one of diffusers' "
                           "scripts/convert_wan_to_diffusers.py, which takes none")
    return module


def _accepted(config: dict) -> tuple[dict, list[str]]:
    """The converter's config less the keys the installed ``AutoencoderKLWan`` does not take."""
    from diffusers import AutoencoderKLWan
    params = inspect.signature(AutoencoderKLWan.__init__).parameters
    return {k: v for k, v in config.items() if k in params}, sorted(k for k in config if k not in params)


def convert_tiny(converter, weights: Path) -> tuple[torch.nn.Module, dict]:
    """diffusers' ``convert_vae_22`` on the tiny checkpoint."""
    asked = []

    def local_download(*args, **kwargs):
        asked.append([*map(str, args), *(f"{k}={v}" for k, v in kwargs.items())])
        return str(weights)

    released = dict(converter.vae22_diffusers_config)
    config, dropped = _accepted({**released, "base_dim": TINY["dim"], "decoder_base_dim": TINY["dec_dim"],
                                 "z_dim": TINY["z_dim"], "dim_mult": TINY["dim_mult"],
                                 "num_res_blocks": TINY["num_res_blocks"],
                                 "temperal_downsample": TINY["temperal_downsample"]})
    saved = converter.hf_hub_download
    converter.hf_hub_download = local_download
    converter.vae22_diffusers_config = config
    try:
        model = converter.convert_vae_22().eval()
    finally:
        converter.hf_hub_download = saved
        converter.vae22_diffusers_config = released
    return model, {"asked_for": asked, "config_keys_dropped": dropped,
                   "released_config": {k: v for k, v in released.items() if k not in ("latents_mean", "latents_std")}}


def released_names(wan, converter) -> tuple[dict[str, str], dict[str, list[int]]]:
    """diffusers' renaming of the released Wan 2.2 VAE's tensor names: the converter runs on a
    dict of names (its ``torch.load`` returns them) and a stand-in ``AutoencoderKLWan`` records
    what it was asked to load; the result is checked against the real class's names."""
    from diffusers import AutoencoderKLWan
    with torch.device("meta"):
        shapes = {name: list(t.shape) for name, t in wan.WanVAE_(**RELEASED).state_dict().items()}
    names = list(shapes)
    recorded: dict[str, str] = {}

    class Recorder:
        def __init__(self, **config):
            self.config = config

        def load_state_dict(self, state, strict=True, assign=False):
            recorded.update(state)
            return self

    shim = types.SimpleNamespace(load=lambda *args, **kwargs: {name: name for name in names})
    saved = converter.torch, converter.AutoencoderKLWan, converter.hf_hub_download
    converter.torch, converter.AutoencoderKLWan = shim, Recorder
    converter.hf_hub_download = lambda *args, **kwargs: "Wan2.2_VAE.pth"
    try:
        converter.convert_vae_22()
    finally:
        converter.torch, converter.AutoencoderKLWan, converter.hf_hub_download = saved
    config, _ = _accepted(converter.vae22_diffusers_config)
    with torch.device("meta"):
        expected = set(AutoencoderKLWan(**config).state_dict())
    if set(recorded) != expected or sorted(recorded.values()) != sorted(names):
        raise RuntimeError("diffusers' converter does not rename the released Wan 2.2 VAE's names onto "
                           "AutoencoderKLWan's one to one")
    return {wan_name: ours for ours, wan_name in sorted(recorded.items(), key=lambda kv: kv[1])}, shapes


@torch.no_grad()
def diffusers_parity(model, tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    """The converted model against Wan's outputs (clip by clip, Wan's normalisation)."""
    mean = tensors["latents_mean"].view(1, -1, 1, 1, 1)
    inv_std = tensors["latents_inv_std"].view(1, -1, 1, 1, 1)
    report = {}
    for frames in FRAMES:
        video = tensors[f"video_{frames}"].float() / 127.5 - 1
        mu = torch.cat([model.encode(clip[None]).latent_dist.mode() for clip in video])
        decoded = torch.cat([model.decode(z[None] / inv_std + mean).sample for z in tensors[f"latents_{frames}"]])
        for name, ours, ref in (("mu", mu, tensors[f"mu_{frames}"]), ("decoded", decoded, tensors[f"decoded_{frames}"])):
            report[f"{name}_{frames}"] = {"max_abs_diff": (ours - ref).abs().max().item(),
                                          "max_abs_ref": ref.abs().max().item()}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wan", type=Path, help="a Wan2.2 checkout (github.com/Wan-Video/Wan2.2)")
    parser.add_argument("--commit", default=None, help="the checkout's commit (default: ask git)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "tests/fixtures/wan22_vae")
    parser.add_argument("--diffusers-converter", type=Path, default=None,
                        help="diffusers' scripts/convert_wan_to_diffusers.py (or a file with its convert_vae_22 "
                             "and vae22_diffusers_config): writes diffusers/vae/ and released_names.json")
    parser.add_argument("--diffusers-commit", default=None, help="the diffusers commit the converter comes from")
    args = parser.parse_args()
    torch.set_num_threads(1)   # bitwise-stable reference outputs
    wan, source = import_wan_vae(args.wan.resolve())
    generator = torch.Generator().manual_seed(0)
    model = wan.WanVAE_(**TINY).eval()
    randomise(model, generator)

    from safetensors.torch import save_file
    args.out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    weights = args.out / "Wan2.2_VAE_tiny.pth"
    torch.save(state, weights)
    save_file(state, str(args.out / "Wan2.2_VAE_tiny.safetensors"), metadata={"format": "pt"})

    vae = wrapper(wan, weights)
    commit = args.commit or subprocess.run(["git", "-C", str(args.wan), "rev-parse", "HEAD"], capture_output=True,
                                           text=True).stdout.strip() or "unknown"
    tensors = cases(vae, generator)
    save_file(tensors, str(args.out / "cases.safetensors"), metadata={"wan_commit": commit, "torch": torch.__version__})

    import diffusers
    folder = args.out / "diffusers" / "vae"
    if args.diffusers_converter is None:
        converted = {"written": False, "why": "no --diffusers-converter given (diffusers' convert_vae_22 lives in "
                                              "its repository's scripts/, not in the installed package)"}
        if (args.out / "released_names.json").exists():
            (args.out / "released_names.json").unlink()
    else:
        converter = load_converter(args.diffusers_converter)
        converted_model, how = convert_tiny(converter, weights)
        converted_model.save_pretrained(folder, safe_serialization=True)
        names, shapes = released_names(wan, converter)
        (args.out / "released_names.json").write_text(json.dumps(
            {"source": "diffusers scripts/convert_wan_to_diffusers.py convert_vae_22",
             "diffusers_commit": args.diffusers_commit or "unknown", "WanVAE_": RELEASED,
             "released_config": how["released_config"], "wan_to_diffusers": names, "wan_shapes": shapes}) + "\n")
        parity = diffusers_parity(converted_model, tensors)
        converted = {"written": True, "by": "diffusers scripts/convert_wan_to_diffusers.py convert_vae_22",
                     "converter_file": args.diffusers_converter.name,
                     "converter_sha256": hashlib.sha256(args.diffusers_converter.read_bytes()).hexdigest(),
                     "diffusers_commit": args.diffusers_commit or "unknown", **how, "parity_vs_wan": parity}
        print("diffusers' converted model vs Wan:", json.dumps(parity))
    meta = {"wan_commit": commit, "source": "wan/modules/vae2_2.py",
            "source_sha256": hashlib.sha256(source.read_bytes()).hexdigest(), "WanVAE_": TINY,
            "wrapper": "Wan2_2_VAE(z_dim=48, c_dim=dim, dim_mult, temperal_downsample) with _video_vae given dec_dim "
                       "and num_res_blocks; latents = (mu - mean) * (1 / std), decode = z / (1 / std) + mean, "
                       "clamped to [-1, 1]",
            "frames": {str(k): v for k, v in FRAMES.items()}, "height": HEIGHT, "width": WIDTH,
            "torch": torch.__version__, "diffusers": diffusers.__version__,
            "einops": "stand-in" if not hasattr(sys.modules["einops"], "__version__") else
            sys.modules["einops"].__version__, "diffusers_folder": converted}
    (args.out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"wrote {args.out} ({size / 1e6:.2f} MB, Wan {commit[:7]}, {sum(v.numel() for v in state.values())} "
          "parameters)")


if __name__ == "__main__":
    main()
