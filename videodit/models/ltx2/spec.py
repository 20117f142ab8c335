"""Lightricks' LTX-2 behind the model-family seam (``models/spec.py``): the video stream first.

What differs from Wan and the MMDiT, as the rest of the system sees it: a block holds two streams
(video 4096 wide, audio 2048) that meet in cross-modal attentions, so ``model.blocks`` are called
``block(vx, ax, video_inputs, audio_inputs)``; the time modulates every token (image-to-video's
given frames run at time 0 through ``x_mask``, as Wan TI2V's); RoPE is per head, in seconds and
pixels; patch 1 on the 128-channel latents of an 8 x 32 x 32 VAE.

This family trains the video stream: the model inputs carry no audio, the audio stream's weights
are loaded, left untouched and exported bit for bit. Not yet here (each a one-line refusal or
the base class's NotImplementedError): tensor and sequence parallelism, pipeline stages, the
planner's activation profile, LTX-2's own VAE and text encoder (``vae.kind``/``text.kind``).
"""

from __future__ import annotations

import dataclasses
import json

import torch
from torch import nn

from videodit.errors import UserError
from videodit.models.flop_count import FlopCount
from videodit.models.ltx2 import flops, layouts
from videodit.models.ltx2.geometry import DEFAULT_FPS, LTX2_0, LTX2_3, LTX2Geometry
from videodit.models.ltx2.model import LTX2Model
from videodit.models.ltx2.release_config import release_config
from videodit.models.spec import ActivationDims, Conditions, ModelSpec

MODEL_TYPE = "videodit-ltx2"
CAPTION_TOKENS = 1024    # Gemma's prompt, padded to 1024 tokens; the connectors' registers fill the pads
TINY = dataclasses.replace(LTX2_3, num_layers=2, num_heads=2, head_dim=16, audio_head_dim=8, audio_in_channels=8)
# model.preset -> the release it is (the schema's MODEL_PRESETS hold its depth, width and heads)
PRESETS = {"ltx2-19b": LTX2_0, "ltx2.3-22b": LTX2_3, "ltx2-tiny": TINY}
# The attention kinds of a block, by stream: LoRA's default adapts the video stream's (LTX's trainer
# adapts to_q/to_k/to_v/to_out.0 of every kind; the audio ones join when audio trains).
ATTENTIONS = {"video": ("attn1", "attn2"), "audio": ("audio_attn1", "audio_attn2"),
              "cross_modal": ("audio_to_video_attn", "video_to_audio_attn")}
PROJECTIONS = ("to_q", "to_k", "to_v", "to_out.0")


def lora_targets(*streams: str) -> list[str]:
    return [f"{attention}.{projection}" for stream in streams for attention in ATTENTIONS[stream]
            for projection in PROJECTIONS]


class LTX2Spec(ModelSpec):
    family = "ltx2"
    model_type = MODEL_TYPE
    geometry_type = LTX2Geometry
    sequence_parallel = "full_attention"
    sequence_args: dict = {}
    released_encoders = (128, 3840, CAPTION_TOKENS)   # LTX-2.0: the video VAE, the connectors' 3840-wide text

    released_name = "LTX-2 (the ltx-2-19b / ltx-2.3-22b release file or a diffusers transformer folder)"
    released_format = "ltx2"
    released_short = "LTX-2"
    released_fix = "use model.preset=ltx2-19b (LTX-2.0) or ltx2.3-22b (LTX-2.3)"
    export_formats = ("ltx2", "diffusers")

    # ------------------------------------------------------------------ build

    def geometry(self, m, latent_channels: int, caption_channels: int, caption_length: int) -> LTX2Geometry:
        """The release of ``model.preset`` at ``model.depth`` / ``hidden_size`` / ``num_heads``; the
        audio stream keeps the release's head size. LTX-2.0 projects text of any width; LTX-2.3
        takes the connectors' output, as wide as the stream."""
        base = PRESETS.get(m.preset)
        if base is None:
            raise UserError(f"model.preset={m.preset} is not an LTX-2 preset; choose one of {', '.join(PRESETS)}")
        if m.mlp_ratio not in (None, 4.0) or list(m.patch_size or [1, 1, 1]) != [1, 1, 1]:
            raise UserError("LTX-2's FFN is 4x wide and its patch 1 x 1 x 1: leave model.mlp_ratio and "
                            "model.patch_size unset")
        if m.hidden_size % m.num_heads:
            raise UserError(f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads}")
        geometry = dataclasses.replace(base, num_layers=m.depth, num_heads=m.num_heads,
                                       head_dim=m.hidden_size // m.num_heads, in_channels=latent_channels,
                                       caption_channels=None if base.caption_channels is None else caption_channels)
        if geometry.caption_channels is None and caption_channels != geometry.dim:
            raise UserError(f"LTX-2.3 takes text embeddings as wide as the video stream ({geometry.dim}); the text "
                            f"encoder gives {caption_channels}: use LTX-2.3's connectors or a {geometry.dim}-wide "
                            "encoder")
        return geometry

    def released_encoders_of(self, m) -> tuple[int, int, int]:
        """LTX-2.3's connectors give the DiT 4096-wide text (LTX-2.0's, 3840 wide, are projected inside)."""
        base = PRESETS.get(m.preset, LTX2_0)
        return (128, base.caption_channels or base.dim, CAPTION_TOKENS)

    def build(self, geometry: LTX2Geometry) -> LTX2Model:
        return LTX2Model(geometry)

    def geometry_config(self, geometry: LTX2Geometry) -> dict:
        return {"model_type": MODEL_TYPE, **dataclasses.asdict(geometry), "max_pos": list(geometry.max_pos)}

    def geometry_from_config(self, config: dict) -> LTX2Geometry:
        fields = {f.name for f in dataclasses.fields(LTX2Geometry)}
        try:
            return LTX2Geometry(**{k: v for k, v in config.items() if k in fields})
        except TypeError as exc:
            raise UserError(f"config.json is not a videodit LTX-2 config ({exc}); write it with videodit ckpt "
                            "export") from None

    def latent_channels(self, tensors) -> int:
        return tensors["patchify_proj.weight"].shape[1]

    def caption_channels(self, tensors) -> int:
        if "caption_projection.linear_1.weight" in tensors:
            return tensors["caption_projection.linear_1.weight"].shape[1]
        return tensors["transformer_blocks.0.attn2.to_k.weight"].shape[1]

    # ------------------------------------------------------------------ released weights

    def released_layout(self, path) -> bool:
        return layouts.is_ltx2_layout(path)

    def read_released(self, path, ema: bool = False):
        """Lazy and strict: the release file's DiT (its text side and decoders left unread) or a
        diffusers folder."""
        if ema:
            raise UserError(f"{path} is a released LTX-2 model, which has no EMA weights; leave out --ema")
        return layouts.read_ltx2(path)

    def released_files(self, path):
        if path.is_file():
            return [path]
        folder = path / "transformer" if (path / "transformer").is_dir() else path
        return sorted(folder.glob("*.safetensors"))

    def load_released(self, path, ema: bool = False) -> LTX2Model:
        self.read_released(path, ema)   # the --ema refusal
        return layouts.load_ltx2(path)

    def export_released(self, fmt: str, geometry: LTX2Geometry, tensors):
        """``ltx2``: one file of the DiT under ``model.diffusion_model.`` (the release's names; ltx-core
        and ComfyUI load it), whose configuration belongs in the safetensors metadata
        (:meth:`export_metadata`; ``ltx2_config.json`` beside it says the same). ``diffusers``: an
        ``LTX2VideoTransformer3DModel`` folder."""
        if fmt == "diffusers":
            from videodit.models.ltx2.release_config import diffusers_config
            return (layouts.diffusers_tensors(tensors), {"config.json": json.dumps(diffusers_config(geometry), indent=2)
                                                         + "\n"}, layouts.WEIGHTS_NAME)
        if fmt != "ltx2":
            raise UserError(f"--format {fmt} does not apply to an LTX-2 model; it exports as: "
                            f"{', '.join(('videodit',) + self.export_formats)}")
        return (layouts.release_tensors(tensors),
                {"ltx2_config.json": json.dumps(release_config(geometry), indent=2) + "\n"}, "{folder}.safetensors")

    def export_metadata(self, fmt: str, geometry: LTX2Geometry) -> dict[str, str]:
        """The safetensors metadata of an exported weights file: the release's config for ``ltx2``."""
        return layouts.release_metadata(geometry) if fmt == "ltx2" else {"format": "pt"}

    def lora_module_name(self, fmt: str, module: str) -> str:
        return layouts.diffusers_name(module) if fmt == "diffusers" else module

    # ------------------------------------------------------------------ geometry, objective

    def patch_size(self, geometry) -> tuple[int, int, int]:
        return (1, 1, 1)

    def model_inputs(self, x_t, t, cond: Conditions) -> tuple:
        """(x_t, t, text, fps, x_mask), all tensors: a dropped caption is all-zero text; fps
        defaults to ltx-trainer's 24; no frame mask is every frame generated. The releases attend
        every text token (the connectors' registers fill the pads), so no text mask."""
        n, frames = x_t.shape[0], x_t.shape[2]
        y = cond.y if cond.drop is None else torch.where(cond.drop[:, None, None], torch.zeros_like(cond.y), cond.y)
        fps = torch.full((n,), DEFAULT_FPS, device=x_t.device) if cond.fps is None else \
            torch.as_tensor(cond.fps, device=x_t.device).float().expand(n)
        x_mask = torch.ones(n, frames, dtype=torch.bool, device=x_t.device) if cond.x_mask is None else cond.x_mask
        return (x_t, t, y, fps, x_mask)

    def frame_mask_index(self) -> int:
        return 4

    def unconditional(self, cond: Conditions, negative=None) -> Conditions:
        if negative is None:
            return dataclasses.replace(cond, drop=torch.ones(cond.y.shape[0], dtype=torch.bool, device=cond.y.device))
        y, y_mask = negative
        n = cond.y.shape[0]
        return dataclasses.replace(cond, y=y.expand(n, *y.shape[1:]),
                                   y_mask=None if y_mask is None else y_mask.expand(n, -1),
                                   drop=torch.zeros(n, dtype=torch.bool, device=cond.y.device))

    # ------------------------------------------------------------------ blocks, parallelism

    def dynamic_dims(self, args):
        """block(vx [B, T, d], ax [B, Ta, a] or None, video inputs, audio inputs): batch and tokens."""
        vx, ax, *_ = args
        return [(vx, [0, 1]), *(((ax, [0, 1]),) if ax is not None else ())]

    def check_sequence_parallel(self, num_heads: int, *, tp: int, sp: int, ring: int) -> None:
        if sp > 1 or tp > 1:
            raise UserError("LTX-2 has no sequence or tensor parallelism in videodit yet; set parallel.sp=1 and "
                            "parallel.tp=1 (FSDP shards it)")

    # ------------------------------------------------------------------ FLOPs, memory

    def forward_flops(self, geometry, frames: int, positions: int, caption_tokens: int) -> FlopCount:
        return flops.grid_flops(geometry, frames * positions, caption_tokens)

    def activation_dims(self, geometry: LTX2Geometry) -> ActivationDims:
        return ActivationDims(geometry.dim, geometry.num_heads, geometry.mlp_hidden,
                              geometry.caption_channels or geometry.dim)

    def parameter_scope(self) -> str:
        """What ``count_parameters`` of a preset counts (``model info``)."""
        return "the transformer (both streams, LTX-2.0's caption projections); not the text connectors nor Gemma"
