"""The toy world's soundtrack, and the ears that judge one.

A toy clip can carry a stereo soundtrack (``make_toy_dataset(..., audio=True)``) that
depends on its caption and its motion:

* a steady **tone** whose pitch names the colour: one pitch per colour, six semitones
  (a ratio of sqrt(2)) apart from 220 Hz to 880 Hz, so the nearest pitch is never in doubt;
* a **click**, a 6 ms burst of white noise, at the instant the shape hits an edge of the
  frame (the hit times come from the same motion the frames are drawn from);
* panned by the shape's horizontal position (equal power: left at the left edge).

The judges are pure functions of a waveform ``[channels, samples]`` (or ``[samples]``):

* ``dominant_pitch``: the strongest spectral peak between 100 Hz and 2 kHz, or None when
  no peak stands ``_TONAL_RATIO`` above the median of that band (silence, noise);
* ``click_times``: peaks of the energy above 2 kHz (where the tones have none) that rise
  ``_CLICK_RATIO`` above its median and ``_CLICK_FLOOR`` above silence;
* ``audio_pitch_correct`` and ``audio_timing_score`` (F1 of clicks against the hits the
  motion implies, a click counting within ``tolerance`` seconds of one hit).

Silence and stationary noise hold no pitch and no clicks: they score 0 on both, below the
chance level of guessing (1/5 for pitch).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from videodit.errors import UserError
from videodit.toy.vocabulary import COLOURS

__all__ = [
    "ClipWithAudio",
    "SAMPLE_RATE",
    "COLOUR_PITCHES",
    "soundtrack",
    "dominant_pitch",
    "nearest_colour",
    "click_times",
    "audio_pitch_correct",
    "audio_timing_score",
]

SAMPLE_RATE = 16_000

# 220 Hz times sqrt(2)**k: A3, D#4, A4, D#5, A5, in the vocabulary's colour order.
COLOUR_PITCHES: dict[str, float] = {name: 220.0 * 2 ** (k / 2) for k, name in enumerate(COLOURS)}

_TONE_AMPLITUDE = 0.3
_FADE_SECONDS = 0.02  # the tone fades in and out, so its start and end are no clicks
_CLICK_AMPLITUDE = 0.6
_CLICK_SECONDS = 0.006
_CLICK_DECAY_SECONDS = 0.002

_PITCH_BAND = (100.0, 2000.0)
_TONAL_RATIO = 10.0  # a pitch's peak over the band's median magnitude (white noise: ~4)
_CLICK_BAND_HZ = 2000.0  # above the highest pitch's harmonics that matter
_CLICK_WINDOW_SECONDS = 0.016
_CLICK_HOP_SECONDS = 0.004
_CLICK_RATIO = 4.0  # burst over the median high-band level (stationary noise stays within ~1.5)
_CLICK_FLOOR = 0.01  # high-band RMS (full scale 1) below which all is silence
_CLICK_GAP_SECONDS = 0.05  # peaks closer than this are one click


class ClipWithAudio(NamedTuple):
    """A clip and its soundtrack: uint8 ``[T, H, W, 3]`` frames at ``fps``, float
    ``[channels, samples]`` waveform at ``sample_rate`` Hz, starting together."""

    frames: np.ndarray
    fps: float
    waveform: np.ndarray
    sample_rate: int


# --------------------------------------------------------------------------- synthesis


def soundtrack(colour: str, duration: float, hit_times: Sequence[float] = (),
               pan: np.ndarray | None = None, sample_rate: int = SAMPLE_RATE,
               rng: np.random.Generator | None = None) -> np.ndarray:
    """A stereo float32 ``[2, round(duration * sample_rate)]`` soundtrack of one clip.

    ``pan`` holds the shape's horizontal position in [0, 1] (0: left edge) at evenly
    spaced instants over the clip, one per frame (frame ``k`` at ``k * duration / len(pan)``);
    None keeps the tone centred. ``rng`` draws the clicks' noise (default: seed 0).
    """
    if colour not in COLOUR_PITCHES:
        raise UserError(f"colour {colour!r} has no pitch; use one of {list(COLOUR_PITCHES)}")
    num_samples = round(duration * sample_rate)
    times = np.arange(num_samples) / sample_rate
    mono = _TONE_AMPLITUDE * np.sin(2 * np.pi * COLOUR_PITCHES[colour] * times)
    mono *= _fade(num_samples, round(_FADE_SECONDS * sample_rate))
    rng = rng if rng is not None else np.random.default_rng(0)
    click = _click(sample_rate, rng)
    for hit in hit_times:
        start = round(hit * sample_rate)
        stop = min(start + len(click), num_samples)
        if 0 <= start < num_samples:
            mono[start:stop] += click[: stop - start]

    position = np.full(num_samples, 0.5)
    if pan is not None and len(pan):
        pan_times = np.arange(len(pan)) * duration / len(pan)
        position = np.clip(np.interp(times, pan_times, np.asarray(pan, dtype=np.float64)), 0.0, 1.0)
    angle = position * (np.pi / 2)
    return np.stack([mono * np.cos(angle), mono * np.sin(angle)]).astype(np.float32)


def _fade(num_samples: int, ramp: int) -> np.ndarray:
    envelope = np.ones(num_samples)
    ramp = min(ramp, num_samples // 2)
    if ramp:
        rise = np.sin(np.linspace(0.0, np.pi / 2, ramp)) ** 2
        envelope[:ramp], envelope[num_samples - ramp:] = rise, rise[::-1]
    return envelope


def _click(sample_rate: int, rng: np.random.Generator) -> np.ndarray:
    """A short broadband burst: white noise under a fast exponential decay."""
    length = max(1, round(_CLICK_SECONDS * sample_rate))
    decay = np.exp(-np.arange(length) / (_CLICK_DECAY_SECONDS * sample_rate))
    return _CLICK_AMPLITUDE * decay * rng.uniform(-1.0, 1.0, length)


# --------------------------------------------------------------------------- judging


def _mono(waveform) -> np.ndarray:
    waveform = np.asarray(waveform, dtype=np.float64)
    if waveform.ndim == 2:
        waveform = waveform.mean(axis=0)
    if waveform.ndim != 1:
        raise ValueError(f"waveform must be [channels, samples] or [samples], got {list(waveform.shape)}")
    return np.nan_to_num(waveform)


def dominant_pitch(waveform, sample_rate: int) -> float | None:
    """Frequency (Hz) of the strongest tone between 100 Hz and 2 kHz, or None if none stands out."""
    mono = _mono(waveform)
    if len(mono) < 2:
        return None
    spectrum = np.abs(np.fft.rfft(mono * np.hanning(len(mono))))
    freqs = np.fft.rfftfreq(len(mono), 1.0 / sample_rate)
    band = (freqs >= _PITCH_BAND[0]) & (freqs <= _PITCH_BAND[1])
    if not band.any():
        return None
    magnitudes = spectrum[band]
    peak = int(np.argmax(magnitudes))
    if magnitudes[peak] <= _TONAL_RATIO * np.median(magnitudes) or magnitudes[peak] == 0:
        return None
    return float(freqs[band][peak])


def nearest_colour(pitch: float | None) -> str | None:
    """The colour whose pitch is nearest ``pitch`` in semitones (None stays None)."""
    if pitch is None or not pitch > 0:
        return None
    names = list(COLOUR_PITCHES)
    distances = [abs(np.log2(pitch / COLOUR_PITCHES[name])) for name in names]
    return names[int(np.argmin(distances))]


def audio_pitch_correct(waveform, sample_rate: int, colour: str) -> bool:
    """Whether the waveform's dominant pitch is ``colour``'s (the nearest of the vocabulary's)."""
    if colour not in COLOUR_PITCHES:
        raise UserError(f"colour {colour!r} has no pitch; use one of {list(COLOUR_PITCHES)}")
    return nearest_colour(dominant_pitch(waveform, sample_rate)) == colour


def click_times(waveform, sample_rate: int) -> np.ndarray:
    """Times (seconds) of the broadband bursts in the waveform, sorted."""
    mono = _mono(waveform)
    window = max(8, round(_CLICK_WINDOW_SECONDS * sample_rate))
    hop = max(1, round(_CLICK_HOP_SECONDS * sample_rate))
    if len(mono) < window:
        return np.zeros(0)
    starts = np.arange(0, len(mono) - window + 1, hop)
    frames = mono[starts[:, None] + np.arange(window)[None, :]] * np.hanning(window)
    spectrum = np.abs(np.fft.rfft(frames, axis=1)) ** 2
    high = np.fft.rfftfreq(window, 1.0 / sample_rate) >= _CLICK_BAND_HZ
    # RMS of the high band per window (Parseval, up to the window's constant gain).
    level = np.sqrt(2 * spectrum[:, high].sum(axis=1) / (window * (np.hanning(window) ** 2).sum()))
    threshold = max(_CLICK_FLOOR, _CLICK_RATIO * float(np.median(level)))
    loud = np.flatnonzero(level > threshold)
    centres = (starts + window / 2) / sample_rate
    clicks: list[int] = []
    gap = _CLICK_GAP_SECONDS / _CLICK_HOP_SECONDS
    for index in loud:   # one click per run of loud windows: its loudest
        if clicks and index - clicks[-1] < gap:
            if level[index] > level[clicks[-1]]:
                clicks[-1] = index
            continue
        clicks.append(index)
    return centres[clicks]


def audio_timing_score(waveform, sample_rate: int, expected_hit_times: Sequence[float],
                       tolerance: float = 0.15) -> float:
    """F1 of the waveform's clicks against ``expected_hit_times`` (seconds).

    A click matches at most one hit, within ``tolerance`` seconds (1-2 frames); pairs are
    taken closest first. No hits and no clicks is a perfect 1.0; silence where hits were
    expected is 0.
    """
    found = click_times(waveform, sample_rate)
    expected = np.asarray(expected_hit_times, dtype=np.float64).reshape(-1)
    if len(found) == 0 and len(expected) == 0:
        return 1.0
    if len(found) == 0 or len(expected) == 0:
        return 0.0
    distance = np.abs(found[:, None] - expected[None, :])
    matched, used_found, used_expected = 0, set(), set()
    for flat in np.argsort(distance, axis=None):
        i, j = divmod(int(flat), len(expected))
        if distance[i, j] > tolerance:
            break
        if i not in used_found and j not in used_expected:
            used_found.add(i)
            used_expected.add(j)
            matched += 1
    return 2 * matched / (len(found) + len(expected))
