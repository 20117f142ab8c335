"""``videodit toy eval``: does a toy-trained model draw the right colour moving the right way?

Samples one clip per prompt of the toy grammar (every combination in turn, held-out ones
included), measures each clip's dominant colour and centroid motion, and scores seen and
held-out combinations separately.

``judge_audio`` scores clips that carry a soundtrack (the toy world you can hear,
``make_toy_dataset(..., audio=True)``): is the tone the colour's pitch, and do the clicks
fall on the edge hit the clip's own frames show? ``evaluate`` calls it for a model that
makes sound (the ``toy-av`` preset's).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

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
    with a ``checkpoint`` attribute) on ``n`` toy prompts. A pipeline that makes sound (its
    ``soundtrack`` set: a model that trained its audio stream) is judged on the sound too:
    ``report["audio"]`` (:func:`judge_audio`)."""
    combos = toy_prompts(n)
    captions = [caption(*c) for c in combos]
    options = dict(steps=steps, guidance=guidance, fps=fps, seed=seed)
    sounds = None
    if getattr(pipeline, "soundtrack", None) is None:
        clips = pipeline(captions, **options)
    else:   # each batch: (prompt indices, clips, (waveform, rate) per clip)
        batches = list(pipeline.batches(captions, **options))
        clips = np.concatenate([batch[1] for batch in batches])
        sounds = [sound for batch in batches for sound in batch[2]]
    results = []
    for (colour, shape, direction), clip in zip(combos, clips):
        measured = measure_clip(clip)
        results.append({"colour": colour, "direction": direction, "shape": shape,
                        "pred_colour": measured["colour"], "pred_direction": measured["direction"],
                        "heldout": (colour, shape, direction) in HELDOUT})
    report = score(results)
    if sounds is not None:
        rate = fps or pipeline.cfg.sample.fps
        report["audio"] = judge_audio([ClipWithAudio(clip, rate, wave, sample_rate)
                                       for clip, (wave, sample_rate) in zip(clips, sounds)], captions)
    report["checkpoint"] = str(pipeline.checkpoint)
    return report


def judge_audio(clips_with_audio: Sequence[ClipWithAudio | tuple], captions: Sequence[str]) -> dict:
    """Score soundtracks against their captions and their clips' motion.

    ``clips_with_audio``: one ``ClipWithAudio`` (or ``(frames, fps, waveform, sample_rate)``)
    per caption. Per clip: ``audio_pitch_correct`` against the caption's colour, and
    ``audio_timing_score`` against the hit ``hit_frames`` reads off the frames, within
    ``HIT_TOLERANCE_FRAMES``. ``timing_f1`` averages the clips whose frames show a hit
    (``with_hit`` of them): a still clip with a silent track would score a vacuous 1.0, which
    would flatter a model that has learnt neither. Returns ``{"pitch_accuracy", "timing_f1",
    "n", "with_hit", "seen": {...}, "heldout": {...}}``, the groups with the same keys (None
    when empty).
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
            "hit": len(hits) > 0, "heldout": combo in HELDOUT,
        })
    report = _audio_scores(results)
    report["seen"] = _audio_scores([r for r in results if not r["heldout"]])
    report["heldout"] = _audio_scores([r for r in results if r["heldout"]])
    return report


def _audio_scores(results: list[dict]) -> dict:
    n, timed = len(results), [r["timing"] for r in results if r["hit"]]
    return {"pitch_accuracy": sum(r["pitch"] for r in results) / n if n else None,
            "timing_f1": sum(timed) / len(timed) if timed else None, "n": n, "with_hit": len(timed)}
