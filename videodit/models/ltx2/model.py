"""Lightricks' LTX-2 DiT (``ltx_core.model.transformer.LTXModel``, 2.0 and 2.3), our own code.

Build a tiny one and call it::

    import torch
    from videodit.models.ltx2.geometry import LTX2Geometry
    from videodit.models.ltx2.model import LTX2Model
    g = LTX2Geometry(num_layers=2, num_heads=2, head_dim=16, audio_head_dim=8, in_channels=8,
                     audio_in_channels=8, caption_channels=None, gated_attention=True,
                     cross_attention_adaln=True)
    model = LTX2Model(g)
    v = model(torch.randn(1, 8, 3, 4, 6), torch.rand(1), torch.randn(1, 5, 32))   # -> [1, 8, 3, 4, 6]
    v, a = model(torch.randn(1, 8, 3, 4, 6), torch.rand(1), torch.randn(1, 5, 32),
                 audio=torch.randn(1, 7, 8), audio_context=torch.randn(1, 5, 16))   # both streams

Inputs (``LTX2Spec.model_inputs`` builds them): video latents x [B, C, F, H, W] (patch 1: a token per
latent voxel, in (frame, row, column) order), sigma ``t`` [B] in [0, 1], the text ``context``
[B, L, caption_channels (2.0) or dim (2.3)], then optional: ``fps`` [B] (RoPE's seconds; default
24), ``x_mask`` [B, F] (True: generated; False: a given frame, clean at time 0, as image-to-video
trains), ``context_mask`` [B, L] (1: attended; the releases attend every token), and the audio
stream: its tokens ``audio`` [B, Ta, audio_in_channels] (ltx-core's patchified (channel, mel bin)
layout), ``audio_t`` [B] (default t) and ``audio_context`` / ``audio_context_mask``.

Without audio the model is the video stream alone (ltx-core's AV model called with audio=None: no
cross-modal attention, the audio weights unused) and returns the video velocity; with audio it
returns (video, audio) velocities.

The time modulates every token (``adaln_single`` on sigma * 1000, per token where ``x_mask`` gives
frames time 0); the cross-modal attentions' gates read the other stream's sigma. Parameter names
are the release's (``model.diffusion_model.`` stripped): ``state_dict()`` is that layout.

Every block has one call, ``block(vx, ax, video_inputs, audio_inputs) -> (vx, ax)`` (``ax`` None
for video alone), so FSDP, checkpointing and compile see ``model.blocks`` as one uniform list.
Attention goes through each :class:`Attention`'s ``backend``. Pure: no torch.distributed.
Precision: ltx-core's ops in the weights' (or autocast's) dtype; RoPE tables in fp32 until applied.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from videodit.errors import UserError
from videodit.models.ltx2.block import LTX2Block, StreamInputs
from videodit.models.ltx2.embeddings import AdaLNSingle, CaptionProjection
from videodit.models.ltx2.geometry import DEFAULT_FPS, LTX2Geometry
from videodit.models.ltx2.rope import audio_positions, rope_table, video_positions


class LTX2Model(nn.Module):
    def __init__(self, geometry: LTX2Geometry):
        super().__init__()
        g = self.geometry = geometry
        d, a, k = g.dim, g.audio_dim, g.modulation_rows
        self.patchify_proj = nn.Linear(g.in_channels, d)
        self.adaln_single = AdaLNSingle(d, k)
        self.audio_patchify_proj = nn.Linear(g.audio_in_channels, a)
        self.audio_adaln_single = AdaLNSingle(a, k)
        if g.caption_channels is not None:
            self.caption_projection = CaptionProjection(g.caption_channels, d)
            self.audio_caption_projection = CaptionProjection(g.caption_channels, a)
        if g.cross_attention_adaln:
            self.prompt_adaln_single = AdaLNSingle(d, 2)
            self.audio_prompt_adaln_single = AdaLNSingle(a, 2)
        self.av_ca_video_scale_shift_adaln_single = AdaLNSingle(d, 4)
        self.av_ca_audio_scale_shift_adaln_single = AdaLNSingle(a, 4)
        self.av_ca_a2v_gate_adaln_single = AdaLNSingle(d, 1)
        self.av_ca_v2a_gate_adaln_single = AdaLNSingle(a, 1)
        self.transformer_blocks = nn.ModuleList(LTX2Block(g) for _ in range(g.num_layers))
        self.scale_shift_table = nn.Parameter(torch.empty(2, d))
        self.proj_out = nn.Linear(d, g.in_channels)
        self.audio_scale_shift_table = nn.Parameter(torch.empty(2, a))
        self.audio_proj_out = nn.Linear(a, g.audio_in_channels)
        self.init_weights()

    @property
    def blocks(self) -> list[nn.Module]:
        return list(self.transformer_blocks)

    def init_weights(self):
        """LTX-2 is always fine-tuned from its release; from scratch: xavier linears, zero biases,
        small random tables (the tables are created empty and only a load fills them otherwise)."""
        if any(p.is_meta for p in self.parameters()):
            return
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        for name, param in self.named_parameters():
            if "scale_shift_table" in name:
                nn.init.normal_(param, std=param.shape[-1] ** -0.5)

    # ------------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor, fps: torch.Tensor | None = None,
                x_mask: torch.Tensor | None = None, context_mask: torch.Tensor | None = None,
                audio: torch.Tensor | None = None, audio_t: torch.Tensor | None = None,
                audio_context: torch.Tensor | None = None, audio_context_mask: torch.Tensor | None = None):
        """The velocity of the video latents [B, C, F, H, W], or (video, audio [B, Ta, C_a]) when
        ``audio`` is given; see the module docstring."""
        vx, video, ax, audio_inputs = self.embed(x, t, context, fps, x_mask, context_mask, audio, audio_t,
                                                 audio_context, audio_context_mask)
        for block in self.blocks:
            vx, ax = block(vx, ax, video, audio_inputs)
        out = self.unpatchify(self.head(vx, video.embedded, self.scale_shift_table, self.proj_out), x.shape)
        if ax is None:
            return out
        return out, self.head(ax, audio_inputs.embedded, self.audio_scale_shift_table, self.audio_proj_out)

    def embed(self, x, t, context, fps=None, x_mask=None, context_mask=None, audio=None, audio_t=None,
              audio_context=None, audio_context_mask=None):
        """Everything before the blocks: (vx, video StreamInputs, ax or None, audio StreamInputs or None)."""
        g = self.geometry
        b, _, frames, height, width = x.shape
        t = _per_sample(t, b, "t")
        fps = torch.full((b,), DEFAULT_FPS, device=x.device) if fps is None else _per_sample(fps, b, "fps")
        v_bounds = video_positions(frames, height, width, fps, x.device)
        vx = self.patchify_proj(x.flatten(2).transpose(1, 2).to(self.patchify_proj.weight.dtype))
        video_times = _token_times(t, x_mask, frames, height * width)
        modulation, embedded = _per_token(self.adaln_single, video_times, g)
        video = StreamInputs(
            context=self._context(context, getattr(self, "caption_projection", None), g.dim, "context"),
            context_mask=_additive(context_mask, vx.dtype), modulation=modulation, embedded=embedded,
            rope=rope_table(v_bounds, g.max_pos, g.dim, g.num_heads, g.rope_theta, g.double_precision_rope),
            prompt_modulation=self._prompt(getattr(self, "prompt_adaln_single", None), t))
        if audio is None:
            return vx, video, None, None
        if audio.dim() != 3 or audio.shape[0] != b or audio.shape[2] != g.audio_in_channels:
            raise UserError(f"audio tokens have shape {list(audio.shape)}; the model takes [B={b}, tokens, "
                            f"{g.audio_in_channels}] (8 latent channels x 16 mel bins, patchified)")
        if audio_context is None:
            raise UserError("audio given without audio_context: the audio stream needs its text embeddings")
        audio_t = t if audio_t is None else _per_sample(audio_t, b, "audio_t")
        a_bounds = audio_positions(audio.shape[1], b, x.device)
        ax = self.audio_patchify_proj(audio.to(self.audio_patchify_proj.weight.dtype))
        audio_modulation, audio_embedded = _per_token(self.audio_adaln_single, (audio_t[:, None], None), g)
        audio_inputs = StreamInputs(
            context=self._context(audio_context, getattr(self, "audio_caption_projection", None), g.audio_dim,
                                  "audio_context"),
            context_mask=_additive(audio_context_mask, ax.dtype), modulation=audio_modulation,
            embedded=audio_embedded,
            rope=rope_table(a_bounds, (g.audio_max_pos,), g.audio_dim, g.num_heads, g.rope_theta,
                            g.double_precision_rope),
            prompt_modulation=self._prompt(getattr(self, "audio_prompt_adaln_single", None), audio_t))
        self._cross(video, v_bounds, video_times, audio_t, self.av_ca_video_scale_shift_adaln_single,
                    self.av_ca_a2v_gate_adaln_single)
        self._cross(audio_inputs, a_bounds, (audio_t[:, None], None), t, self.av_ca_audio_scale_shift_adaln_single,
                    self.av_ca_v2a_gate_adaln_single)
        return vx, video, ax, audio_inputs

    def _context(self, context, projection, width: int, name: str) -> torch.Tensor:
        if projection is not None:
            context = projection(context.to(projection.linear_1.weight.dtype))
        if context.dim() != 3 or context.shape[-1] != width:
            want = self.geometry.caption_channels if projection is not None else width
            raise UserError(f"{name} has shape {list(context.shape)}; this LTX-2 ({self.geometry.version}) takes "
                            f"[B, tokens, {want}] text embeddings")
        return context

    def _prompt(self, adaln: AdaLNSingle | None, sigma: torch.Tensor) -> torch.Tensor | None:
        """LTX-2.3: the text keys' and values' modulation from the stream's sigma."""
        if adaln is None:
            return None
        return adaln(sigma[:, None] * self.geometry.timestep_scale_multiplier)[0]

    def _cross(self, inputs: StreamInputs, bounds, own_times, other_sigma, scale_shift: AdaLNSingle,
               gate: AdaLNSingle) -> None:
        """A stream's side of the cross-modal attentions: time-only RoPE on the audio width, the
        scale/shift of its own time, the gate of the other stream's sigma."""
        g = self.geometry
        inputs.cross_rope = rope_table(bounds[:, :1], (max(g.max_pos[0], g.audio_max_pos),), g.audio_dim,
                                       g.num_heads, g.rope_theta, g.double_precision_rope)
        inputs.cross_modulation = _per_token(scale_shift, own_times, g)[0]
        scale = g.timestep_scale_multiplier
        values = other_sigma[:, None] * scale * (g.av_ca_timestep_scale_multiplier / scale)
        inputs.cross_gate = gate(values)[0]

    def head(self, x: torch.Tensor, embedded: torch.Tensor, table: torch.Tensor, proj: nn.Linear) -> torch.Tensor:
        """The output layer: LayerNorm (no weights) modulated by the time embedding and a table."""
        shift, scale = (table[None, None].to(embedded.dtype) + embedded[:, :, None]).unbind(2)
        return proj(F.layer_norm(x, x.shape[-1:], eps=self.geometry.norm_eps) * (1 + scale) + shift)

    def unpatchify(self, tokens: torch.Tensor, latent_shape) -> torch.Tensor:
        """[B, F*H*W, C] -> [B, C, F, H, W]."""
        b, _, frames, height, width = latent_shape
        return tokens.transpose(1, 2).reshape(b, -1, frames, height, width)


# ----------------------------------------------------------------------------- time per token

def _per_sample(value: torch.Tensor, batch: int, name: str) -> torch.Tensor:
    value = torch.as_tensor(value)
    if value.dim() == 0:
        value = value.expand(batch)
    if value.shape != (batch,):
        raise UserError(f"{name} has shape {list(value.shape)}; the LTX-2 model takes one value per sample, [{batch}]")
    return value


def _token_times(t: torch.Tensor, x_mask: torch.Tensor | None, frames: int, per_frame: int):
    """(values [B, n], token index [B, T] or None) of the video's times: sigma for every token
    ([B, 1]), or with ``x_mask`` the two values (sigma, 0) and which one each token takes."""
    if x_mask is None:
        return t[:, None], None
    if x_mask.shape != (t.shape[0], frames):
        raise UserError(f"x_mask has shape {list(x_mask.shape)}; it marks the generated latent frames, "
                        f"[{t.shape[0]}, {frames}]")
    given = ~x_mask.bool().repeat_interleave(per_frame, dim=1)                   # [B, T]: True at time 0
    return torch.stack([t, torch.zeros_like(t)], dim=1), given


def _per_token(adaln: AdaLNSingle, times, g: LTX2Geometry) -> tuple[torch.Tensor, torch.Tensor]:
    """(modulation, embedding) [B, 1 or T, ...] of ``times`` from :func:`_token_times`: the MLP runs
    on the distinct values only, then each token takes its own (the same numbers as ltx-core's
    per-token MLP, without T rows of it)."""
    values, given = times
    modulation, embedded = adaln(values * g.timestep_scale_multiplier)
    if given is None:
        return modulation, embedded
    pick = given[..., None]
    return (torch.where(pick, modulation[:, 1:], modulation[:, :1]),
            torch.where(pick, embedded[:, 1:], embedded[:, :1]))


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A binary text mask [B, L] (1: attended) as ltx-core's additive one [B, 1, 1, L]."""
    if mask is None:
        return None
    return ((mask.to(dtype) - 1) * torch.finfo(dtype).max)[:, None, None, :]
