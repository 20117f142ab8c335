"""LTX-2's audio stream in the objective (``model.train_audio``) against ltx-trainer's ``flexible``
strategy (Lightricks/LTX-2 at 400fd31, ``packages/ltx-trainer/src/ltx_trainer``), re-implemented
below from its code (``timestep_samplers.py`` ``ShiftedLogitNormalTimestepSampler``;
``training_strategies/flexible.py`` ``_process_modality`` for video then audio,
``_initialize_noisy_target``, ``_apply_intrinsic_condition`` for ``first_frame``,
``_compute_modality_loss``, ``compute_loss``; ``trainer.py``: ``loss.mean()``), on the global RNG
seeded as videodit seeds its batch generator. Every sigma, noise-derived tensor and the loss is
equal bit for bit. The one addition of videodit's: a clip without a soundtrack leaves its audio
tokens out of the audio loss (its per-sample mask), which with every clip sounding is LTX's loss."""

import pytest
import torch

from videodit.config import load_config
from videodit.diffusion import ltx2_schedule
from videodit.diffusion.ltx2_objective import LTX2Objective

# ---------------------------------------------------------------------- ltx-trainer, as written there


class ShiftedLogitNormalTimestepSampler:
    def __init__(self, std: float = 1.0, eps: float = 1e-3, uniform_prob: float = 0.1):
        self.std, self.eps, self.uniform_prob = std, eps, uniform_prob
        self.normal_999_percentile = 3.0902 * std
        self.normal_005_percentile = -2.5758 * std

    def sample(self, batch_size, seq_length, device=None):
        mu = self._get_shift_for_sequence_length(seq_length)
        normal_samples = torch.randn((batch_size,), device=device) * self.std + mu
        logitnormal_samples = torch.sigmoid(normal_samples)
        percentile_999 = torch.sigmoid(torch.tensor(mu + self.normal_999_percentile, device=device))
        percentile_005 = torch.sigmoid(torch.tensor(mu + self.normal_005_percentile, device=device))
        zero_terminal_raw = (logitnormal_samples - percentile_005) / (percentile_999 - percentile_005)
        stretched_logit = torch.where(zero_terminal_raw >= self.eps, zero_terminal_raw, 2 * self.eps - zero_terminal_raw)
        stretched_logit = torch.clamp(stretched_logit, 0, 1)
        uniform = (1 - self.eps) * torch.rand((batch_size,), device=device) + self.eps
        prob = torch.rand((batch_size,), device=device)
        return torch.where(prob > self.uniform_prob, stretched_logit, uniform)

    def sample_for(self, batch):
        batch_size, seq_length, _ = batch.shape
        return self.sample(batch_size, seq_length, device=batch.device)

    @staticmethod
    def _get_shift_for_sequence_length(seq_length, min_tokens=1024, max_tokens=4096, min_shift=0.95, max_shift=2.05):
        m = (max_shift - min_shift) / (max_tokens - min_tokens)
        b = min_shift - m * min_tokens
        return m * seq_length + b



# einops' rearrange as ltx-trainer calls it, in the same torch ops (a permute, then a reshape):
# einops is not one of our dependencies.
def video_tokens(x):   # "b c f h w -> b (f h w) c"
    return x.permute(0, 2, 3, 4, 1).reshape(x.shape[0], -1, x.shape[1])


def audio_tokens(x):   # "b c t f -> b t (c f)"
    return x.permute(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1)

def initialize_noisy_target(latents, timestep_sampler):
    batch_size, seq_len, _ = latents.shape
    sigmas = timestep_sampler.sample_for(latents)
    noise = torch.randn_like(latents)
    sigmas_expanded = sigmas.view(-1, 1, 1)
    noisy_latents = (1 - sigmas_expanded) * latents + sigmas_expanded * noise
    targets = noise - latents
    timesteps = sigmas.view(-1, 1).expand(batch_size, seq_len).clone()
    loss_mask = torch.ones(batch_size, seq_len, dtype=torch.bool, device=latents.device)
    return noisy_latents, targets, timesteps, loss_mask, sigmas


def apply_first_frame(noisy_latents, clean_latents, timesteps, loss_mask, probability, height, width):
    batch_size, seq_len, _ = noisy_latents.shape
    apply_per_sample = torch.rand(batch_size, device=noisy_latents.device) < probability
    if not apply_per_sample.any():
        return noisy_latents, timesteps, loss_mask
    mask = torch.zeros(batch_size, seq_len)
    mask[:, :height * width] = 1.0
    mask = mask * apply_per_sample.view(-1, 1).to(mask.dtype)
    m = mask.unsqueeze(-1)
    noisy_latents = m * clean_latents + (1 - m) * noisy_latents
    timesteps = (1 - mask) * timesteps
    loss_mask = loss_mask & (mask == 0)
    return noisy_latents, timesteps, loss_mask


def compute_modality_loss(pred, targets, loss_mask):
    target_len = targets.shape[1]
    pred = pred[:, -target_len:, :]
    mask = loss_mask[:, -target_len:]
    mask_expanded = mask.unsqueeze(-1).float()
    squared_error = (pred - targets).pow(2)
    masked_loss = squared_error * mask_expanded
    return masked_loss.mean(dim=[-2, -1]) / mask_expanded.mean(dim=[-2, -1]).clamp(min=1e-8)


def ltx_trainer_step(seed, video_latents, audio_latents, first_frame_p):
    """``prepare_training_inputs``: video (its first-frame condition when configured), then audio."""
    torch.manual_seed(seed)
    sampler = ShiftedLogitNormalTimestepSampler()
    _, _, _, height, width = video_latents.shape
    video = video_tokens(video_latents)
    v_noisy, v_targets, v_timesteps, v_mask, v_sigmas = initialize_noisy_target(video, sampler)
    if first_frame_p > 0:
        v_noisy, v_timesteps, v_mask = apply_first_frame(v_noisy, video, v_timesteps, v_mask, first_frame_p,
                                                         height, width)
    audio = audio_tokens(audio_latents)
    a_noisy, a_targets, a_timesteps, a_mask, a_sigmas = initialize_noisy_target(audio, sampler)
    return dict(v_noisy=v_noisy, v_targets=v_targets, v_timesteps=v_timesteps, v_mask=v_mask, v_sigmas=v_sigmas,
                a_noisy=a_noisy, a_targets=a_targets, a_timesteps=a_timesteps, a_mask=a_mask, a_sigmas=a_sigmas)


# ---------------------------------------------------------------------- videodit against it

OBJECTIVE = LTX2Objective(load_config("tiny", ["model.preset=ltx2-tiny", "diffusion.prediction=velocity",
                                               "diffusion.loss_space=velocity"]).diffusion)


@pytest.mark.parametrize("seed, first_frame_p, video_shape, audio_frames", [
    (0, 0.0, (2, 8, 3, 4, 6), 13),
    (1, 0.5, (3, 8, 3, 4, 6), 13),
    (7, 0.5, (2, 16, 2, 8, 8), 51),
    (11, 1.0, (1, 8, 1, 2, 2), 1),
])
def test_draws_targets_and_loss_are_ltx_trainers_bit_for_bit(seed, first_frame_p, video_shape, audio_frames):
    g = torch.Generator().manual_seed(1000 + seed)
    x0 = torch.randn(video_shape, generator=g)
    a0 = torch.randn(video_shape[0], 8, audio_frames, 16, generator=g)   # the audio VAE's [B, 8, T', 16]
    b = video_shape[0]
    ltx = ltx_trainer_step(seed, x0, a0, first_frame_p)

    generator = torch.Generator().manual_seed(seed)   # the trainer's batch generator: video, then audio
    video = ltx2_schedule.noised(x0, generator, first_frame_p)
    tokens = audio_tokens(a0)   # the audio VAE's tokens()
    audio = OBJECTIVE.noised_audio(tokens, generator)

    to_tokens = ltx2_schedule.to_tokens
    assert torch.equal(video.sigma, ltx["v_sigmas"]) and torch.equal(video.sigma_tokens, ltx["v_timesteps"])
    assert torch.equal(to_tokens(video.x_t), ltx["v_noisy"]) and torch.equal(to_tokens(video.target), ltx["v_targets"])
    assert torch.equal(video.loss_mask, ltx["v_mask"])
    assert torch.equal(audio.sigma, ltx["a_sigmas"]) and torch.equal(audio.sigma[:, None].expand(b, audio_frames),
                                                                     ltx["a_timesteps"])
    assert torch.equal(audio.x_t, ltx["a_noisy"]) and torch.equal(audio.target, ltx["a_targets"])
    assert not torch.equal(audio.sigma, video.sigma[: b])   # a sigma of its own

    # the model's outputs: tokens as its output layers make them (LTX's pred), videodit's video unpatchified from them
    v_pred_tokens, a_pred = torch.randn(ltx["v_targets"].shape, generator=g), torch.randn(tokens.shape, generator=g)
    v_pred = v_pred_tokens.transpose(1, 2).reshape(video_shape)
    for present in (torch.ones(b, dtype=torch.bool), torch.arange(b) % 2 == 1):   # every clip sounding; some silent
        audio_mask = present[:, None].expand(b, audio_frames)
        total, audio_loss = OBJECTIVE.joint_losses(v_pred, video.target, video.generated_frames, a_pred, audio.target,
                                                   audio_mask)
        want_video = compute_modality_loss(v_pred_tokens, ltx["v_targets"], ltx["v_mask"])
        want_audio = compute_modality_loss(a_pred, ltx["a_targets"], ltx["a_mask"] & audio_mask)
        assert torch.equal(audio_loss, want_audio) and torch.equal(total.mean(), (want_video + want_audio).mean())
        assert torch.equal(audio_loss[~present], torch.zeros(int((~present).sum())))   # no soundtrack: no audio loss


def test_the_audio_sigma_is_shifted_by_the_audio_tokens():
    """mu follows the audio stream's own token count (25 a second), not the video's."""
    a0 = torch.zeros(1, 4000, 4)
    high = OBJECTIVE.noised_audio(a0, torch.Generator().manual_seed(3)).sigma
    low = OBJECTIVE.noised_audio(a0[:, :10], torch.Generator().manual_seed(3)).sigma
    assert torch.equal(high, ltx2_schedule.sample_sigmas(1, 4000, torch.Generator().manual_seed(3)))
    assert torch.equal(low, ltx2_schedule.sample_sigmas(1, 10, torch.Generator().manual_seed(3)))
