"""Wan 2.1's VAE (``wan/modules/vae.py``) as a frozen VAE adapter: ``vae.kind=wan2.1``.

The network is diffusers' ``AutoencoderKLWan``, which computes what Wan's ``WanVAE_`` does once
its tensors are renamed. ``vae.path`` is either

* a diffusers folder (``Wan-AI/Wan2.1-T2V-1.3B-Diffusers`` with ``vae.subfolder=vae``, or its
  ``vae/`` folder itself): config.json plus weights, loaded by diffusers with
  ``local_files_only=True``; or
* Wan's original checkpoint file ``Wan2.1_VAE.pth`` (or the same tensors as ``.safetensors``):
  read with ``torch.load(weights_only=True)`` (never unpickling code), its architecture read
  off the tensor names and shapes, and its names mapped to diffusers' here.

Latents follow Wan's ``WanVAE``: the posterior mean, then per channel ``(mu - mean) * (1 / std)``
with the 16-value tables of Wan 2.1 (a diffusers config's ``latents_mean`` / ``latents_std``).
Time is compressed 4x causally: the first frame alone, then 4 frames per latent frame, so clips
need 4k+1 frames (T' = (T - 1) // 4 + 1; Wan silently drops the frames past the last 4k+1,
videodit refuses them instead). Space is compressed 8x.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import torch
from torch import Tensor, nn

from videodit.errors import UserError
from videodit.models.vae_base import FrozenVAE, load_strict
from videodit.user_files import check_regular_file, read_user_json

# Wan 2.1's latent statistics (``WanVAE.__init__`` in wan/modules/vae.py, diffusers' defaults).
WAN21_LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                      0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
WAN21_LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                     3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)

CHECKPOINT_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt")
_WHERE_TO_GET = "point vae.path to Wan2.1_VAE.pth or to a diffusers Wan VAE folder (nothing is downloaded)"


class WanVAE(FrozenVAE):
    """The adapter around a loaded ``AutoencoderKLWan``.

    ``micro_batch`` bounds memory as the other video adapters do: ``max(1, micro_batch // T)``
    clips per pass. Wan's own wrapper encodes clip by clip, which ``micro_batch <= T`` matches.
    """

    def __init__(self, vae: nn.Module, latents_mean, latents_std, micro_batch: int = 16):
        super().__init__()
        self.vae = vae
        cfg = vae.config
        self.latent_channels = int(cfg.z_dim)
        patch = cfg.get("patch_size") or 1
        self.spatial_compression = 2 ** len(cfg.temperal_downsample) * int(patch)
        self.temporal_compression = 2 ** sum(bool(s) for s in cfg.temperal_downsample)
        self.micro_batch = max(1, int(micro_batch))
        mean = _stats(latents_mean, "latents_mean", self.latent_channels)
        std = _stats(latents_std, "latents_std", self.latent_channels)
        if not torch.all(std > 0):
            raise UserError(f"Wan VAE latents_std must be positive, got {std.tolist()}")
        # Wan multiplies by the reciprocal (``scale = [mean, 1.0 / std]``); doing the same keeps
        # the latents bit-identical to Wan's rather than one rounding away.
        self.register_buffer("latents_mean", mean.reshape(1, -1, 1, 1, 1), persistent=False)
        self.register_buffer("latents_inv_std", (1.0 / std).reshape(1, -1, 1, 1, 1), persistent=False)
        self._freeze()

    def latent_size(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        r, s = self.temporal_compression, self.spatial_compression
        if num_frames < 1 or (num_frames - 1) % r:
            lower = max(1, (num_frames - 1) // r * r + 1)
            nearest = f"{lower} or {lower + r}" if lower < num_frames else f"{lower}"
            raise UserError(f"num_frames={num_frames} does not fit Wan 2.1's VAE, which needs {r}k+1 frames "
                            f"(nearest: {nearest}); change the clip length")
        return (num_frames - 1) // r + 1, height // s, width // s

    def num_frames_for(self, latent_frames: int) -> int:
        """Pixel frames that ``decode`` returns for ``latent_frames`` latent frames."""
        return 1 + (latent_frames - 1) * self.temporal_compression

    @torch.no_grad()
    def encode(self, video: Tensor) -> Tensor:
        self._check_input(video)
        b, _, t, h, w = video.shape
        size = self.latent_size(t, h, w)
        video = video.to(device=self.device, dtype=self.dtype)
        per_pass = max(1, self.micro_batch // t)
        mu = torch.cat([self.vae.encode(clips).latent_dist.mode() for clips in video.split(per_pass)])
        latents = (mu.float() - self.latents_mean.float()) * self.latents_inv_std.float()
        if latents.shape != (b, self.latent_channels, *size):   # a misread config would mis-size the model
            raise RuntimeError(f"Wan VAE encoded {tuple(video.shape)} to {tuple(latents.shape)}, not {size}")
        return latents

    @torch.no_grad()
    def decode(self, latents: Tensor, num_frames: int | None = None) -> Tensor:
        if latents.ndim != 5 or latents.shape[1] != self.latent_channels:
            raise ValueError(f"expected latents [B,{self.latent_channels},T',H',W'], got {tuple(latents.shape)}")
        self._check_num_frames(latents, num_frames)
        z = latents.to(self.device).float() / self.latents_inv_std.float() + self.latents_mean.float()
        per_pass = max(1, self.micro_batch // self.num_frames_for(latents.shape[2]))
        video = torch.cat([self.vae.decode(part.to(self.dtype)).sample for part in z.split(per_pass)])
        return video.float().clamp(-1.0, 1.0)


def _stats(values, name: str, channels: int) -> Tensor:
    stats = torch.as_tensor(values, dtype=torch.float32).flatten()
    if stats.numel() != channels:
        raise UserError(f"Wan VAE {name} has {stats.numel()} values for {channels} latent channels; "
                        f"give one per channel")
    return stats


# --------------------------------------------------------------------------- Wan's original layout


def read_checkpoint(file: Path) -> dict[str, Tensor]:
    """A plain ``{name: tensor}`` dict from safetensors or a weights-only torch file."""
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file
            state = load_file(str(check_regular_file(file)))
        else:
            state = torch.load(check_regular_file(file), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "global" in str(exc).lower():   # weights_only met a class or function: it would run code
            raise UserError(f"{file} holds objects other than tensors, which videodit refuses to unpickle; pass "
                            "Wan's Wan2.1_VAE.pth (a plain state dict) or its tensors as safetensors") from None
        raise UserError(f"{file} cannot be read as weights (not a torch checkpoint); restore it from the original "
                        "checkpoint") from None
    except Exception as exc:   # corrupt zip, truncated file, bad safetensors header...
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise UserError(f"{file} cannot be read as weights ({first}); restore it from the original checkpoint") \
            from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in state.items()):
        raise UserError(f"{file} is not a plain state dict of tensors (as Wan2.1_VAE.pth is); save the VAE's "
                        "state dict alone")
    return state


def _blocks(state: dict[str, Tensor], prefix: str) -> dict[int, str]:
    """The kind of each ``{prefix}.N`` entry of Wan's ``nn.Sequential``: res, attn, down2d/3d, up2d/3d."""
    kinds: dict[int, str] = {}
    pattern = re.compile(re.escape(prefix) + r"\.(\d+)\.")
    for name in state:
        match = pattern.match(name)
        if match:
            index = int(match.group(1))
            rest = name[match.end():]
            kind = "res" if rest.startswith(("residual.", "shortcut.")) else \
                "attn" if rest.startswith(("norm.", "to_qkv.", "proj.")) else "resample"
            if kind == "resample" and f"{prefix}.{index}.time_conv.weight" in state:
                kind = "resample3d"
            kinds[index] = kind if kinds.get(index) in (None, kind) else "mixed"
    return dict(sorted(kinds.items()))


def wan_vae_config(state: dict[str, Tensor], where: str) -> dict:
    """``AutoencoderKLWan``'s architecture arguments, read off a Wan 2.1 VAE state dict."""
    def need(name: str) -> Tensor:
        if name not in state:
            raise UserError(f"{where}: tensor {name} is missing; is this Wan 2.1's VAE (Wan2.1_VAE.pth)?")
        return state[name]

    base_dim = need("encoder.conv1.weight").shape[0]
    z_dim = need("conv2.weight").shape[0]
    kinds = _blocks(state, "encoder.downsamples")
    if "attn" in kinds.values() or "mixed" in kinds.values():
        raise UserError(f"{where}: the encoder has attention blocks between its stages (attn_scales), which "
                        "Wan 2.1's VAE has not and diffusers' decoder cannot hold")
    stages: list[list[int]] = [[]]
    temporal: list[bool] = []
    for index, kind in kinds.items():
        if kind == "res":
            stages[-1].append(index)
        else:
            temporal.append(kind == "resample3d")
            stages.append([])
    counts = {len(stage) for stage in stages}
    if len(counts) != 1 or 0 in counts:
        raise UserError(f"{where}: the encoder's stages hold {[len(s) for s in stages]} residual blocks; "
                        "Wan 2.1's VAE has the same number in each")
    dims = [need(f"encoder.downsamples.{stage[0]}.residual.2.weight").shape[0] for stage in stages]
    if any(d % base_dim for d in dims):
        raise UserError(f"{where}: stage widths {dims} are not multiples of the base width {base_dim}")
    return {"base_dim": base_dim, "z_dim": z_dim, "dim_mult": [d // base_dim for d in dims],
            "num_res_blocks": counts.pop(), "attn_scales": [], "temperal_downsample": temporal, "dropout": 0.0}


_RESIDUAL = {"residual.0.gamma": "norm1.gamma", "residual.2.weight": "conv1.weight", "residual.2.bias": "conv1.bias",
             "residual.3.gamma": "norm2.gamma", "residual.6.weight": "conv2.weight", "residual.6.bias": "conv2.bias",
             "shortcut.weight": "conv_shortcut.weight", "shortcut.bias": "conv_shortcut.bias"}
_MIDDLE = {"0": "resnets.0", "1": "attentions.0", "2": "resnets.1"}
_ENDS = {"conv1.": "conv_in.", "head.0.": "norm_out.", "head.2.": "conv_out."}


def to_diffusers_name(name: str, num_res_blocks: int) -> str:
    """Wan's name of one VAE tensor -> ``AutoencoderKLWan``'s (unknown names come back unchanged)."""
    if name.startswith("conv1."):
        return "quant_conv." + name[len("conv1."):]
    if name.startswith("conv2."):
        return "post_quant_conv." + name[len("conv2."):]
    part, _, rest = name.partition(".")
    if part not in ("encoder", "decoder"):
        return name
    for old, new in _ENDS.items():
        if rest.startswith(old):
            return f"{part}.{new}{rest[len(old):]}"
    match = re.match(r"(middle|downsamples|upsamples)\.(\d+)\.(.*)", rest)
    if not match:
        return name
    block, index, tail = match.group(1), int(match.group(2)), match.group(3)
    tail = _RESIDUAL.get(tail, tail)   # resample.* / time_conv.* / attention names are shared
    if block == "middle":
        return f"{part}.mid_block.{_MIDDLE.get(str(index), str(index))}.{tail}"
    if block == "downsamples":   # diffusers keeps the encoder's flat list of blocks
        return f"{part}.down_blocks.{index}.{tail}"
    # The decoder: each stage is num_res_blocks + 1 residual blocks, then one upsampler.
    stage, slot = divmod(index, num_res_blocks + 2)
    inner = f"resnets.{slot}" if slot <= num_res_blocks else "upsamplers.0"
    return f"{part}.up_blocks.{stage}.{inner}.{tail}"


def load_wan_checkpoint(file: Path, dtype: torch.dtype = torch.float32, latents_mean=None,
                        latents_std=None) -> nn.Module:
    """An ``AutoencoderKLWan`` from Wan's original checkpoint; its config carries the latent
    statistics, so ``save_pretrained`` writes a complete diffusers folder."""
    from diffusers import AutoencoderKLWan

    where = f"vae.path='{file}'"
    state = read_checkpoint(file)
    if any(name.startswith(("encoder.conv_in.", "quant_conv.")) for name in state):
        raise UserError(f"{where} holds diffusers' tensor names, not Wan's: point vae.path to the diffusers folder "
                        "(with its config.json) instead")
    config = wan_vae_config(state, where)
    if latents_mean is None and latents_std is None and config["z_dim"] != len(WAN21_LATENTS_MEAN):
        raise UserError(f"{where} has {config['z_dim']} latent channels, but Wan 2.1's latent statistics have "
                        f"{len(WAN21_LATENTS_MEAN)}; pass latents_mean and latents_std")
    config["latents_mean"] = list(WAN21_LATENTS_MEAN if latents_mean is None else latents_mean)
    config["latents_std"] = list(WAN21_LATENTS_STD if latents_std is None else latents_std)
    with torch.device("meta"):
        model = AutoencoderKLWan(**config)
    # Cast before loading: assign=True keeps the given tensors (ModelMixin.to(dtype) would warn).
    renamed = {to_diffusers_name(k, config["num_res_blocks"]): v.to(dtype) for k, v in state.items()}
    load_strict(model, renamed, where=f"{where} (diffusers' names)", stranger="is not part of Wan 2.1's VAE",
                fix="is this Wan 2.1's VAE (Wan2.1_VAE.pth)?")
    return model


# --------------------------------------------------------------------------- diffusers folders


def _load_diffusers(folder: Path, path: str, subfolder: str | None, where: str, dtype: torch.dtype) -> nn.Module:
    try:
        config = read_user_json(folder / "config.json")
    except (OSError, ValueError) as exc:
        raise UserError(f"{where}: cannot read config.json ({exc}); fix or replace it") from None
    name = config.get("_class_name") if isinstance(config, dict) else None
    if name != "AutoencoderKLWan":
        raise UserError(f"{where} holds _class_name={name!r}, not AutoencoderKLWan (Wan 2.1's VAE); "
                        f"{_WHERE_TO_GET}")
    if config.get("is_residual") or config.get("patch_size"):
        raise UserError(f"{where} holds Wan 2.2's VAE (is_residual / patch_size), not Wan 2.1's; "
                        "use vae.kind=diffusers")
    from diffusers import AutoencoderKLWan
    try:
        return AutoencoderKLWan.from_pretrained(str(Path(path).expanduser()), subfolder=subfolder,
                                                local_files_only=True, torch_dtype=dtype)
    except (OSError, ValueError, RuntimeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise UserError(f"cannot load the Wan VAE from {where}: {first}") from None


def _hint(folder: Path) -> str:
    """What to set instead when ``folder`` is a pipeline or Wan checkpoint folder (else the usual advice)."""
    if (folder / "vae" / "config.json").is_file():
        return "it has a vae/ folder: set vae.subfolder=vae"
    originals = sorted(p.name for p in folder.glob("*") if p.suffix in CHECKPOINT_SUFFIXES and "vae" in p.name.lower())
    return f"it holds {originals[0]}: point vae.path to that file" if originals else _WHERE_TO_GET


def build_wan_vae(path: str | None, subfolder: str | None = None, scaling_factor: float | None = None,
                  micro_batch: int = 16, dtype: torch.dtype = torch.float32, latents_mean=None,
                  latents_std=None) -> WanVAE:
    """The frozen Wan 2.1 VAE adapter from ``path`` (joined with ``subfolder``): a diffusers
    ``AutoencoderKLWan`` folder, or Wan's ``Wan2.1_VAE.pth`` / a ``.safetensors`` of its tensors.

    ``dtype``: the weights' and compute dtype (latents come out fp32). ``latents_mean`` /
    ``latents_std`` replace the statistics (default: the folder's config, or Wan 2.1's tables for a
    checkpoint file). ``scaling_factor`` exists to mirror ``build_vae`` and must stay None: Wan's
    latents are normalised by the per-channel statistics alone.
    """
    if scaling_factor is not None:
        raise UserError("vae.scaling_factor does not apply to vae.kind=wan2.1 (its latents are normalised by "
                        "Wan's per-channel mean and std); remove it")
    if path is None or not str(path).strip():
        raise UserError(f"vae.path is required for vae.kind=wan2.1: {_WHERE_TO_GET}")
    target = Path(path).expanduser() / (subfolder or "")
    where = f"vae.path='{path}'" + (f" (vae.subfolder='{subfolder}')" if subfolder else "")
    if target.is_file():
        if target.suffix not in CHECKPOINT_SUFFIXES + (".safetensors",):
            raise UserError(f"{where} is a {target.suffix or 'suffix-less'} file, not a checkpoint "
                            f"({', '.join(CHECKPOINT_SUFFIXES)}, .safetensors); {_WHERE_TO_GET}")
        model = load_wan_checkpoint(target, dtype, latents_mean, latents_std)
    elif not target.is_dir():
        raise UserError(f"{where} is neither a file nor an existing folder: {_WHERE_TO_GET}")
    elif not (target / "config.json").is_file():
        raise UserError(f"{where} has no config.json; {_hint(target)}")
    else:
        model = _load_diffusers(target, path, subfolder, where, dtype)
    mean = model.config.latents_mean if latents_mean is None else latents_mean
    std = model.config.latents_std if latents_std is None else latents_std
    return WanVAE(model, mean, std, micro_batch=micro_batch)


__all__ = ["WAN21_LATENTS_MEAN", "WAN21_LATENTS_STD", "WanVAE", "build_wan_vae", "load_wan_checkpoint",
           "read_checkpoint", "to_diffusers_name", "wan_vae_config"]
