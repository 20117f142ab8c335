"""Open-Sora 2.0's text conditioning (videodit/models/mmdit/text.py) against Open-Sora's own
``HFEmbedder`` outputs, written by scripts/make_opensora2_text_fixtures.py with tiny random T5 and
CLIP text models in Open-Sora's ckpts/ layout."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from tolerance import assert_close, relative
from videodit.errors import UserError  # noqa: E402
from videodit.models.mmdit.text import load_opensora2_text  # noqa: E402
from videodit.models.text_base import drop_to_empty  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "opensora2"
# Bounds on the deviation relative to the expected output's max: ten times the worst measured across
# CPUs (AVX-512, AVX2, scalar kernels), thread counts and torch/transformers releases (docs/testing.md).
TEXT = 5e-4         # worst 4.4e-5 (T5; CLIP 2e-7)
CKPTS = FIXTURES / "text_ckpts"


@pytest.fixture(scope="module")
def cases():
    meta = json.loads((FIXTURES / "text_cases.json").read_text())
    return meta, load_file(FIXTURES / "text_cases.safetensors")


@pytest.fixture(scope="module")
def encoder():
    return load_opensora2_text(str(CKPTS), mask=False)


def test_equals_opensora_hfembedder(encoder, cases):
    meta, expected = cases
    assert (encoder.dim, encoder.pooled_dim, encoder.max_length) == (16, 16, 512)
    assert max(meta["t5_tokens"]) > 512 and max(meta["clip_tokens"]) > 77   # truncation is exercised
    y, mask = encoder.encode(meta["captions"])
    assert y.dtype == torch.float32 and bool(mask.all())   # no mask: every position is a token
    assert_close(y, expected["t5"], TEXT, "t5")
    assert_close(encoder.encode_pooled(meta["captions"]), expected["clip"], TEXT, "clip")
    # The dropout's replacement: the encoding of "" (not zeros), as train.py's null_txt / null_vec.
    assert_close(encoder.encode([""])[0], expected["t5_null"], TEXT, "t5 of the empty caption")
    assert_close(encoder.encode_pooled([""]), expected["clip_null"], TEXT, "clip of the empty caption")
    assert expected["t5_null"].abs().min() > 0


def test_features_depend_on_the_caption_alone(encoder, cases):
    """Open-Sora's seq_align (pads appended under sequence parallelism) changes every token's
    features; videodit's encoder has no such input: a caption encodes the same alone, in any batch."""
    meta, expected = cases
    captions = meta["captions"]
    assert expected["t5_aligned"].shape[1] == 512 + (-(512 + meta["align_tokens"]) % meta["align_sp"])
    assert relative(expected["t5_aligned"][:, :512], expected["t5"]) > 1e-3   # the trap, in Open-Sora's output
    y, _ = encoder.encode(captions)
    pooled = encoder.encode_pooled(captions)
    for i in (2,):
        alone_y, _ = encoder.encode([captions[i]])
        reordered = list(reversed(captions))
        assert torch.allclose(alone_y[0], y[i], atol=1e-6, rtol=0)
        assert torch.allclose(encoder.encode(reordered)[0][len(captions) - 1 - i], y[i], atol=1e-6, rtol=0)
        assert torch.allclose(encoder.encode_pooled([captions[i]])[0], pooled[i], atol=1e-6, rtol=0)


def test_masked_run(cases):
    """text.mask=true: T5 runs with its mask, pads are zero and masked, real tokens as transformers gives them."""
    from transformers import T5EncoderModel, T5Tokenizer
    meta, expected = cases
    masked = load_opensora2_text(str(CKPTS), max_length=64, mask=True)
    y, mask = masked.encode(meta["captions"][:3])
    t5_dir = CKPTS / "google" / "t5-v1_1-xxl"
    tokens = T5Tokenizer.from_pretrained(str(t5_dir))(meta["captions"][:3], padding="max_length", max_length=64,
                                                      truncation=True, return_tensors="pt")
    with torch.no_grad():
        ref = T5EncoderModel.from_pretrained(str(t5_dir)).eval()(tokens.input_ids, tokens.attention_mask)
    assert torch.equal(mask, tokens.attention_mask.bool()) and y.shape == (3, 64, 16)
    assert_close(y, ref.last_hidden_state * mask[..., None], TEXT, "masked t5")
    assert bool((y[~mask] == 0).all())
    assert relative(y[0, :6], expected["t5"][0, :6]) > 1e-3   # the mask changes the features


def test_folder_layouts_and_errors(cases, tmp_path):
    meta, expected = cases
    flat = tmp_path / "flat"
    shutil.copytree(CKPTS / "google" / "t5-v1_1-xxl", flat / "t5")
    shutil.copytree(CKPTS / "openai" / "clip-vit-large-patch14", flat / "clip")
    encoder = load_opensora2_text(str(flat))
    assert_close(encoder.encode_pooled(meta["captions"]), expected["clip"], TEXT, "clip")
    shutil.rmtree(flat / "clip")
    (tmp_path / "empty").mkdir()
    problems = {str(flat): "no clip/config.json", str(tmp_path / "empty"): "holds neither t5/ + clip/",
                str(tmp_path / "missing"): "is not an existing folder", None: "text.path is required"}
    shutil.copytree(CKPTS / "google" / "t5-v1_1-xxl", tmp_path / "swapped" / "clip")
    shutil.copytree(CKPTS / "google" / "t5-v1_1-xxl", tmp_path / "swapped" / "t5")
    problems[str(tmp_path / "swapped")] = "not 'clip_text_model'"
    for path, message in problems.items():
        with pytest.raises(UserError, match=re.escape(message)):
            load_opensora2_text(path)


def test_drop_to_empty_replaces_each_encoder_on_its_own(encoder):
    captions = ["a red circle", "a blue square", "the cat", "green"]
    y, mask = encoder.encode(captions)
    pooled = encoder.encode_pooled(captions)
    empty = (*encoder.encode([""]), encoder.encode_pooled([""]))
    drop, drop_pooled = torch.tensor([True, False, True, False]), torch.tensor([True, True, False, False])
    y2, mask2, pooled2 = drop_to_empty(y, mask, pooled, drop, drop_pooled, empty)
    for i in range(4):
        assert torch.equal(y2[i], empty[0][0] if drop[i] else y[i])
        assert torch.equal(mask2[i], empty[1][0] if drop[i] else mask[i])
        assert torch.equal(pooled2[i], empty[2][0] if drop_pooled[i] else pooled[i])


# --------------------------------------------------------------------------- plumbing


def test_unmasked_is_only_for_t5_clip():
    from videodit.components import build_text_encoder
    with pytest.raises(UserError, match=re.escape("text.mask=false (Open-Sora 2.0's unmasked T5) is for text.kind=t5")):
        build_text_encoder("toy", mask=False)
    assert build_text_encoder("toy").encode_pooled(["a"]) is None   # encoders without a pooled vector


def test_sampling_encodes_the_empty_caption_as_the_negative(encoder):
    """Open-Sora 2.0 samples both unconditional branches on "" through T5 and CLIP; an encoder
    without a pooled vector keeps the old behaviour (no negative unless one is given)."""
    from videodit.components import build_text_encoder
    from videodit.sample import negative_condition
    y, mask, pooled = negative_condition(encoder, None)
    assert torch.equal(y, encoder.encode([""])[0]) and torch.equal(pooled, encoder.encode_pooled([""]))
    assert len(negative_condition(encoder, "blurry")) == 3
    toy = build_text_encoder("toy")
    assert negative_condition(toy, None) is None and len(negative_condition(toy, "blurry")) == 2


@pytest.mark.parametrize("caption, fps, motion, want", [
    ("a cat", 24.0, "3.5", "a cat 24 FPS, 4 motion score."),           # int(x + 0.5), as datasets.py
    ("a cat", 23.976, None, "a cat 23.976 FPS."),
    ("a cat", 12.0, "", "a cat 12 FPS."),                              # an empty CSV cell: unknown
    ("a cat", float("nan"), float("nan"), "a cat"),                    # nothing known: nothing appended
])
def test_training_suffix(caption, fps, motion, want):
    from videodit.data.caption_suffix import training_caption
    assert training_caption(caption, fps, motion) == want


def test_the_dataset_appends_the_csv_motion_score(toy_dir, tmp_path):
    """data.caption_suffix=opensora2 reads score_vmafmotion where the CSV has it (empty cells: no
    motion part) and the fps of the frames the model sees (frame_interval 2: half the row's)."""
    from conftest import tiny_overrides
    from videodit.config import load_config
    from videodit.data.buckets.plan import BucketPlan
    from videodit.data.dataset import VideoDataset
    from videodit.data.metadata import read_metadata

    lines = (toy_dir / "train.csv").read_text().splitlines()
    rows = [lines[0] + ",score_vmafmotion"] + [f"{line},{'' if i else '3.5'}" for i, line in enumerate(lines[1:3])]
    csv = tmp_path / "train.csv"
    csv.write_text("\n".join(rows) + "\n")
    shutil.copytree(toy_dir / "videos", tmp_path / "videos")
    cfg = load_config("tiny", tiny_overrides(toy_dir, **{"data.csv": str(csv), "data.frame_interval": 2,
                                                         "data.caption_suffix": "opensora2"}))
    meta = read_metadata(csv, cache=None)
    dataset = VideoDataset(meta, BucketPlan(meta, cfg.data, 1, 0), frame_interval=2, caption_suffix="opensora2")
    samples = [dataset.load(i, 0, 0) for i in range(2)]
    assert [s["text"] for s in samples] == [f"{meta.text(0)} 4 FPS, 4 motion score.", f"{meta.text(1)} 4 FPS."]
    assert VideoDataset(meta, BucketPlan(meta, cfg.data, 1, 0)).load(0, 0, 0)["text"] == meta.text(0)


@pytest.mark.parametrize("prompt, motion, want", [
    ("a cat", 4, "a cat. 24 FPS. 4 motion score."),                    # inference.py: period, fps, motion
    (" a cat. ", None, "a cat. 24 FPS."),
    ("a cat. 16 FPS.", 4, "a cat. 16 FPS. 4 motion score."),           # an fps already there is kept
])
def test_sampling_suffix(prompt, motion, want):
    from videodit.data.prompts import prepare_prompts
    assert prepare_prompts([prompt], "opensora2", fps=24, motion=motion) == [want]


T5_CLIP = {"text.kind": "t5-clip", "text.path": str(CKPTS), "text.mask": False, "text.max_length": 64,
           "data.caption_suffix": "opensora2", "diffusion.caption_dropout": 0.5,
           "diffusion.pooled_caption_dropout": 0.5, "train.max_steps": 3, "train.deterministic": True}


@pytest.fixture(scope="module")
def t5_clip_cache(toy_dir, tmp_path_factory):
    """An fp32 feature cache of the toy data with Open-Sora 2.0's text encoders."""
    from conftest import tiny_overrides
    from videodit.cache import build_cache
    from videodit.config import load_config

    cache = tmp_path_factory.mktemp("t5_clip") / "cache"
    build_cache(load_config("tiny", tiny_overrides(toy_dir, **T5_CLIP)), cache, dtype="fp32", shard_size=16,
                log=lambda *a, **k: None)
    return cache


def test_training_carries_pooled_and_drops_each_encoder_to_the_empty_caption(toy_dir, tmp_path, t5_clip_cache):
    """The trainer encodes the suffixed captions through T5 and CLIP, drops tokens and pooled
    vectors each on its own draw to the encoding of "", and hands Conditions.pooled on; a feature
    cache stores the pooled vectors and "", and trains to the on-the-fly losses (fp32 cache)."""
    from conftest import tiny_overrides
    from videodit.config import load_config
    from videodit.data.feature_cache.format import read_manifest
    from videodit.train.trainer import Trainer

    common = tiny_overrides(toy_dir, **T5_CLIP)
    probe = Trainer(load_config("tiny", common), tmp_path / "probe")
    captured = []
    spec_inputs = probe.spec.model_inputs
    probe.spec.model_inputs = lambda x_t, t, cond: captured.append(cond) or spec_inputs(x_t, t, cond)
    try:
        batch = next(probe.batches())
        probe.prepare(batch)
    finally:
        del probe.spec.model_inputs
    cond = captured[0]
    assert cond.drop is None and cond.pooled.shape == (len(batch), 16)
    assert all(text.endswith("FPS.") for text in batch.text)   # data.caption_suffix reached the captions
    encoder = probe.text
    y, _ = encoder.encode(batch.text)
    pooled = encoder.encode_pooled(batch.text)
    empty_y, empty_pooled = encoder.encode([""])[0][0], encoder.encode_pooled([""])[0]
    dropped = [bool(torch.equal(cond.y[i], empty_y)) for i in range(len(batch))]
    dropped_pooled = [bool(torch.equal(cond.pooled[i], empty_pooled)) for i in range(len(batch))]
    for i in range(len(batch)):
        assert torch.equal(cond.y[i], empty_y if dropped[i] else y[i])
        assert torch.equal(cond.pooled[i], empty_pooled if dropped_pooled[i] else pooled[i])
    assert dropped != dropped_pooled   # independent draws (this seed: they differ)

    cache = t5_clip_cache
    manifest = read_manifest(cache)
    assert manifest["conditions"] == ["pooled"] and manifest["pooled_geometry"] == {"dim": 16}
    assert manifest["encoders"]["text"]["mask"] is False
    Trainer(load_config("tiny", common), tmp_path / "fly").fit()
    cached = Trainer(load_config("tiny", common + [f"data.cache={cache}"]), tmp_path / "cached")
    cached.fit()

    def losses(run):
        return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    a, b = losses(tmp_path / "cached"), losses(tmp_path / "fly")
    assert len(a) == 3 and all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a, b)), (a, b)


def test_a_cache_without_pooled_vectors_is_refused_in_one_line(toy_dir, tmp_path, t5_clip_cache):
    from conftest import tiny_overrides
    from videodit.config import load_config
    from videodit.data.feature_cache.training import build_cached_training_data

    common = tiny_overrides(toy_dir, **T5_CLIP)
    cache = tmp_path / "cache"
    shutil.copytree(t5_clip_cache, cache)
    manifest_path = cache / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["conditions"], manifest["pooled_geometry"]   # as a build that stored none would be
    manifest_path.write_text(json.dumps(manifest))
    cfg = load_config("tiny", common + [f"data.cache={cache}"])
    data = build_cached_training_data(cfg, batch_size=4, seed=0)
    with pytest.raises(UserError) as info:
        data.require_conditions(first_frame=False, image=False, pooled=True)
    assert "holds no pooled caption vectors" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("damage", ["missing", "garbage", "other shapes"])
def test_a_damaged_empty_caption_is_refused_in_one_line(t5_clip_cache, tmp_path, damage):
    from safetensors.torch import save_file
    from videodit.data.feature_cache.format import read_manifest
    from videodit.data.feature_cache.reader import CachedTextEncoder

    cache = tmp_path / "cache"
    shutil.copytree(t5_clip_cache, cache)
    stored = cache / "empty_caption.safetensors"
    text = CachedTextEncoder(read_manifest(cache), cache)
    assert torch.equal(text.encode_pooled([""]), load_file(stored)["pooled"])
    with pytest.raises(UserError, match="builds no text encoder"):
        text.encode(["a red circle"])
    if damage == "missing":
        stored.unlink()
    elif damage == "garbage":
        stored.write_bytes(b"\x10" + bytes(7) + b"not a header at all")
    else:
        save_file({"y": torch.zeros(1, 3, 16), "mask": torch.ones(1, 3, dtype=torch.bool),
                   "pooled": torch.zeros(1, 16)}, str(stored))
    with pytest.raises(UserError) as info:
        CachedTextEncoder(read_manifest(cache), cache).encode([""])
    assert "empty_caption.safetensors" in str(info.value) and "cache build" in str(info.value)
    assert "\n" not in str(info.value)
