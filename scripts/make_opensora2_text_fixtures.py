"""Write the golden fixtures of Open-Sora 2.0's text conditioning (tests/fixtures/opensora2/text_*)
with Open-Sora's own ``HFEmbedder``.

    python scripts/make_opensora2_text_fixtures.py /path/to/Open-Sora [--out tests/fixtures/opensora2]

The checkout is hpcaitech/Open-Sora main at 7ad6a96; ``scripts/opensora2_reference.py`` imports
``opensora/models/text/conditioner.py`` on this CPU machine. transformers' CLIP and T5 modules are
imported first: transformers probes ``flash_attn`` with ``importlib.util.find_spec`` when its
activations load, which the reference's spec-less stand-in module fails.

Two tiny, fully random models stand in for the releases, in Open-Sora's ``ckpts/`` layout so that
``HFEmbedder`` tells them apart as it does the real ones (``"openai" in from_pretrained``):

- ``text_ckpts/google/t5-v1_1-xxl/``: a ``T5EncoderModel`` as t5-v1_1 is built (gated-GELU FFN,
  no tied embeddings), width 16, 2 heads, 2 layers, relative buckets 8 / distance 32, and a
  ``T5Tokenizer`` over a small Unigram vocabulary (pad 0, EOS 1, unk 2 as T5's);
- ``text_ckpts/openai/clip-vit-large-patch14/``: a ``CLIPTextModel`` (width 16, 2 heads, 2 layers,
  77 positions, quick-GELU) and a byte-level BPE ``CLIPTokenizer``, EOS the last id and
  ``eos_token_id: 2`` in the config as openai/clip-vit-large-patch14 has (so transformers pools
  at the argmax id, the first EOS, as it does for the release).

Every weight is seeded random (norm scales around 1). ``text_cases.safetensors`` holds, for the
captions in ``text_cases.json`` (empty, unknown characters, with Open-Sora's suffix, longer than
512 T5 and 77 CLIP tokens): ``t5`` [B, 512, 16] and ``clip`` [B, 16] from ``HFEmbedder``;
``t5_null`` / ``clip_null``, its ``model_t5("")`` / ``model_clip("")`` (the dropout's
replacement, ``scripts/diffusion/train.py``); and ``t5_aligned``, T5 called as ``prepare`` calls it
under sequence parallelism (``added_tokens=ALIGN_TOKENS, seq_align=ALIGN_SP``), whose extra pad
tokens change every token's features (the trap videodit avoids). tests/models/test_opensora2_text.py
reads them; it never needs Open-Sora's code.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

WORDS = ("a", "red", "blue", "green", "circle", "square", "moves", "left", "right", "slowly", "the", "cat", "on",
         "fps", "motion", "score")
CAPTIONS = ["a red circle moves left", "", "The CAT on the square, slowly. 24 FPS, 4 motion score.",
            "a blue square ü moves right \u4e2d", " ".join(["green circle"] * 300)]
ALIGN_TOKENS, ALIGN_SP = 30, 4   # 512 + 30 image tokens is not a multiple of 4: 2 pads appended
T5_DIR, CLIP_DIR = Path("text_ckpts/google/t5-v1_1-xxl"), Path("text_ckpts/openai/clip-vit-large-patch14")


def save_t5(folder: Path) -> None:
    from transformers import T5Config, T5EncoderModel, T5Tokenizer

    letters = sorted(set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,"))
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(f"\u2581{w}", -3.0) for w in WORDS] + [(c, -6.0) for c in letters]
    T5Tokenizer(vocab=pieces, extra_ids=0).save_pretrained(folder)
    config = T5Config(vocab_size=len(pieces), d_model=16, d_ff=32, d_kv=8, num_layers=2, num_heads=2,
                      relative_attention_num_buckets=8, relative_attention_max_distance=32,
                      feed_forward_proj="gated-gelu", tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
                      decoder_start_token_id=0)
    _randomised(T5EncoderModel(config)).save_pretrained(folder)


def _bytes_to_unicode() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (the alphabet of a byte-level BPE)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def save_clip(folder: Path) -> None:
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    alphabet = _bytes_to_unicode()
    vocab = alphabet + [c + "</w>" for c in alphabet]
    merges = []
    for word in WORDS:   # each word built up left to right, its last merge ending the word
        piece = word[0]
        for i, c in enumerate(word[1:], 1):
            right = c + "</w>" if i == len(word) - 1 else c
            if f"{piece} {right}" not in merges:
                merges.append(f"{piece} {right}")
                vocab.append(piece + right)
            piece += right
    vocab = list(dict.fromkeys(vocab)) + ["<|startoftext|>", "<|endoftext|>"]   # EOS last, as released
    CLIPTokenizer(vocab={t: i for i, t in enumerate(vocab)},
                  merges=[tuple(m.split(" ")) for m in merges]).save_pretrained(folder)
    config = CLIPTextConfig(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=2, max_position_embeddings=77, hidden_act="quick_gelu",
                            bos_token_id=0, eos_token_id=2, pad_token_id=1, projection_dim=16)
    _randomised(CLIPTextModel(config)).save_pretrained(folder)


def _randomised(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter seeded random: norm scales around 1, the rest around 0."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.5 if "embed" in name else 0.3
            p.copy_(torch.randn_like(p) * scale + (1.0 if "norm" in name and name.endswith("weight") else 0.0))
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", help="hpcaitech/Open-Sora checkout (main, 7ad6a96)")
    parser.add_argument("--out", default=str(ROOT / "tests/fixtures/opensora2"))
    args = parser.parse_args()
    out = Path(args.out)
    torch.manual_seed(0)
    save_t5(out / T5_DIR)
    save_clip(out / CLIP_DIR)

    # transformers' modules before the stand-ins (see the module docstring).
    import transformers.activations  # noqa: F401
    import transformers.models.clip.modeling_clip  # noqa: F401
    import transformers.models.t5.modeling_t5  # noqa: F401
    from opensora2_reference import import_opensora2

    (conditioner,) = import_opensora2(args.checkout, "models.text.conditioner")
    t5 = conditioner.HFEmbedder(str(out / T5_DIR), max_length=512, torch_dtype=torch.float32).eval()
    clip = conditioner.HFEmbedder(str(out / CLIP_DIR), max_length=77, torch_dtype=torch.float32).eval()
    assert not t5.is_clip and clip.is_clip
    with torch.no_grad():
        cases = {"t5": t5(CAPTIONS), "clip": clip(CAPTIONS), "t5_null": t5(""), "clip_null": clip(""),
                 "t5_aligned": t5(CAPTIONS, added_tokens=ALIGN_TOKENS, seq_align=ALIGN_SP)}
    from safetensors.torch import save_file
    save_file({k: v.contiguous().float() for k, v in cases.items()}, out / "text_cases.safetensors")
    (out / "text_cases.json").write_text(json.dumps({
        "captions": CAPTIONS, "align_tokens": ALIGN_TOKENS, "align_sp": ALIGN_SP,
        "t5_tokens": [len(t5.tokenizer(c, truncation=False)["input_ids"]) for c in CAPTIONS],
        "clip_tokens": [len(clip.tokenizer(c, truncation=False)["input_ids"]) for c in CAPTIONS],
        "opensora": "hpcaitech/Open-Sora 7ad6a96", "transformers": transformers_version(),
    }, indent=1, ensure_ascii=False) + "\n")
    for name, t in cases.items():
        print(f"{name}: {tuple(t.shape)} max |x| {t.abs().max():.3f}")


def transformers_version() -> str:
    import transformers
    return transformers.__version__


if __name__ == "__main__":
    main()
