"""LTX-2's training objective, as ltx-trainer trains it (Lightricks/LTX-2 at 400fd31,
``packages/ltx-trainer``: ``timestep_samplers.py`` ``ShiftedLogitNormalTimestepSampler`` and
``training_strategies/flexible.py``, the strategy every shipped config uses).

Conventions are videodit's and LTX's alike: sigma in [0, 1] with 1 = noise,

    x_t = (1 - sigma) x0 + sigma noise,        target = noise - x0 (the velocity),

and the model is handed sigma itself, per sample ([B], LTX's ``Modality.sigma``) and per token
([B, F*H*W], ``Modality.timesteps``; its AdaLN scales it by 1000 inside the model).

**Sigma** (:func:`sample_sigmas`): ``sigmoid(N(mu, 1))`` with mu on the line through
(1024 tokens, 0.95) and (4096 tokens, 2.05), not clamped (the video tokens of the clip, F*H*W at
patch 1: 960x544x49 is 3570 tokens, mu 1.86); stretched so that the normal's 0.5 and 99.9
percentiles land on 0 and 1; values below eps = 1e-3 reflected to ``2 eps - value``, then clamped
to [0, 1]; and with probability 0.1 replaced by a uniform draw on [eps, 1].

**Draws**, all from one generator, in ltx-trainer's order: the sigma's normal randn(B), its
uniform rand(B) and its choice rand(B); the noise (:func:`draw_noise`, as LTX's ``randn_like`` of
its token view fills it); with first-frame conditioning, rand(B) picks the i2v samples. Seeded like
ltx-trainer's global RNG on the CPU, every draw is the same number (the fixtures compare them bit
for bit). On a GPU ltx-trainer draws from the CUDA generator instead; videodit keeps drawing on the
CPU from the batch's seed, so its numbers do not depend on the device (the distribution is LTX's).

**First frame** (image-to-video, LTX's ``first_frame`` condition; its i2v config: p = 0.5): per
sample with probability p, the tokens of latent frame 0 keep their clean latents, get sigma 0
(per token; the per-sample sigma is unchanged) and are left out of the loss. A one-frame clip so
conditioned has no token in the loss: its loss is 0 (LTX's clamp), not NaN.

**Loss** (:func:`masked_mse`): per sample, the squared error averaged over the tokens in the loss
and the channels, [B]; the trainer averages over the batch. Taken in fp32.

**Audio** (:func:`noised_tokens`, :func:`token_mse`; ``model.train_audio``): ``flexible`` handles
the audio modality after the video one, so after the video's draws (its first-frame choice
included) come the audio's own sigma, shifted by the audio token count (25 a second), then its
noise, ``randn_like`` of the tokens [B, Ta, 128]; x_t and the target as above. Its loss is the same
per-sample masked MSE on the tokens, and a sample's loss is the video's plus the audio's, averaged
over the batch by the trainer (:func:`token_mse` takes LTX's token layout, so the sums are theirs).

Not here: the deprecated ``text_to_video`` strategy (it draws the i2v choice first and skips it
for one-frame clips).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# mu, the mean of the logit-normal: a line through (MIN_TOKENS, MIN_SHIFT) and (MAX_TOKENS, MAX_SHIFT).
# ltx-core's sampling schedule (``LTX2Scheduler``) uses the same line.
MIN_TOKENS, MIN_SHIFT = 1024, 0.95
MAX_TOKENS, MAX_SHIFT = 4096, 2.05
# The standard normal's 99.9th and 0.5th percentiles, to four decimals as ltx-trainer writes them.
HIGH_PERCENTILE, LOW_PERCENTILE = 3.0902, -2.5758
EPS = 1e-3            # the reflection point and the uniform draws' floor
UNIFORM_P = 0.1       # how often a sigma is a uniform draw instead
I2V_P = 0.5           # first-frame probability of LTX's i2v config (configs/i2v_lora.yaml)


def shift_mu(tokens: int) -> float:
    """mu of a clip of ``tokens`` video tokens (computed in LTX's order, so the float is the same)."""
    slope = (MAX_SHIFT - MIN_SHIFT) / (MAX_TOKENS - MIN_TOKENS)
    intercept = MIN_SHIFT - slope * MIN_TOKENS
    return slope * tokens + intercept


def sample_sigmas(batch: int, tokens: int, generator: torch.Generator | None = None, *, std: float = 1.0,
                  eps: float = EPS, uniform_p: float = UNIFORM_P) -> torch.Tensor:
    """``batch`` training sigmas (float32, CPU) for clips of ``tokens`` video tokens; three draws of
    ``batch`` from ``generator`` (the global RNG if None): normal, uniform, choice."""
    mu = shift_mu(tokens)
    normal = torch.randn((batch,), generator=generator) * std + mu
    logit_normal = torch.sigmoid(normal)
    # The percentiles as LTX computes them: float32 sigmoids of the Python sums.
    high = torch.sigmoid(torch.tensor(mu + HIGH_PERCENTILE * std))
    low = torch.sigmoid(torch.tensor(mu + LOW_PERCENTILE * std))
    stretched = (logit_normal - low) / (high - low)
    reflected = torch.where(stretched >= eps, stretched, 2 * eps - stretched).clamp(0, 1)
    uniform = (1 - eps) * torch.rand((batch,), generator=generator) + eps
    choice = torch.rand((batch,), generator=generator)
    return torch.where(choice > uniform_p, reflected, uniform)


# ---------------------------------------------------------------------- layout


def to_tokens(x: torch.Tensor) -> torch.Tensor:
    """Latents [B, C, F, H, W] -> LTX's tokens [B, F*H*W, C] (patch 1, (frame, row, column) order)."""
    return x.flatten(2).transpose(1, 2)


def from_tokens(tokens: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """LTX's tokens [B, F*H*W, C] -> latents of ``shape`` [B, C, F, H, W] (contiguous)."""
    return tokens.transpose(1, 2).reshape(shape)


def per_token(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-token tensor [B, F*H*W] viewed against latents ``like`` [B, C, F, H, W]: [B, 1, F, H, W]."""
    return values.view(like.shape[0], 1, *like.shape[2:])


def draw_noise(shape: torch.Size | tuple[int, ...], generator: torch.Generator | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Training noise for latents of ``shape`` [B, C, F, H, W], the numbers ltx-trainer draws.

    It calls ``randn_like`` on its token view [B, F*H*W, C] of the latents, a permutation of the
    latents' memory; torch then fills that tensor element by element in memory order with its
    non-contiguous sampler, which gives other numbers than a contiguous ``randn`` of either shape.
    So does this."""
    b, c, frames, height, width = shape
    noise = torch.empty((b, c, frames * height * width), dtype=dtype)
    noise.transpose(1, 2).normal_(generator=generator)
    return noise.view(shape)


def first_frame_tokens(given: torch.Tensor, frames: int, height: int, width: int) -> torch.Tensor:
    """[B, F*H*W] bool: the tokens of latent frame 0 of the samples whose first frame is ``given`` [B]."""
    first = torch.arange(frames * height * width, device=given.device) < height * width
    return given[:, None] & first


# ---------------------------------------------------------------------- the objective


def interpolate(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """x_t = (1 - sigma) x0 + sigma noise, sigma [B] (LTX's operations, in its order)."""
    s = sigma.view(-1, *([1] * (x0.dim() - 1)))
    return (1 - s) * x0 + s * noise


def velocity_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return noise - x0


@dataclass
class Noised:
    """One training step's noised latents and what goes with them (latents [B, C, F, H, W])."""
    x_t: torch.Tensor           # [B, C, F, H, W]; latent frame 0 clean where ``given``
    target: torch.Tensor        # [B, C, F, H, W] noise - x0, everywhere (the loss mask leaves frame 0 out)
    sigma: torch.Tensor         # [B] float32, the drawn sigma (LTX's Modality.sigma)
    sigma_tokens: torch.Tensor  # [B, F*H*W] float32: sigma, 0 on the given tokens (Modality.timesteps)
    given: torch.Tensor         # [B] bool: the sample's first latent frame is given (i2v)
    loss_mask: torch.Tensor     # [B, F*H*W] bool: the token is in the loss

    @property
    def generated_frames(self) -> torch.Tensor:
        """[B, F] bool, True = generated: the frame mask in the form videodit's frame conditioning uses."""
        frames = self.x_t.shape[2]
        mask = torch.ones(self.given.shape[0], frames, dtype=torch.bool, device=self.given.device)
        mask[:, 0] = ~self.given
        return mask


def noised(x0: torch.Tensor, generator: torch.Generator | None = None, first_frame_p: float = 0.0) -> Noised:
    """LTX-2's training inputs for clean latents ``x0`` [B, C, F, H, W] (every sample of one size,
    as a bucket gives): the sigma (shifted by the F*H*W tokens), the noise, and with
    ``first_frame_p`` > 0 the i2v choice, drawn from ``generator`` in ltx-trainer's order.
    The draws are made on the CPU; the results are on ``x0``'s device."""
    b, _, frames, height, width = x0.shape
    sigma = sample_sigmas(b, frames * height * width, generator)
    noise = draw_noise(x0.shape, generator, x0.dtype)
    if first_frame_p > 0:
        given = torch.rand((b,), generator=generator) < first_frame_p
    else:
        given = torch.zeros(b, dtype=torch.bool)
    sigma, noise, given = sigma.to(x0.device), noise.to(x0.device), given.to(x0.device)
    clean = first_frame_tokens(given, frames, height, width)
    x_t = torch.where(per_token(clean, x0), x0, interpolate(x0, noise, sigma))
    sigma_tokens = torch.where(clean, torch.zeros_like(sigma)[:, None], sigma[:, None])
    return Noised(x_t, velocity_target(x0, noise), sigma, sigma_tokens, given, ~clean)


def masked_mse(output: torch.Tensor, target: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Per-sample loss [B] (fp32): the squared error of ``output`` [B, C, F, H, W] averaged over the
    tokens where ``loss_mask`` [B, F*H*W] is True and over the channels; 0 where no token is."""
    error = (output.float() - target.float()).square()
    weight = per_token(loss_mask, error).to(error.dtype)
    return (error * weight).flatten(1).mean(1) / weight.flatten(1).mean(1).clamp(min=1e-8)


# ---------------------------------------------------------------------- a token stream (audio)


@dataclass
class NoisedTokens:
    """One step's noised tokens [B, T, C] of a stream with a sigma of its own (LTX-2's audio)."""
    x_t: torch.Tensor
    target: torch.Tensor   # noise - x0
    sigma: torch.Tensor    # [B] float32


def noised_tokens(x0: torch.Tensor, generator: torch.Generator | None = None) -> NoisedTokens:
    """ltx-trainer's ``_initialize_noisy_target`` of tokens ``x0`` [B, T, C]: sigma shifted by the T
    tokens, then ``randn_like`` noise (a contiguous tensor's: a plain randn of its shape), drawn on the
    CPU from ``generator``; the results on ``x0``'s device."""
    b, tokens, _ = x0.shape
    sigma = sample_sigmas(b, tokens, generator).to(x0.device)
    noise = torch.randn(x0.shape, generator=generator, dtype=x0.dtype).to(x0.device)
    return NoisedTokens(interpolate(x0, noise, sigma), velocity_target(x0, noise), sigma)


def token_mse(output: torch.Tensor, target: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """ltx-trainer's ``_compute_modality_loss``: per-sample loss [B] (fp32) of tokens [B, T, C],
    the squared error averaged over the tokens where ``loss_mask`` [B, T] is True and the channels;
    0 where no token is. Its operations in its order (contiguous token layouts give its sums)."""
    weight = loss_mask.unsqueeze(-1).float()
    error = (output.float() - target.float()).pow(2) * weight
    return error.mean(dim=[-2, -1]) / weight.mean(dim=[-2, -1]).clamp(min=1e-8)
