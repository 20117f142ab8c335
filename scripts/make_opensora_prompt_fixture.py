"""Write tests/fixtures/opensora/prompts.json: Open-Sora 1.2's own prompt preparation
(``append_score_to_prompts`` then ``text_preprocessing``) applied to a set of prompts, the
reference for videodit.data.prompts.

    python scripts/make_opensora_prompt_fixture.py --opensora /path/to/Open-Sora   # tag v1.2.0

Needs what Open-Sora's text module imports (transformers, ftfy, beautifulsoup4).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

PROMPTS = [
    "A red circle moving right",
    "a beautiful waterfall in a lush jungle, 4k, cinematic.",
    "  Two dogs   playing on the beach at sunset  ",
    "A time-lapse of clouds over the mountains...",
    "An astronaut riding a horse on mars (photorealistic) [high quality] {best}",
    "Check https://example.com/video and www.test.org for more!",
    "<b>bold</b> text with &amp; entities &quot;quoted&quot;",
    "“Smart quotes” and ‘single’ — dashes – everywhere",
    "@user42 posted: a cat sleeping on a sofa #123",
    "city-street-at-night-with-neon-lights",
    "A drone shot of a coastline, 1920x1080, free shipping",
    "The model jc6640 on page 12 of the catalogue",
    "a panda eating bamboo 熊猫 in the forest",
    "close-up of a flower: petals, stamen, pollen. slow motion",
    "a video aesthetic score: 5.0.",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opensora", required=True, help="Open-Sora checkout (tag v1.2.0)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests/fixtures/opensora/prompts.json"))
    args = parser.parse_args()
    root = Path(args.opensora)
    sys.path.insert(0, str(root))   # t5.py imports opensora.registry

    def load(name: str, relative: str):   # single files, without Open-Sora's package imports
        spec = importlib.util.spec_from_file_location(name, root / relative)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    t5 = load("opensora_t5", "opensora/models/text_encoder/t5.py")
    sys.modules.setdefault("opensora_t5", t5)
    source = (root / "opensora/utils/inference_utils.py").read_text()
    start = source.index("def append_score_to_prompts")
    namespace: dict = {}
    exec(source[start:source.index("\ndef ", start + 1)], namespace)   # the one function, from a trusted checkout
    cases = [{"prompt": p, "aesthetic": 6.5,
              "opensora": t5.text_preprocessing(namespace["append_score_to_prompts"]([p], aes=6.5)[0])}
             for p in PROMPTS]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(cases, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(cases)} prompts to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
