"""Prompt preparation at sampling time, the way Open-Sora 1.2's inference does it.

Open-Sora's released weights saw cleaned, lower-cased captions with an aesthetic score
appended ("... aesthetic score: 6.5."), and its sampler prepares prompts that way. With
``sample.prompt_style=opensora`` videodit does the same:

- ``clean_prompt`` is videodit's own implementation of the cleaning Open-Sora applies twice
  (DeepFloyd IF's ``clean_caption``): URL and HTML removal, ``@handles``, CJK runs, one kind
  of dash and quote, decorative punctuation, catalogue ids, collapsed spaces and a space
  after ``,`` ``.`` ``/``. ``ftfy`` and ``beautifulsoup4`` are used when installed (Open-Sora
  needs both); without them mojibake stays as it is and tags are stripped by a pattern.
- ``with_scores`` appends the score suffixes Open-Sora's ``append_score_to_prompts`` writes.

tests/fixtures/opensora/prompts.json holds Open-Sora's own output for a set of prompts
(scripts/make_opensora_fixtures.py writes it); the tests compare against it.
"""

from __future__ import annotations

import html
import re
import urllib.parse

_URL = re.compile(r"\b(?:(?:https?|www):\S+|[\w.\-]+\.(?:com|co|ru|net|org|edu|gov|it)[\w/\-]*\b/?(?!@))")
_TAG = re.compile(r"<[^>]*>")
_CJK = re.compile("[\u31c0-\u4dff\u4e00-\u9fff]+")   # strokes .. unified ideographs, as Open-Sora
_DASHES = re.compile("[\u002d\u058a\u05be\u1400\u1806\u2010-\u2015\u2e17\u2e1a\u2e3a\u2e3b\u2e40\u301c\u3030"
                     "\u30a0\ufe31\ufe32\ufe58\ufe63\uff0d]+")
_DECORATION = re.compile(r"[#®•©™&@·º½¾¿¡§~()\[\]{}|\\/*]+")
_IDS = (r"\b[a-zA-Z]{1,3}\d{3,15}\b", r"\b[a-zA-Z]+\d+[a-zA-Z]+\b", r"\b\d+[a-zA-Z]+\d+\b")
_SPAM = (r"(worldwide\s+)?(free\s+)?shipping", r"(free\s)?download(\sfree)?", r"\bclick\b\s(?:for|on)\s\w+",
         r"\b(?:png|jpg|jpeg|bmp|webp|eps|pdf|apk|mp4)(\simage[s]?)?", r"\bpage\s+\d+\b")


def _strip_markup(text: str) -> str:
    try:
        from bs4 import BeautifulSoup
    except ImportError:
        return html.unescape(_TAG.sub("", text))
    return BeautifulSoup(text, features="html.parser").text


def _fix_text(text: str) -> str:
    try:
        import ftfy
    except ImportError:
        pass
    else:
        text = ftfy.fix_text(text)
    return html.unescape(html.unescape(text)).strip()


def _clean_once(text: str) -> str:
    text = urllib.parse.unquote_plus(str(text)).strip().lower().replace("<person>", "person")
    text = _strip_markup(_URL.sub("", text))
    text = _CJK.sub("", re.sub(r"@[\w\d]+\b", "", text))
    text = _DASHES.sub("-", text)
    text = re.sub(r"[`´«»“”¨]", '"', text)
    text = re.sub(r"[‘’]", "'", text)
    text = re.sub(r"&quot;?|&amp", "", text)
    text = re.sub(r"\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}", " ", text)   # IP addresses
    text = re.sub(r"\d:\d\d\s+$", "", text)
    text = re.sub(r"\\n", " ", text)
    text = re.sub(r"#\d{1,3}\b|#\d{5,}\b|\b\d{6,}\b", "", text)
    text = re.sub(r"\S+\.(?:png|jpg|jpeg|bmp|webp|eps|pdf|apk|mp4)", "", text)   # file names
    text = re.sub(r"[\"']{2,}", '"', text)
    text = re.sub(r"\.{2,}", " ", text)
    text = _DECORATION.sub(" ", text)
    text = re.sub(r"\s+\.\s+", " ", text)
    if len(re.findall(r"[-_]", text)) > 3:   # this-is-a-slug
        text = re.sub(r"[-_]", " ", text)
    text = _fix_text(text)
    for pattern in _IDS:
        text = re.sub(pattern, "", text)
    for pattern in _SPAM:
        text = re.sub(pattern, "", text)
    text = re.sub(r"\b\d*[a-zA-Z]+\d+[a-zA-Z]+\d+[a-zA-Z\d]*\b", " ", text)
    text = re.sub(r"\b\d+\.?\d*[xх×]\d+\.?\d*\b", "", text)   # 1920x1080
    text = re.sub(r"\b\s+:\s+", ": ", text)
    text = re.sub(r"(\D[,./])\b", r"\1 ", text)
    text = re.sub(r"\s+", " ", text)
    text = re.sub(r"^[\"']([\w\W]+)[\"']$", r"\1", text)
    text = re.sub(r"^['_,\-:;]", "", text)
    text = re.sub(r"['_,\-:+]$", "", text)
    text = re.sub(r"^\.\S+$", "", text)
    return text.strip()


def clean_prompt(text: str) -> str:
    """A prompt cleaned as Open-Sora's sampler cleans it (twice, as it does)."""
    return _clean_once(_clean_once(text))


def with_scores(prompt: str, aesthetic: float | None = None, motion: float | None = None,
                camera_motion: str | None = None) -> str:
    """``prompt`` with Open-Sora's score suffixes, each only if the prompt lacks it."""
    if aesthetic is not None and "aesthetic score:" not in prompt:
        prompt = f"{prompt} aesthetic score: {aesthetic:.1f}."
    if motion is not None and "motion score:" not in prompt:
        prompt = f"{prompt} motion score: {motion:.1f}."
    if camera_motion is not None and "camera motion:" not in prompt:
        prompt = f"{prompt} camera motion: {camera_motion}."
    return prompt


def prepare_prompts(prompts: list[str], style: str, aesthetic: float | None = None, fps: float = 24,
                    motion: int | None = None) -> list[str]:
    """``style``: ``plain`` (as given), ``opensora`` (the aesthetic score appended, then
    cleaned: Open-Sora's order, so the suffix is cleaned too) or ``opensora2`` (Open-Sora 2.0's
    ``fps`` and ``motion`` suffixes, ``data/caption_suffix.py``)."""
    if style == "plain":
        return list(prompts)
    if style == "opensora2":
        from videodit.data.caption_suffix import sampling_prompt
        return [sampling_prompt(p, fps, motion) for p in prompts]
    return [clean_prompt(with_scores(p, aesthetic=aesthetic)) for p in prompts]
