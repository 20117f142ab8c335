"""Wan's VAEs as frozen VAE adapters: ``vae.kind=wan2.1`` (``wan/modules/vae.py``) and
``vae.kind=wan2.2`` (Wan 2.2's TI2V-5B VAE, ``wan/modules/vae2_2.py``).

The network is diffusers' ``AutoencoderKLWan``, which computes what Wan's ``WanVAE_`` does once
its tensors are renamed (Wan 2.2's as ``AutoencoderKLWan(is_residual=True, patch_size=2,
in_channels=12, out_channels=12, base_dim=160, decoder_base_dim=256, z_dim=48, ...)``).
``vae.path`` is either

* a diffusers folder (``Wan-AI/Wan2.1-T2V-1.3B-Diffusers`` or ``Wan-AI/Wan2.2-TI2V-5B-Diffusers``
  with ``vae.subfolder=vae``, or its ``vae/`` folder itself): config.json plus weights, loaded by
  diffusers with ``local_files_only=True``; or
* Wan's original checkpoint file ``Wan2.1_VAE.pth`` / ``Wan2.2_VAE.pth`` (or the same tensors as
  ``.safetensors``): read with ``torch.load(weights_only=True)`` (never unpickling code), its
  architecture read off the tensor names and shapes, and its names mapped to diffusers' here.

Latents follow Wan's wrappers (``WanVAE`` / ``Wan2_2_VAE``): the posterior mean, then per channel
``(mu - mean) * (1 / std)`` with the release's tables (16 values for Wan 2.1, 48 for Wan 2.2; a
diffusers config's ``latents_mean`` / ``latents_std``). Time is compressed 4x causally: the first
frame alone, then 4 frames per latent frame, so clips need 4k+1 frames (T' = (T - 1) // 4 + 1;
Wan silently drops the frames past the last 4k+1, videodit refuses them instead). Space is
compressed 8x (Wan 2.1) or 16x (Wan 2.2: 2x2 pixel patches, 12 channels, into a VAE that halves
each side three times), so Wan 2.2's frames need sides that are multiples of 16.
"""

from __future__ import annotations

import math
import pickle
import re
from pathlib import Path

import torch
from torch import Tensor, nn

from videodit.errors import UserError, os_error_message
from videodit.models.vae_base import FrozenVAE, load_strict
from videodit.user_files import NotRegularFile, check_regular_file, read_user_json

# Wan 2.1's latent statistics (``WanVAE.__init__`` in wan/modules/vae.py, diffusers' defaults).
WAN21_LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                      0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
WAN21_LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                     3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)

# Wan 2.2's (``Wan2_2_VAE.__init__`` in wan/modules/vae2_2.py; Wan-AI/Wan2.2-TI2V-5B-Diffusers' vae config).
WAN22_LATENTS_MEAN = (-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
                      -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
                      -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
                      -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
                      -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
                      0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667)
WAN22_LATENTS_STD = (0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
                     0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
                     0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
                     0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
                     0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
                     0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744)

# What differs between the two releases, as videodit meets it.
RELEASES = {
    "wan2.1": dict(name="Wan 2.1", file="Wan2.1_VAE.pth", mean=WAN21_LATENTS_MEAN, std=WAN21_LATENTS_STD),
    "wan2.2": dict(name="Wan 2.2", file="Wan2.2_VAE.pth", mean=WAN22_LATENTS_MEAN, std=WAN22_LATENTS_STD),
}
VAE_KINDS = tuple(RELEASES)

CHECKPOINT_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt")


def _where_to_get(kind: str) -> str:
    return (f"point vae.path to {RELEASES[kind]['file']} or to a diffusers {RELEASES[kind]['name']} VAE folder "
            "(nothing is downloaded)")


def _release(kind: str) -> dict:
    if kind not in RELEASES:
        raise UserError(f"vae.kind={kind!r} is not a Wan VAE; choose one of: {', '.join(VAE_KINDS)}")
    return RELEASES[kind]


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
        self.kind = "wan2.2" if cfg.get("is_residual") else "wan2.1"
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
            raise UserError(f"num_frames={num_frames} does not fit {RELEASES[self.kind]['name']}'s VAE, which "
                            f"needs {r}k+1 frames "
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


def read_checkpoint(file: Path, release: str = "Wan2.1_VAE.pth") -> dict[str, Tensor]:
    """A plain ``{name: tensor}`` dict from safetensors or a weights-only torch file (``release``:
    the file's name as Wan ships it, for the messages)."""
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file
            state = load_file(str(check_regular_file(file)))
        else:
            state = torch.load(check_regular_file(file), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "global" in str(exc).lower():   # weights_only met a class or function: it would run code
            raise UserError(f"{file} holds objects other than tensors, which videodit refuses to unpickle; pass "
                            f"Wan's {release} (a plain state dict) or its tensors as safetensors") from None
        raise UserError(f"{file} cannot be read as weights (not a torch checkpoint); restore it from the original "
                        "checkpoint") from None
    except NotRegularFile as exc:
        raise UserError(os_error_message(exc)) from None
    except Exception as exc:   # corrupt zip, truncated file, bad safetensors header...
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise UserError(f"{file} cannot be read as weights ({first}); restore it from the original checkpoint") \
            from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in state.items()):
        raise UserError(f"{file} is not a plain state dict of tensors (as {release} is); save the VAE's "
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


def _stages(state: dict[str, Tensor], prefix: str, inner: str, where: str) -> list[dict]:
    """Wan 2.2's stages ``{prefix}.N.{inner}.M.*`` (``Down_ResidualBlock`` / ``Up_ResidualBlock``):
    per stage, the slots of its residual blocks and of its resample, and whether that is temporal."""
    pattern = re.compile(re.escape(prefix) + r"\.(\d+)\." + re.escape(inner) + r"\.(\d+)\.(.*)")
    stages: dict[int, dict] = {}
    for name in state:
        if not name.startswith(prefix + "."):
            continue
        match = pattern.match(name)
        if not match:   # a tensor of the stage itself: the shortcuts (AvgDown3D / DupUp3D) have none
            raise UserError(f"{where}: tensor {name} is not part of Wan 2.2's VAE (its stages hold only "
                            f"{inner}.N.*); is this Wan 2.2's VAE (Wan2.2_VAE.pth)?")
        stage, slot, tail = int(match.group(1)), int(match.group(2)), match.group(3)
        entry = stages.setdefault(stage, {"res": set(), "resample": set(), "temporal": False})
        if tail.startswith(("residual.", "shortcut.")):
            entry["res"].add(slot)
        else:
            entry["resample"].add(slot)
            entry["temporal"] |= tail.startswith("time_conv.")
    if not stages:
        raise UserError(f"{where}: tensors {prefix}.N.{inner}.M.* are missing; is this Wan 2.2's VAE (Wan2.2_VAE.pth)?")
    if sorted(stages) != list(range(len(stages))):
        raise UserError(f"{where}: the {prefix} stages are numbered {sorted(stages)}; Wan 2.2's VAE numbers them "
                        "from 0 without gaps")
    return [stages[i] for i in range(len(stages))]


def wan22_vae_config(state: dict[str, Tensor], where: str) -> dict:
    """``AutoencoderKLWan``'s architecture arguments, read off a Wan 2.2 VAE state dict (``WanVAE_``
    of wan/modules/vae2_2.py): 2x2 pixel patches in (``encoder.conv1`` takes 3 * p * p channels),
    stages of residual blocks with a residual resample shortcut, a decoder with its own width."""
    def need(name: str) -> Tensor:
        if name not in state:
            raise UserError(f"{where}: tensor {name} is missing; is this Wan 2.2's VAE (Wan2.2_VAE.pth)?")
        return state[name]

    base_dim, in_channels = need("encoder.conv1.weight").shape[:2]
    patch = math.isqrt(max(in_channels // 3, 1))
    if in_channels != 3 * patch * patch or patch < 2:
        raise UserError(f"{where}: the encoder takes {in_channels} channels, not 3 x p x p pixel patches (Wan "
                        "2.2's VAE takes 12: 2x2 patches); is this Wan 2.2's VAE?")
    out_channels = need("decoder.head.2.weight").shape[0]
    if out_channels != in_channels:
        raise UserError(f"{where}: the decoder gives {out_channels} channels, the encoder takes {in_channels}; "
                        "Wan 2.2's VAE decodes the same 2x2 pixel patches it encodes")
    z_dim = need("conv2.weight").shape[0]
    encoder = _stages(state, "encoder.downsamples", "downsamples", where)
    decoder = _stages(state, "decoder.upsamples", "upsamples", where)
    last = len(encoder) - 1
    blocks = {len(stage["res"]) for stage in encoder}
    if len(blocks) != 1 or 0 in blocks or any(stage["res"] != set(range(len(stage["res"]))) for stage in encoder):
        raise UserError(f"{where}: the encoder's stages hold {[len(s['res']) for s in encoder]} residual blocks; "
                        "Wan 2.2's VAE has the same number in each")
    num_res_blocks = blocks.pop()
    for part, stages, count in (("encoder", encoder, num_res_blocks), ("decoder", decoder, num_res_blocks + 1)):
        for i, stage in enumerate(stages):
            want = {count} if i < last else set()
            if stage["res"] != set(range(count)) or stage["resample"] != want:
                raise UserError(f"{where}: {part} stage {i} holds residual blocks {sorted(stage['res'])} and a "
                                f"resample at {sorted(stage['resample'])}; Wan 2.2's VAE has {count} residual "
                                f"blocks per {part} stage, then a resample (none in the last stage)")
    if len(decoder) != len(encoder):
        raise UserError(f"{where}: the encoder has {len(encoder)} stages, the decoder {len(decoder)}; "
                        "Wan 2.2's VAE mirrors them")
    temporal = [stage["temporal"] for stage in encoder[:last]]
    if [stage["temporal"] for stage in decoder[:last]] != temporal[::-1]:
        raise UserError(f"{where}: the decoder's temporal upsampling {[s['temporal'] for s in decoder[:last]]} "
                        f"is not the encoder's temporal downsampling {temporal} reversed, which diffusers' "
                        "AutoencoderKLWan requires")
    dims = [need(f"encoder.downsamples.{i}.downsamples.0.residual.2.weight").shape[0] for i in range(len(encoder))]
    if any(d % base_dim for d in dims):
        raise UserError(f"{where}: stage widths {dims} are not multiples of the base width {base_dim}")
    dim_mult = [d // base_dim for d in dims]
    widths = [need(f"decoder.upsamples.{i}.upsamples.0.residual.2.weight").shape[0] for i in range(len(decoder))]
    decoder_dim = widths[-1] // dim_mult[0]
    wanted = [decoder_dim * m for m in dim_mult[::-1]]
    if widths != wanted or need("decoder.conv1.weight").shape[0] != decoder_dim * dim_mult[-1]:
        raise UserError(f"{where}: decoder stage widths {widths} are not the encoder's multipliers {dim_mult} "
                        f"reversed times one base width; Wan 2.2's decoder is built that way")
    return {"base_dim": base_dim, "decoder_base_dim": decoder_dim, "z_dim": z_dim, "dim_mult": dim_mult,
            "num_res_blocks": num_res_blocks, "attn_scales": [], "temperal_downsample": temporal, "dropout": 0.0,
            "is_residual": True, "in_channels": in_channels, "out_channels": out_channels, "patch_size": patch,
            "scale_factor_temporal": 2 ** sum(temporal), "scale_factor_spatial": 2 ** last * patch}


def checkpoint_kind(state: dict[str, Tensor]) -> str | None:
    """``wan2.2`` when the encoder's stages are blocks of their own (``encoder.downsamples.N.downsamples.M.*``,
    Wan 2.2), ``wan2.1`` when they are one flat list (``encoder.downsamples.N.residual.*``), else None."""
    nested = any(re.match(r"encoder\.downsamples\.\d+\.downsamples\.\d+\.", name) for name in state)
    flat = any(re.match(r"encoder\.downsamples\.\d+\.(residual|shortcut|resample|time_conv)\.", name) for name in state)
    return "wan2.2" if nested and not flat else "wan2.1" if flat and not nested else None


def to_diffusers_name(name: str, num_res_blocks: int) -> str:
    """Wan's name of one VAE tensor -> ``AutoencoderKLWan``'s (unknown names come back unchanged).
    Wan 2.1's and Wan 2.2's names both: Wan 2.2's stages are blocks of their own
    (``encoder.downsamples.N.downsamples.M`` -> ``encoder.down_blocks.N.resnets.M`` or
    ``.downsampler``; ``decoder.upsamples.N.upsamples.M`` -> ``decoder.up_blocks.N.resnets.M`` or
    ``.upsampler``); ``num_res_blocks`` is needed for Wan 2.1's flat decoder list only."""
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
    nested = re.match(re.escape(block) + r"\.(\d+)\.(.*)", tail) if block != "middle" else None
    if nested:   # Wan 2.2: stage `index` is one block: residual blocks, then its resample
        slot, tail = int(nested.group(1)), nested.group(2)
        outer, sampler = ("down_blocks", "downsampler") if block == "downsamples" else ("up_blocks", "upsampler")
        if tail.startswith(("resample.", "time_conv.")):
            return f"{part}.{outer}.{index}.{sampler}.{tail}"
        return f"{part}.{outer}.{index}.resnets.{slot}.{_RESIDUAL.get(tail, tail)}"
    tail = _RESIDUAL.get(tail, tail)   # resample.* / time_conv.* / attention names are shared
    if block == "middle":
        return f"{part}.mid_block.{_MIDDLE.get(str(index), str(index))}.{tail}"
    if block == "downsamples":   # diffusers keeps Wan 2.1's encoder's flat list of blocks
        return f"{part}.down_blocks.{index}.{tail}"
    # Wan 2.1's decoder: each stage is num_res_blocks + 1 residual blocks, then one upsampler.
    stage, slot = divmod(index, num_res_blocks + 2)
    inner = f"resnets.{slot}" if slot <= num_res_blocks else "upsamplers.0"
    return f"{part}.up_blocks.{stage}.{inner}.{tail}"


def load_wan_checkpoint(file: Path, dtype: torch.dtype = torch.float32, latents_mean=None,
                        latents_std=None, kind: str = "wan2.1") -> nn.Module:
    """An ``AutoencoderKLWan`` from Wan's original checkpoint of release ``kind`` (``wan2.1`` or
    ``wan2.2``); its config carries the latent statistics, so ``save_pretrained`` writes a
    complete diffusers folder."""
    from diffusers import AutoencoderKLWan

    release = _release(kind)
    name = release["name"]
    where = f"vae.path='{file}'"
    state = read_checkpoint(file, release["file"])
    if any(key.startswith(("encoder.conv_in.", "quant_conv.")) for key in state):
        raise UserError(f"{where} holds diffusers' tensor names, not Wan's: point vae.path to the diffusers folder "
                        "(with its config.json) instead")
    found = checkpoint_kind(state)
    if found is not None and found != kind:
        raise UserError(f"{where} holds {RELEASES[found]['name']}'s VAE ({RELEASES[found]['file']}), not {name}'s; "
                        f"set vae.kind={found}")
    config = wan_vae_config(state, where) if kind == "wan2.1" else wan22_vae_config(state, where)
    if latents_mean is None and latents_std is None and config["z_dim"] != len(release["mean"]):
        raise UserError(f"{where} has {config['z_dim']} latent channels, but {name}'s latent statistics have "
                        f"{len(release['mean'])}; pass latents_mean and latents_std")
    config["latents_mean"] = list(release["mean"] if latents_mean is None else latents_mean)
    config["latents_std"] = list(release["std"] if latents_std is None else latents_std)
    with torch.device("meta"):
        model = AutoencoderKLWan(**config)
    # Cast before loading: assign=True keeps the given tensors (ModelMixin.to(dtype) would warn).
    renamed = {to_diffusers_name(k, config["num_res_blocks"]): v.to(dtype) for k, v in state.items()}
    load_strict(model, renamed, where=f"{where} (diffusers' names)", stranger=f"is not part of {name}'s VAE",
                fix=f"is this {name}'s VAE ({release['file']})?")
    return model


# --------------------------------------------------------------------------- diffusers folders


def _load_diffusers(folder: Path, path: str, subfolder: str | None, where: str, dtype: torch.dtype,
                    kind: str = "wan2.1") -> tuple[nn.Module, dict]:
    """The folder's ``AutoencoderKLWan`` and its config.json as written."""
    name = RELEASES[kind]["name"]
    try:
        config = read_user_json(folder / "config.json")
    except (OSError, ValueError) as exc:
        raise UserError(f"{where}: cannot read config.json ({exc}); fix or replace it") from None
    class_name = config.get("_class_name") if isinstance(config, dict) else None
    if class_name != "AutoencoderKLWan":
        raise UserError(f"{where} holds _class_name={class_name!r}, not AutoencoderKLWan ({name}'s VAE); "
                        f"{_where_to_get(kind)}")
    wan22 = bool(config.get("is_residual")) and bool(config.get("patch_size"))
    if kind == "wan2.1" and (config.get("is_residual") or config.get("patch_size")):
        raise UserError(f"{where} holds Wan 2.2's VAE (is_residual / patch_size), not Wan 2.1's; set vae.kind=wan2.2")
    if kind == "wan2.2" and not wan22:
        other = "Wan 2.1's VAE" if not (config.get("is_residual") or config.get("patch_size")) else \
            "an AutoencoderKLWan without both is_residual and patch_size"
        fix = "set vae.kind=wan2.1" if other.startswith("Wan 2.1") else _where_to_get(kind)
        raise UserError(f"{where} holds {other}, not Wan 2.2's (is_residual: true, patch_size: 2); {fix}")
    from diffusers import AutoencoderKLWan
    try:
        model = AutoencoderKLWan.from_pretrained(str(Path(path).expanduser()), subfolder=subfolder,
                                                 local_files_only=True, torch_dtype=dtype)
    except (OSError, ValueError, RuntimeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise UserError(f"cannot load the {name} VAE from {where}: {first}") from None
    return model, config


def _hint(folder: Path, kind: str = "wan2.1") -> str:
    """What to set instead when ``folder`` is a pipeline or Wan checkpoint folder (else the usual advice)."""
    if (folder / "vae" / "config.json").is_file():
        return "it has a vae/ folder: set vae.subfolder=vae"
    originals = sorted(p.name for p in folder.glob("*") if p.suffix in CHECKPOINT_SUFFIXES and "vae" in p.name.lower())
    originals.sort(key=lambda n: n != RELEASES[kind]["file"])   # the release's own file first
    return f"it holds {originals[0]}: point vae.path to that file" if originals else _where_to_get(kind)


def build_wan_vae(path: str | None, subfolder: str | None = None, scaling_factor: float | None = None,
                  micro_batch: int = 16, dtype: torch.dtype = torch.float32, latents_mean=None,
                  latents_std=None, kind: str = "wan2.1") -> WanVAE:
    """The frozen Wan VAE adapter of release ``kind`` (``wan2.1`` or ``wan2.2``) from ``path``
    (joined with ``subfolder``): a diffusers ``AutoencoderKLWan`` folder, or Wan's
    ``Wan2.1_VAE.pth`` / ``Wan2.2_VAE.pth`` / a ``.safetensors`` of its tensors.

    ``dtype``: the weights' and compute dtype (latents come out fp32). ``latents_mean`` /
    ``latents_std`` replace the statistics (default: the folder's config, or the release's tables
    for a checkpoint file or a config without them). ``scaling_factor`` exists to mirror
    ``build_vae`` and must stay None: Wan's latents are normalised by the per-channel statistics alone.
    """
    release = _release(kind)
    if scaling_factor is not None:
        raise UserError(f"vae.scaling_factor does not apply to vae.kind={kind} (its latents are normalised by "
                        "Wan's per-channel mean and std); remove it")
    if path is None or not str(path).strip():
        raise UserError(f"vae.path is required for vae.kind={kind}: {_where_to_get(kind)}")
    target = Path(path).expanduser() / (subfolder or "")
    where = f"vae.path='{path}'" + (f" (vae.subfolder='{subfolder}')" if subfolder else "")
    config: dict = {}
    if target.is_file():
        if target.suffix not in CHECKPOINT_SUFFIXES + (".safetensors",):
            raise UserError(f"{where} is a {target.suffix or 'suffix-less'} file, not a checkpoint "
                            f"({', '.join(CHECKPOINT_SUFFIXES)}, .safetensors); {_where_to_get(kind)}")
        model = load_wan_checkpoint(target, dtype, latents_mean, latents_std, kind=kind)
    elif not target.is_dir():
        raise UserError(f"{where} is neither a file nor an existing folder: {_where_to_get(kind)}")
    elif not (target / "config.json").is_file():
        raise UserError(f"{where} has no config.json; {_hint(target, kind)}")
    else:
        model, config = _load_diffusers(target, path, subfolder, where, dtype, kind)
    # A folder's config.json without the tables: diffusers fills in Wan 2.1's, so use the release's.
    written = not config or ("latents_mean" in config and "latents_std" in config)
    mean = latents_mean if latents_mean is not None else model.config.latents_mean if written else release["mean"]
    std = latents_std if latents_std is not None else model.config.latents_std if written else release["std"]
    return WanVAE(model, mean, std, micro_batch=micro_batch)


__all__ = ["VAE_KINDS", "WAN21_LATENTS_MEAN", "WAN21_LATENTS_STD", "WAN22_LATENTS_MEAN", "WAN22_LATENTS_STD",
           "WanVAE", "build_wan_vae", "checkpoint_kind", "load_wan_checkpoint", "read_checkpoint",
           "to_diffusers_name", "wan22_vae_config", "wan_vae_config"]
