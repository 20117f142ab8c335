"""``videodit toy eval``: does a toy-trained model draw the right colour moving the right way?

Samples one clip per prompt of the toy grammar (every combination in turn, held-out ones
included), measures each clip's dominant colour and centroid motion, and scores seen and
held-out combinations separately.
"""

from __future__ import annotations

from videodit.toy.vocabulary import HELDOUT, all_combinations, caption
from videodit.toy.metrics import measure_clip, score


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
