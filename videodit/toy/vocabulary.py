"""The toy world's language: ``a {colour} {shape} moving {direction}``.

Shared by the dataset generator (``make.py``), the toy text encoder (``encoder.py``) and the
evaluation (``metrics.py``, ``eval.py``), so all of them speak the same words.
"""

from __future__ import annotations

import itertools

from videodit.errors import UserError

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (255, 0, 0),
    "green": (0, 255, 0),
    "blue": (0, 0, 255),
    "yellow": (255, 255, 0),
    "white": (255, 255, 255),
}
SHAPES = ("circle", "square", "triangle")
DIRECTIONS = ("left", "right", "up", "down")

# Never used for training; each colour, shape and direction still appears in other
# training combinations, so these test composition rather than unseen words.
HELDOUT = (
    ("red", "circle", "left"),
    ("green", "square", "up"),
    ("blue", "triangle", "right"),
    ("yellow", "circle", "down"),
    ("white", "triangle", "left"),
    ("red", "square", "down"),
)


def caption(colour: str, shape: str, direction: str) -> str:
    """The caption for one clip, e.g. ``"a red circle moving left"``."""
    return f"a {colour} {shape} moving {direction}"


def parse_caption(text: str) -> tuple[str, str, str]:
    """Invert ``caption``: ``"a red circle moving left"`` -> ``("red", "circle", "left")``.

    Case and surrounding/repeated whitespace are ignored; anything outside the grammar
    raises ``UserError``.
    """
    words = text.lower().split()
    if (len(words) == 5 and words[0] == "a" and words[3] == "moving"
            and words[1] in COLOURS and words[2] in SHAPES and words[4] in DIRECTIONS):
        return words[1], words[2], words[4]
    raise UserError(
        f"caption {text!r} is not in the toy grammar 'a <colour> <shape> moving <direction>' "
        f"with colour in {sorted(COLOURS)}, shape in {list(SHAPES)}, "
        f"direction in {list(DIRECTIONS)}"
    )


def all_combinations() -> list[tuple[str, str, str]]:
    """All 60 (colour, shape, direction) triples in a fixed order."""
    return list(itertools.product(COLOURS, SHAPES, DIRECTIONS))


def seen_combinations() -> list[tuple[str, str, str]]:
    """The 54 triples used for training: ``all_combinations()`` minus ``HELDOUT``."""
    heldout = set(HELDOUT)
    return [combo for combo in all_combinations() if combo not in heldout]
