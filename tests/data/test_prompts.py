"""Open-Sora 1.2's prompt preparation at sampling time, against Open-Sora's own output
(tests/fixtures/opensora/prompts.json, written by scripts/make_opensora_prompt_fixture.py)."""

import json
from pathlib import Path

import pytest

from videodit.data.prompts import clean_prompt, prepare_prompts, with_scores

CASES = json.loads((Path(__file__).resolve().parents[1] / "fixtures/opensora/prompts.json").read_text())


@pytest.mark.parametrize("case", CASES, ids=[c["prompt"][:30] for c in CASES])
def test_opensora_style_matches_opensora(case):
    assert prepare_prompts([case["prompt"]], "opensora", case["aesthetic"]) == [case["opensora"]]


def test_plain_style_leaves_prompts_alone():
    prompts = ["A Red Circle", "  spaced  "]
    assert prepare_prompts(prompts, "plain", 6.5) == prompts


def test_scores_are_appended_once_and_cleaning_is_stable():
    once = with_scores("a cat", aesthetic=6.5, motion=4, camera_motion="pan right")
    assert once == "a cat aesthetic score: 6.5. motion score: 4.0. camera motion: pan right."
    assert with_scores(once, aesthetic=7, motion=1, camera_motion="static") == once
    assert prepare_prompts(["a cat"], "opensora", None) == ["a cat"]
    cleaned = clean_prompt("A <i>Cat</i>, sleeping...")
    assert clean_prompt(cleaned) == cleaned == "a cat, sleeping"
