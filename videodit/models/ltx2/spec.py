"""Lightricks' LTX-2 behind the model-family seam (``models/spec.py``): the video stream first.

What differs from Wan and the MMDiT, as the rest of the system sees it: a block holds two streams
(video 4096 wide, audio 2048) that meet in cross-modal attentions, so ``model.blocks`` are called
``block(vx, ax, video_inputs, audio_inputs)``; the time modulates every token (image-to-video's
given frames run at time 0 through ``x_mask``, as Wan TI2V's); RoPE is per head, in seconds and
pixels; patch 1 on the 128-channel latents of an 8 x 32 x 32 VAE.

This family trains the video stream: the model inputs carry no audio, the audio stream's weights
are loaded, left untouched and exported bit for bit. With ``model.train_audio`` both streams train
(every weight): the inputs carry the audio stream's (``Conditions.audio``), its tokens from the audio
VAE ``audio.kind=ltx2`` (``audio_vae.py``). Its own encoders: ``vae.kind=ltx2`` (``vae.py``)
and ``text.kind=gemma3-ltx2`` (``text.py`` + ``connectors.py``); its objective and sampler:
``diffusion/ltx2_objective.py``. Tensor, sequence and pipeline parallelism: ``parallel_plan.py`` and
``stage.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json

import torch
from torch import nn

from videodit.errors import UserError
from videodit.models.flop_count import FlopCount
from videodit.models.ltx2 import flops, layouts, parallel_plan
from videodit.models.ltx2.geometry import DEFAULT_FPS, LTX2_0, LTX2_3, LTX2Geometry
from videodit.models.ltx2.model import LTX2Model
from videodit.models.ltx2.release_config import release_config
from videodit.models.spec import ActivationDims, Conditions, ModelSpec

MODEL_TYPE = "videodit-ltx2"
CAPTION_TOKENS = 1024    # Gemma's prompt, padded to 1024 tokens; the connectors' registers fill the pads
TINY = dataclasses.replace(LTX2_3, num_layers=2, num_heads=2, head_dim=16, audio_head_dim=8, audio_in_channels=8)
# model.preset -> the release it is (config/model_presets.py's MODEL_PRESETS hold its depth, width and heads)
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
    sequence_parallel = parallel_plan.SEQUENCE_PARALLEL
    sequence_args = parallel_plan.SEQUENCE_ARGS            # the video tokens sharded; text and audio whole
    whole_query_kinds = parallel_plan.WHOLE_QUERY_KINDS    # video -> audio: whole audio queries, a ring of video keys
    block_streams = parallel_plan.BLOCK_STREAMS            # (vx, ax): memory.offload moves both
    released_encoders = (128, 3840, CAPTION_TOKENS)   # LTX-2.0: the video VAE, the connectors' 3840-wide text
    vae_kinds = ("ltx2",)
    text_kinds = ("gemma3-ltx2",)
    audio_kinds = ("ltx2",)

    released_name = "LTX-2 (the ltx-2-19b / ltx-2.3-22b release file or a diffusers transformer folder)"
    released_format = "ltx2"
    released_short = "LTX-2"
    released_fix = "use model.preset=ltx2-19b (LTX-2.0) or ltx2.3-22b (LTX-2.3)"
    # ``ltx2``: the release's single-file layout (the DiT alone; ltx-core's builder loads it);
    # ``comfyui``: the same file alone, for ComfyUI's Load Diffusion Model; ``diffusers``: a transformer folder.
    export_formats = ("ltx2", "comfyui", "diffusers")
    lora_formats = ("diffusers", "comfyui", "peft")
    # LTX's own LoRA files (ltx-trainer writes them, ltx-core, ComfyUI and diffusers' LTX2 loader read
    # them): peft keys ``diffusion_model.<module>.lora_A/B.weight``, no alpha (checkpoint/lora_formats.py).
    comfyui_lora_keys = "lora_A"

    # ------------------------------------------------------------------ encoders

    def build_vae(self, kind, path, subfolder, *, scaling_factor, micro_batch, temporal_micro_batch, dtype):
        from videodit.models.ltx2.vae import build_ltx2_vae   # diffusers, only when asked
        return build_ltx2_vae(path, subfolder, scaling_factor=scaling_factor, micro_batch=micro_batch, dtype=dtype)

    def build_text_encoder(self, kind, path, max_length, dtype, mask=True, audio=False):
        """Gemma 3 -> the release's normalisation, projection and connectors: the DiT's 1024 text
        tokens (registers in the padding, no mask); ``audio``: the audio stream's too (``encode_streams``)."""
        from videodit.models.ltx2.text import load_ltx2_text   # transformers, only when asked
        return load_ltx2_text(path, max_length=max_length, dtype=dtype, audio=audio)

    def build_audio(self, kind, path, subfolder, *, dtype, vocoder: bool = False):
        """LTX-2's frozen audio VAE; ``vocoder``: with its vocoder (sampling; training encodes only)."""
        from videodit.models.ltx2.audio_vae import build_ltx2_audio   # diffusers, only when asked
        return build_ltx2_audio(path, subfolder, dtype=dtype, vocoder=vocoder, key="audio.path")

    def audio_channels(self, geometry: LTX2Geometry) -> int:
        return geometry.audio_in_channels

    def audio_text_width(self, m) -> int | None:
        """LTX-2.3 takes the audio connector's output, as wide as the audio stream (heads x the
        release's audio head size); LTX-2.0 projects text of any width."""
        base = PRESETS.get(m.preset, LTX2_0)
        return None if base.caption_channels is not None else m.num_heads * base.audio_head_dim

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
                                       audio_in_channels=getattr(m, "audio_channels", None) or base.audio_in_channels,
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

    def configure(self, model: LTX2Model, m) -> LTX2Model:
        """The video stream trains: the audio stream and the cross-modal attentions, which a video-only
        step never reaches, are frozen (no gradients, no optimizer state; kept and exported as loaded).
        With ``model.train_audio`` every weight trains, as ltx-trainer's audio-video fine-tune."""
        if getattr(m, "train_audio", False):
            return model
        for name, param in model.named_parameters():
            if "audio" in name or "a2v" in name or name.startswith("av_ca_"):
                param.requires_grad_(False)
        return model

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

    def released_config(self, geometry, experts: bool = False) -> str | None:
        """The recipe ``ckpt import`` records with LTX-2.3 weights (its VAE, Gemma, sampling); LTX-2.0
        has none yet (pass --config)."""
        return "ltx2.3-22b-lora" if geometry is None or geometry.version == "2.3" else None

    def released_files(self, path):
        if path.is_file():
            return [path]
        folder = path / "transformer" if (path / "transformer").is_dir() else path
        return sorted(folder.glob("*.safetensors"))

    def load_released(self, path, ema: bool = False) -> LTX2Model:
        self.read_released(path, ema)   # the --ema refusal
        return layouts.load_ltx2(path)

    def export_released(self, fmt: str, geometry: LTX2Geometry, tensors):
        """``ltx2``: one file of the DiT under ``model.diffusion_model.`` (the release's names), whose
        configuration travels in the safetensors metadata (:meth:`export_metadata`; ``ltx2_config.json``
        beside it says the same): what ltx-core's model builder loads strictly. ``comfyui``: that file
        alone, named after its folder: ComfyUI's Load Diffusion Model strips the prefix, detects LTX-2
        by ``adaln_single`` / ``audio_adaln_single`` and reads the sizes from the metadata config (the
        text side, connectors included, stays with the release file that ComfyUI's text encoder
        loader reads). ``diffusers``: an ``LTX2VideoTransformer3DModel`` folder."""
        if fmt == "diffusers":
            from videodit.models.ltx2.release_config import diffusers_config
            return (layouts.diffusers_tensors(tensors), {"config.json": json.dumps(diffusers_config(geometry), indent=2)
                                                         + "\n"}, layouts.WEIGHTS_NAME)
        if fmt not in self.export_formats:
            raise UserError(f"--format {fmt} does not apply to an LTX-2 model; it exports as: "
                            f"{', '.join(('videodit',) + self.export_formats)}")
        config = {"ltx2_config.json": json.dumps(release_config(geometry), indent=2) + "\n"} if fmt == "ltx2" else {}
        return layouts.release_tensors(tensors), config, "{folder}.safetensors"

    def export_metadata(self, fmt: str, geometry: LTX2Geometry) -> dict[str, str]:
        """The safetensors metadata of an exported weights file: the release's config for the
        single-file formats (``ltx2``, ``comfyui``), where their loaders read the model's sizes."""
        return layouts.release_metadata(geometry) if fmt in ("ltx2", "comfyui") else {"format": "pt"}

    def lora_module_name(self, fmt: str, module: str) -> str:
        """diffusers' names for its LTX2VideoTransformer3DModel; the release's (videodit's own) for
        LTX's loaders, ComfyUI and peft."""
        return layouts.diffusers_name(module) if fmt == "diffusers" else module

    # ------------------------------------------------------------------ geometry, objective

    def patch_size(self, geometry) -> tuple[int, int, int]:
        return (1, 1, 1)

    def model_inputs(self, x_t, t, cond: Conditions) -> tuple:
        """(x_t, t, text, fps, x_mask), all tensors: a dropped caption is all-zero text; fps
        defaults to ltx-trainer's 24; no frame mask is every frame generated. The releases attend
        every text token (the connectors' registers fill the pads), so no text mask. With
        ``cond.audio``: then (None, audio tokens, audio sigma, audio text), the model's audio inputs."""
        n, frames = x_t.shape[0], x_t.shape[2]

        def dropped(text):
            return text if cond.drop is None else torch.where(cond.drop[:, None, None], torch.zeros_like(text), text)
        fps = torch.full((n,), DEFAULT_FPS, device=x_t.device) if cond.fps is None else \
            torch.as_tensor(cond.fps, device=x_t.device).float().expand(n)
        x_mask = torch.ones(n, frames, dtype=torch.bool, device=x_t.device) if cond.x_mask is None else cond.x_mask
        if cond.audio is None:
            return (x_t, t, dropped(cond.y), fps, x_mask)
        audio = cond.audio
        return (x_t, t, dropped(cond.y), fps, x_mask, None, audio.x_t, audio.t, dropped(audio.context))

    def frame_mask_index(self) -> int:
        return 4

    # LTX-2's own objective and sampler (diffusion/ltx2_objective.py, named through diffusion/objectives.py):
    # its token-shifted sigma, per-token sigma for a given first frame, masked MSE; its dev schedule, CFG + STG.
    objective = "ltx2"

    @contextlib.contextmanager
    def skip_self_attention(self, model: LTX2Model, block: int | None):
        """STG's perturbed branch: inside, block ``block``'s video self-attention passes its values
        unattended (ltx-core's ``SKIP_VIDEO_SELF_ATTN``); None: nothing skipped."""
        blocks = [] if block is None else [model.blocks[block]]
        for b in blocks:
            b.skip_self_attention = True
        try:
            yield
        finally:
            for b in blocks:
                b.skip_self_attention = False

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
        """block(vx [B, T, d], ax [B, Ta, a] or None, video inputs, audio inputs): batch and tokens
        of each stream, of its per-token modulations and of its RoPE tables [B, H, T, Dh/2]."""
        vx, ax, *inputs = args
        dims = [(vx, [0, 1]), *(((ax, [0, 1]),) if ax is not None else ())]
        for stream in inputs:
            if stream is None:
                continue
            for tensor in (stream.modulation, stream.cross_modulation):
                if tensor is not None:
                    dims.append((tensor, [0, 1] if tensor.shape[1] > 1 else [0]))
            for table in (stream.rope, stream.cross_rope):
                dims += [(part, [0, 2]) for part in table or ()]
            dims.append((stream.context, [0]))
        return dims

    def check_sequence_parallel(self, num_heads: int, *, tp: int, sp: int, ring: int) -> None:
        parallel_plan.check_sequence_parallel(num_heads, tp=tp, sp=sp, ring=ring)

    def tensor_parallel_plan(self):
        return parallel_plan.tensor_parallel_plan()

    def pipeline_stage(self, model, block_ids, *, first: bool, last: bool) -> nn.Module:
        from videodit.models.ltx2.stage import LTX2Stage
        return LTX2Stage(model, block_ids, first=first, last=last)

    def stage_io(self, module, inputs, microbatches: int) -> dict:
        from videodit.models.ltx2.stage import stage_io
        return stage_io(module, inputs, microbatches)

    def stage_latents(self, output, latent_shape, geometry):
        from videodit.models.ltx2.stage import stage_latents
        return stage_latents(output, latent_shape)

    # ------------------------------------------------------------------ FLOPs, memory

    def forward_flops(self, geometry, frames: int, positions: int, caption_tokens: int,
                      audio_tokens: int = 0) -> FlopCount:
        """The video stream's; ``audio_tokens`` > 0: with the audio stream and the cross-modal
        attentions (``model.train_audio``), that many audio tokens a sample (:meth:`audio_tokens`)."""
        return flops.grid_flops(geometry, frames * positions, caption_tokens, audio_tokens)

    def audio_tokens(self, num_frames: int, fps: float, frame_interval: int = 1) -> int:
        """The audio tokens of a training clip of ``num_frames`` frames that the model sees at
        ``fps``, taken every ``frame_interval``-th source frame (the planner's, with
        ``model.train_audio``), as training makes them: the soundtrack under the frames, from the
        first one to the end of the last, ``floor(seconds x 16 kHz)`` samples (``data/audio.py``'s
        window), ``1 + samples // 160`` mel frames (its ``log_mel``), ``ceil(mel / 4)`` latent
        frames (the audio VAE's encoder, ``LTX2AudioVAE.latent_frames``; the toy codec folds 4
        too): 25 a second. Sampling makes ``round(25 x num_frames / fps)`` (``latent_size``).
        ``tests/models/test_ltx2_spec.py`` holds it against the data side's window encoded."""
        from fractions import Fraction

        from videodit.models.ltx2.geometry import AUDIO_DOWNSAMPLE, AUDIO_HOP, AUDIO_SAMPLE_RATE
        source_frames = (num_frames - 1) * frame_interval + 1     # data/dataset.sample_frame_indices' span
        seconds = Fraction(source_frames) / (Fraction(fps) * frame_interval)
        samples = int(seconds * AUDIO_SAMPLE_RATE)                  # floor: both positive
        return -(-(1 + samples // AUDIO_HOP) // AUDIO_DOWNSAMPLE)

    def activation_dims(self, geometry: LTX2Geometry) -> ActivationDims:
        return ActivationDims(geometry.dim, geometry.num_heads, geometry.mlp_hidden,
                              geometry.caption_channels or geometry.dim)

    def activation_profile(self, geometry: LTX2Geometry):
        """Both streams' (``activations.py``): LTX-2.3's gated, query-modulated blocks or LTX-2.0's;
        the audio stream's and cross-modal entries count audio tokens, none in a video-only step."""
        from videodit.models.ltx2.activations import profile
        gated = geometry.gated_attention or geometry.cross_attention_adaln
        return profile(gated, geometry.caption_channels is not None, geometry.audio_dim / geometry.dim,
                       geometry.audio_in_channels)

    def parameter_scope(self) -> str:
        """What ``count_parameters`` of a preset counts (``model info``): ltx-core's transformer alone,
        as its meta-device build counts it (ltx2-19b 18,876,174,592; ltx2.3-22b 18,988,838,144)."""
        return ("the transformer, video and audio streams and their cross-modal attentions (LTX-2.0's caption "
                "projections too); not the text connectors (in the release file: 19.59B for LTX-2.0, 21.01B for 2.3), "
                "Gemma's feature projection (22.16B with it: 2.3's \"22B\") nor Gemma 3")
