"""``videodit toy eval``: does a toy-trained model draw the right colour moving the right way?

Samples one clip per prompt of the toy grammar (every combination in turn, held-out ones
included), measures each clip's dominant colour and centroid motion, and scores seen and
held-out combinations separately.

``judge_audio`` scores clips that carry a soundtrack (the toy world you can hear,
``make_toy_dataset(..., audio=True)``): is the tone the colour's pitch, and do the clicks
fall on the edge hit the clip's own frames show? ``evaluate`` does not call it yet: that
waits for a model that generates sound.
"""

from __future__ import annotations

from typing import Sequence

from videodit.toy.audio import ClipWithAudio
from videodit.toy.vocabulary import HELDOUT, all_combinations, caption, parse_caption
from videodit.toy.metrics import audio_pitch_correct, audio_timing_score, hit_frames, measure_clip, score

# A click counts within this many frames of the hit the frames show (the hit is read to
# +-1 frame, the click to a few milliseconds).
HIT_TOLERANCE_FRAMES = 1.5


def toy_prompts(n: int) -> list[tuple[str, str, str]]:
    """``n`` combinations: all 60 in a fixed order, repeated as needed."""
    combos = all_combinations()
    return [combos[i % len(combos)] for i in range(n)]


def evaluate(pipeline, n: int = 60, seed: int = 0, steps: int | None = None,
             guidance: float | None = None, fps: float | None = None) -> dict:
    """Score ``pipeline`` (a ``videodit.sample.Pipeline``, or anything called the same way
    with a ``checkpoint`` attribute) on ``n`` toy prompts."""
    combos = toy_prompts(n)
    clips = pipeline([caption(*c) for c in combos], steps=steps, guidance=guidance, fps=fps, seed=seed)
    results = []
    for (colour, shape, direction), clip in zip(combos, clips):
        measured = measure_clip(clip)
        results.append({"colour": colour, "direction": direction, "shape": shape,
                        "pred_colour": measured["colour"], "pred_direction": measured["direction"],
                        "heldout": (colour, shape, direction) in HELDOUT})
    report = score(results)
    report["checkpoint"] = str(pipeline.checkpoint)
    return report


def judge_audio(clips_with_audio: Sequence[ClipWithAudio | tuple], captions: Sequence[str]) -> dict:
    """Score soundtracks against their captions and their clips' motion.

    ``clips_with_audio``: one ``ClipWithAudio`` (or ``(frames, fps, waveform, sample_rate)``)
    per caption. Per clip: ``audio_pitch_correct`` against the caption's colour, and
    ``audio_timing_score`` against the hit ``hit_frames`` reads off the frames, within
    ``HIT_TOLERANCE_FRAMES``. Returns ``{"pitch_accuracy", "timing_f1", "n", "seen":
    {...}, "heldout": {...}}``, the groups with the same three keys (None when empty).
    """
    if len(clips_with_audio) != len(captions):
        raise ValueError(f"{len(clips_with_audio)} clips but {len(captions)} captions; give one caption per clip")
    results = []
    for clip, text in zip(clips_with_audio, captions):
        frames, fps, waveform, sample_rate = clip
        combo = parse_caption(text)
        hits = hit_frames(frames) / fps
        results.append({
            "pitch": audio_pitch_correct(waveform, sample_rate, combo[0]),
            "timing": audio_timing_score(waveform, sample_rate, hits, tolerance=HIT_TOLERANCE_FRAMES / fps),
            "heldout": combo in HELDOUT,
        })
    report = _audio_scores(results)
    report["seen"] = _audio_scores([r for r in results if not r["heldout"]])
    report["heldout"] = _audio_scores([r for r in results if r["heldout"]])
    return report


def _audio_scores(results: list[dict]) -> dict:
    n = len(results)
    if n == 0:
        return {"pitch_accuracy": None, "timing_f1": None, "n": 0}
    return {"pitch_accuracy": sum(r["pitch"] for r in results) / n,
            "timing_f1": sum(r["timing"] for r in results) / n, "n": n}
