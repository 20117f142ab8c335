"""Open-Sora 1.2 bucket_config: tables, parsing, assignment rules, randomness, errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from videodit.data.buckets import (OPENSORA_V12_STAGE1, ASPECT_RATIOS, RESOLUTION_NAMES, RESOLUTION_PIXELS,
                                   BucketConfig, DropReason, assign_buckets,
                                   assign_buckets_reference, build_buckets,
                                   load_opensora_bucket_config, parse_bucket_config, uniform)
from videodit.cli import main
from videodit.errors import UserError

# Open-Sora 1.2 configs/opensora-v1-2/train/stage1.py and stage3.py, as written there.
STAGE1 = OPENSORA_V12_STAGE1
STAGE3 = {
    "144p": {1: (1.0, 475), 51: (1.0, 51), 102: (1.0, 27), 204: (1.0, 13), 408: (1.0, 6)},
    "256": {1: (1.0, 297), 51: (0.5, 20), 102: (0.5, 10), 204: (0.5, 5), 408: ((0.5, 0.5), 2)},
    "240p": {1: (1.0, 297), 51: (0.5, 20), 102: (0.5, 10), 204: (0.5, 5), 408: ((0.5, 0.4), 2)},
    "360p": {1: (1.0, 141), 51: (0.5, 8), 102: (0.5, 4), 204: (0.5, 2), 408: ((0.5, 0.3), 1)},
    "512": {1: (1.0, 141), 51: (0.5, 8), 102: (0.5, 4), 204: (0.5, 2), 408: ((0.5, 0.2), 1)},
    "480p": {1: (1.0, 89), 51: (0.5, 5), 102: (0.5, 3), 204: ((0.5, 0.5), 1), 408: (0.0, None)},
    "720p": {1: (0.3, 36), 51: (0.2, 2), 102: (0.1, 1), 204: (0.0, None)},
    "1024": {1: (0.3, 36), 51: (0.1, 2), 102: (0.1, 1), 204: (0.0, None)},
    "1080p": {1: (0.1, 5)},
    "2048": {1: (0.05, 5)},
}


def assign_one(config, t, h, w, **kw):
    """(resolution, num_frames, ratio, height, width) of one clip, or its drop reason."""
    kw = {"seed": 0, "epoch": 0, **kw}
    a = assign_buckets([t], [h], [w], config, **kw)
    ref = assign_buckets_reference([t], [h], [w], config, **kw)
    assert a.bucket[0] == ref.bucket[0] and a.reason[0] == ref.reason[0]
    if a.bucket[0] < 0:
        return DropReason(a.reason[0])
    return tuple(a.buckets[a.bucket[0]])[:5]


def fractions(a, n):
    """Fraction of rows per (resolution, num_frames), plus 'dropped'."""
    out: dict = {}
    for b in a.bucket:
        key = "dropped" if b < 0 else a.buckets[b][:2]
        out[key] = out.get(key, 0) + 1 / n
    return out


# ----------------------------------------------------------------------------- tables

def test_resolution_names_and_pixels_match_opensora():
    assert RESOLUTION_NAMES[:13] == ("144p", "256", "240p", "360p", "512", "480p", "720p", "1024",
                                     "1080p", "2k", "2048", "2880", "4k")
    assert RESOLUTION_PIXELS["240p"] == 102240 and RESOLUTION_PIXELS["480p"] == 409920
    assert RESOLUTION_PIXELS["2880"] == RESOLUTION_PIXELS["4k"] == 8294400


@pytest.mark.parametrize("name, key, hw", [
    # values copied from Open-Sora 1.2 opensora/datasets/aspect.py
    ("720p", "0.56", (720, 1280)), ("720p", "0.54", (706, 1306)), ("720p", "2.08", (1386, 666)),
    ("480p", "0.56", (480, 854)), ("360p", "1.00", (480, 480)), ("1080p", "0.75", (1248, 1664)),
    ("4k", "0.54", (2118, 3918)), ("2k", "1.33", (2218, 1664)),
    ("144p", "0.38", (117, 312)), ("144p", "2.08", (277, 132)),  # 144p: truncation
    ("240p", "0.67", (262, 393)), ("480p", "0.48", (444, 925)), ("480p", "1.33", (740, 555)),
    ("1024", "0.57", (768, 1344)), ("512", "0.40", (320, 800)), ("256", "4.00", (512, 128)),
    ("2048", "1.00", (2048, 2048)), ("2880", "0.25", (1408, 5760)), ("2880", "1.70", (3584, 2112)),
])
def test_aspect_ratio_entries_match_opensora(name, key, hw):
    assert ASPECT_RATIOS[name][key] == hw


def test_tables_are_ascending_with_opensora_sizes():
    for name, table in ASPECT_RATIOS.items():
        keys = [float(k) for k in table]
        assert keys == sorted(keys) and len(set(keys)) == len(keys)
        assert all(k == f"{float(k):.2f}" for k in table)
        if name in OPENSORA2_TABLES:   # test_opensora2_tables_are_its_own
            continue
        if name.endswith("px"):   # videodit's small tables: N*N pixels, sides multiples of 4
            side = int(name[:-2])
            assert table["1.00"] == (side, side) and len(table) == 5
            assert all(h % 4 == 0 and w % 4 == 0 for h, w in table.values())
        elif name.startswith(("wan", "ltx")):   # released sizes: test_released_size_resolutions
            assert len(table) == 5
        else:
            assert len(table) == (40 if name in ("256", "512", "1024", "2048", "2880") else 17)


OPENSORA2_TABLES = json.loads((Path(__file__).parents[1] / "fixtures/opensora2/aspect_tables.json").read_text())


def test_opensora2_tables_are_its_own():
    """Open-Sora 2.0's bucket_config names (256px, 768px, ...) give the sizes its own aspect.py builds
    (scripts/make_opensora2_bucket_fixture.py), keyed by the named ratio it picks a clip's by."""
    for name, table in OPENSORA2_TABLES.items():
        assert ASPECT_RATIOS[name] == {key: tuple(hw) for key, hw in table.items()}, name
        side = int(name.split("px")[0])
        assert RESOLUTION_PIXELS[name] == side * side   # what the 0.8 criterion compares a clip with
        step = 32 if name.endswith("d32") else 16
        assert all(h % step == 0 and w % step == 0 for h, w in ASPECT_RATIOS[name].values())


# ------------------------------------------------------------------- assignment rules

def test_pixel_criterion_boundary():
    cfg = {"240p": {1: (1.0, 8)}, "144p": {1: (1.0, 16)}}
    # 0.8 x 102240 = 81792 pixels exactly qualifies for 240p; one pixel column less does not.
    assert assign_one(cfg, 1, 284, 288)[:2] == ("240p", 1)
    assert assign_one(cfg, 1, 284, 287)[:2] == ("144p", 1)
    # 0.8 x 36864 = 29491.2: 146x202 = 29492 is in, 145x203 = 29435 is below everything.
    assert assign_one(cfg, 1, 146, 202)[:2] == ("144p", 1)
    assert assign_one(cfg, 1, 145, 203) == DropReason.BELOW_EVERY_RESOLUTION


def test_larger_resolution_wins_and_clip_may_be_upscaled():
    cfg = {"720p": {1: (1.0, 4)}, "144p": {1: (1.0, 16)}}
    # 640x1152 = 737280 = 0.8 x 720p: it goes to 720p and is resized up to 720x1280.
    assert assign_one(cfg, 1, 640, 1152) == ("720p", 1, "0.56", 720, 1280)


def test_image_buckets():
    cfg = {"360p": {51: (1.0, 4)}, "144p": {1: (1.0, 16), 51: (1.0, 8)}}
    assert assign_one(cfg, 1, 720, 1280)[:2] == ("144p", 1)  # 360p has no image entry
    assert assign_one({"144p": {51: (1.0, 8)}}, 1, 720, 1280) == DropReason.NO_IMAGE_BUCKET
    # A video never takes the num_frames=1 entry; it moves down to a resolution with lengths.
    video_cfg = {"720p": {1: (1.0, 4)}, "144p": {51: (1.0, 8)}}
    assert assign_one(video_cfg, 300, 720, 1280)[:2] == ("144p", 51)
    assert assign_one({"720p": {1: (1.0, 4)}}, 300, 720, 1280) == DropReason.NO_VIDEO_BUCKET


def test_lengths_are_strict_and_scaled_by_frame_interval():
    cfg = {"144p": {51: (1.0, 4), 102: (1.0, 2)}}
    assert assign_one(cfg, 103, 144, 256)[:2] == ("144p", 102)
    assert assign_one(cfg, 102, 144, 256)[:2] == ("144p", 51)  # T > 102 needed, not >=
    assert assign_one(cfg, 52, 144, 256)[:2] == ("144p", 51)
    assert assign_one(cfg, 51, 144, 256) == DropReason.TOO_SHORT
    # frame_interval=2: 102 needs T > 204, 51 needs T > 102.
    assert assign_one(cfg, 205, 144, 256, frame_interval=2)[:2] == ("144p", 102)
    assert assign_one(cfg, 204, 144, 256, frame_interval=2)[:2] == ("144p", 51)
    assert assign_one(cfg, 102, 144, 256, frame_interval=2) == DropReason.TOO_SHORT
    assert assign_one(cfg, 1, 144, 256, frame_interval=2) == DropReason.NO_IMAGE_BUCKET


def test_p_frames_moves_clip_to_shorter_length():
    never = {"144p": {102: ((1.0, 0.0), 2), 51: (1.0, 4)}}
    always = {"144p": {102: ((1.0, 1.0), 2), 51: (1.0, 4)}}
    assert assign_one(never, 300, 144, 256)[:2] == ("144p", 51)
    assert assign_one(always, 300, 144, 256)[:2] == ("144p", 102)
    # With only that one length, the skipped clip has nowhere shorter to go.
    only = {"144p": {102: ((1.0, 0.0), 2)}}
    assert assign_one(only, 300, 144, 256) == DropReason.FRAME_DRAW


def test_zero_keep_entry_sends_clip_to_next_resolution_not_shorter_length():
    # Open-Sora stage 3 style: at 480p, clips longer than 408 frames pick the 408 entry,
    # whose (0.0, None) rejects them at 480p altogether; they do not fall back to 204.
    cfg = {"480p": {408: (0.0, None), 204: (1.0, 1)}, "144p": {408: (1.0, 6), 51: (1.0, 8)}}
    assert assign_one(cfg, 500, 480, 854)[:2] == ("144p", 408)
    assert assign_one(cfg, 300, 480, 854) == ("480p", 204, "0.56", 480, 854)
    alone = {"480p": {408: (0.0, None), 204: (1.0, 1)}}
    assert assign_one(alone, 500, 480, 854) == DropReason.ZERO_KEEP_PROB
    assert all(b.num_frames != 408 for b in build_buckets(alone))  # unreachable: not listed


# The worked examples of docs/buckets.md, through Open-Sora 1.2's stage-3 config.

def test_docs_example_image_cascades_down_resolutions():
    a = assign_buckets(np.ones(N, int), np.full(N, 1080), np.full(N, 1920), STAGE3, seed=42, epoch=0)
    f = fractions(a, N)
    # 1080p keeps 0.1; losers try 1024 (0.3), then 720p (0.3), then 480p (1.0).
    expected = {("1080p", 1): 0.1, ("1024", 1): 0.27, ("720p", 1): 0.189, ("480p", 1): 0.441}
    assert f.keys() == expected.keys()
    assert all(within(f[k], p) for k, p in expected.items())
    # 16:9 is "0.56" in Open-Sora's tables but "0.57" (768x1344) in PixArt's 1024 table.
    sizes = {a.buckets[b][:1] + a.buckets[b][2:5] for b in a.bucket}
    assert sizes == {("1080p", "0.56", 1080, 1920), ("1024", "0.57", 768, 1344),
                     ("720p", "0.56", 720, 1280), ("480p", "0.56", 480, 854)}


def test_docs_example_300_frame_720p_clip():
    a = assign_buckets(np.full(N, 300), np.full(N, 720), np.full(N, 1280), STAGE3, seed=42, epoch=0)
    f = fractions(a, N)
    # 1024 and 720p pick their 204 entry, (0.0, None): both are skipped. At 480p the 204
    # entry's p_frames=0.5 gate sends half to 102; each keeps half; losers go to 512, ...
    expected = {("480p", 204): 0.25, ("480p", 102): 0.25, ("512", 204): 0.25,
                ("360p", 204): 0.125, ("240p", 204): 0.0625, ("256", 204): 0.03125,
                ("144p", 204): 0.03125}
    assert f.keys() == expected.keys()
    assert all(within(f[k], p) for k, p in expected.items())


def test_docs_example_500_frame_clip_skips_480p():
    a = assign_buckets(np.full(N, 500), np.full(N, 720), np.full(N, 1280), STAGE3, seed=42, epoch=0)
    f = fractions(a, N)
    # 480p's longest fitting entry is 408 = (0.0, None), so 480p is skipped entirely.
    expected = {("512", 408): 0.1, ("512", 204): 0.4, ("360p", 408): 0.075, ("360p", 204): 0.175,
                ("240p", 408): 0.05, ("240p", 204): 0.075, ("256", 408): 0.03125,
                ("256", 204): 0.03125, ("144p", 408): 0.0625}
    assert f.keys() == expected.keys()
    assert all(within(f[k], p) for k, p in expected.items())


def test_docs_example_drops():
    assert assign_one(STAGE3, 51, 1080, 1920) == DropReason.TOO_SHORT  # needs > 51 frames
    a = assign_buckets(np.full(2000, 52), np.full(2000, 1080), np.full(2000, 1920), STAGE3,
                       seed=0, epoch=0)
    assert a.kept.all() and {a.buckets[b].num_frames for b in a.bucket} == {51}
    assert assign_one(STAGE3, 1, 100, 100) == DropReason.BELOW_EVERY_RESOLUTION
    # frame_interval=2: 150 frames fit only 51 (needs > 102), not 102 (needs > 204).
    a = assign_buckets(np.full(2000, 150), np.full(2000, 720), np.full(2000, 1280), STAGE3,
                       seed=0, epoch=0, frame_interval=2)
    assert {a.buckets[b].num_frames for b in a.bucket[a.kept]} == {51}


@pytest.mark.parametrize("h, w, key", [
    (1080, 1920, "0.56"), (1920, 1080, "1.78"), (1000, 1000, "1.00"),
    (600, 1000, "0.62"),  # 0.60: 0.02 from 0.62, 0.04 from 0.56
    (1000, 2390, "0.43"),  # cinema 2.39:1 = 0.418
    (2000, 500, "2.08"),  # 4.0 is beyond the table: the largest key
])
def test_nearest_aspect_ratio(h, w, key):
    res, _, got, th, tw = assign_one({"144p": {1: (1.0, 16)}}, 1, h, w)
    assert got == key and (th, tw) == ASPECT_RATIOS["144p"][key]


def test_nearest_ratio_in_pixart_table():
    # 1024's keys are h/w of PixArt sizes: 0.5 sits exactly on "0.50".
    assert assign_one({"1024": {1: (1.0, 4)}}, 1, 1024, 2048)[2:] == ("0.50", 704, 1408)


# ------------------------------------------------------------------ probabilities

N = 20_000


def within(got, expected, n=N):
    return abs(got - expected) <= 5 * np.sqrt(expected * (1 - expected) / n) + 1e-9


def test_keep_probability_fractions_and_fall_through():
    cfg = {"240p": {1: (0.4, 8)}, "144p": {1: (0.5, 16)}}
    a = assign_buckets(np.ones(N, int), np.full(N, 320), np.full(N, 320), cfg, seed=1, epoch=0)
    f = fractions(a, N)
    # Losers at 240p try 144p: 0.4 | 0.6 x 0.5 | 0.6 x 0.5 dropped.
    assert within(f[("240p", 1)], 0.4) and within(f[("144p", 1)], 0.3) and within(f["dropped"], 0.3)
    assert (a.reason[a.bucket < 0] == DropReason.KEEP_DRAW).all()


def test_p_frames_fractions():
    cfg = {"144p": {102: ((0.5, 0.33), 2), 51: (1.0, 4)}}
    a = assign_buckets(np.full(N, 300), np.full(N, 144), np.full(N, 256), cfg, seed=2, epoch=0)
    f = fractions(a, N)
    # Gate passes 33%, then the keep coin keeps half of those; a lost coin leaves 144p
    # (the only resolution), so those rows are dropped. Gate failures go to 51.
    assert within(f[("144p", 102)], 0.165) and within(f[("144p", 51)], 0.67)
    assert within(f["dropped"], 0.165)


def test_stage1_keeps_every_video_it_can_at_144p():
    rng = np.random.default_rng(0)
    t = rng.integers(52, 1000, 5000)
    a = assign_buckets(t, np.full(5000, 720), np.full(5000, 1280), STAGE1, seed=0, epoch=0)
    assert a.kept.all()  # 144p keeps with probability 1 at every length


# ------------------------------------------------------------------ determinism

def random_rows(n, seed):
    rng = np.random.default_rng(seed)
    t = np.where(rng.random(n) < 0.3, 1, rng.integers(2, 900, n))
    return t, rng.integers(50, 2400, n), rng.integers(50, 2400, n)


def test_deterministic_and_epoch_dependent():
    t, h, w = random_rows(4000, 0)
    a = assign_buckets(t, h, w, STAGE1, seed=7, epoch=1)
    b = assign_buckets(t, h, w, STAGE1, seed=7, epoch=1)
    assert np.array_equal(a.bucket, b.bucket) and np.array_equal(a.reason, b.reason)
    c = assign_buckets(t, h, w, STAGE1, seed=7, epoch=2)
    d = assign_buckets(t, h, w, STAGE1, seed=8, epoch=1)
    assert (a.bucket != c.bucket).mean() > 0.1 and (a.bucket != d.bucket).mean() > 0.1
    # Open-Sora seeds with seed + epoch, so (7, 2) and (8, 1) coincide there; not here.
    assert (c.bucket != d.bucket).mean() > 0.1


def test_draws_depend_on_sample_id_not_row_position():
    t, h, w = random_rows(3000, 1)
    full = assign_buckets(t, h, w, STAGE1, seed=3, epoch=0)
    perm = np.random.default_rng(0).permutation(3000)[:1000]  # a shard, in another order
    part = assign_buckets(t[perm], h[perm], w[perm], STAGE1, seed=3, epoch=0, sample_ids=perm)
    assert np.array_equal(part.bucket, full.bucket[perm])


def test_uniform_draws_are_in_unit_interval_and_uncorrelated():
    u = np.array([uniform(0, 0, i, "144p", 51, 1) for i in range(5000)])
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.02
    v = np.array([uniform(0, 0, i, "144p", 51, 0) for i in range(5000)])
    assert abs(np.corrcoef(u, v)[0, 1]) < 0.05


@pytest.mark.parametrize("config, frame_interval", [
    (STAGE1, 1), (STAGE3, 1), (STAGE3, 3),
    ({"4k": {1: (0.5, 1), 51: ((0.5, 0.5), 1)}, "2880": {1: (0.5, 1), 51: (0.7, 1)},
      "2k": {102: ((0.3, 0.6), 1), 51: (0.0, None)}, "256": {1: (0.2, 4), 17: (0.9, 2)}}, 2),
])
def test_vectorized_equals_reference(config, frame_interval):
    t, h, w = random_rows(3000, 5)
    h[:200], w[:200] = 284, 288 + np.arange(200) % 3 - 1  # around the 240p boundary
    t[200:400] = 51 * frame_interval + np.arange(200) % 3 - 1  # around a length boundary
    kw = dict(seed=11, epoch=4, frame_interval=frame_interval)
    a = assign_buckets(t, h, w, config, **kw)
    r = assign_buckets_reference(t, h, w, config, **kw)
    assert np.array_equal(a.bucket, r.bucket) and np.array_equal(a.reason, r.reason)
    assert a.bucket.dtype == np.int32 and a.reason.dtype == np.int8


def test_assignment_helpers():
    a = assign_buckets([1, 60, 10, 1], [1080, 1080, 1080, 10], [1920, 1920, 1920, 10],
                       {"144p": {1: (1.0, 16), 51: (1.0, 8)}}, seed=0, epoch=0)
    assert a.kept.tolist() == [True, True, False, False]
    t, h, w = a.target_sizes()
    assert t.tolist() == [1, 51, -1, -1] and h.tolist() == [144, 144, -1, -1]
    assert a.reason_counts() == {DropReason.KEPT: 2, DropReason.TOO_SHORT: 1,
                                 DropReason.BELOW_EVERY_RESOLUTION: 1}
    assert a.bucket_counts().sum() == 2 and "too short" in a.summary()


# ------------------------------------------------------------------ parsing

FAKE_OPENSORA_CONFIG = '''
import this_module_does_not_exist
raise RuntimeError("executing this config is not allowed")

# bucket_config = {"144p": {1: (1.0, 1)}}
bucket_config = {"720p": {1: (0.5, 2)}}  # overridden below, as Open-Sora's files do
bucket_config = {  # 12s/it
    "144p": {1: (1.0, 475), 51: (1.0, 51), 102: ((1.0, 0.33), 27)},
    # ---
    "480p": {1: (0.5, 89), 408: (0.0, None)},
}
model = dict(type="STDiT3-XL/2", from_pretrained=open("/nonexistent").read())
'''


def test_load_python_config_without_executing(tmp_path):
    path = tmp_path / "stage.py"
    path.write_text(FAKE_OPENSORA_CONFIG)
    raw = load_opensora_bucket_config(path)
    assert raw == {"144p": {1: (1.0, 475), 51: (1.0, 51), 102: ((1.0, 0.33), 27)},
                   "480p": {1: (0.5, 89), 408: (0.0, None)}}
    cfg = parse_bucket_config(raw)
    assert [(e.resolution, e.num_frames) for e in cfg.entries] == [
        ("480p", 408), ("480p", 1), ("144p", 102), ("144p", 51), ("144p", 1)]
    assert cfg.entries_for("144p")[0].frame_prob == 0.33
    assert cfg.to_dict()["144p"][102] == ((1.0, 0.33), 27)


def test_parse_yaml_lists_and_string_keys():
    text = """
    256: {"1": [0.4, 297], "102": [[0.5, 0.33], 10]}
    144p: {1: [1.0, 475], 408: [0.0, null]}
    """
    cfg = parse_bucket_config(yaml.safe_load(text))
    assert isinstance(cfg, BucketConfig) and cfg.resolutions() == ("256", "144p")
    assert cfg.to_dict() == {"256": {102: ((0.5, 0.33), 10), 1: (0.4, 297)},
                             "144p": {408: (0.0, None), 1: (1.0, 475)}}
    assert parse_bucket_config(cfg) is cfg


def test_equal_pixel_counts_keep_config_order():
    assert parse_bucket_config({"4k": {1: (1, 1)}, "2880": {1: (1, 1)}}).resolutions() == ("4k", "2880")
    assert parse_bucket_config({"2880": {1: (1, 1)}, "4k": {1: (1, 1)}}).resolutions() == ("2880", "4k")


@pytest.mark.parametrize("config, match", [
    ({"300p": {1: (1.0, 4)}}, r"unknown resolution '300p'.*144p, 256, 240p"),
    ({"144p": {1: (-0.1, 4)}}, r"\[1\] has probability -0.1.*\[0, 1\]"),
    ({"144p": {1: (1.5, 4)}}, r"probability 1.5"),
    ({"144p": {51: ((0.5, -1), 4)}}, r"probability -1"),
    ({"144p": {51: (0.5, None)}}, r"batch size None is not a positive integer"),
    ({"144p": {51: (0.5, 0)}}, r"batch size 0"),
    ({"144p": {51: (0.5, 0.3)}}, r"for \(p_keep, p_frames\) write \(\(0.5, 0.3\), batch_size\)"),
    ({"144p": {51: 0.5}}, r"\[51\] = 0.5 is not \(keep_prob, batch_size\)"),
    ({"144p": {51: (0.5, 4, 1)}}, r"is not \(keep_prob, batch_size\)"),
    ({"144p": {1: ((0.5, 0.5), 4)}}, r"num_frames=1 takes one keep probability"),
    ({"144p": {"2s": (1.0, 4)}}, r"key '2s' is not a frame count"),
    ({"144p": {0: (1.0, 4)}}, r"key 0 is not a frame count"),
    ({"144p": {51: (1.0, 4), "51": (1.0, 4)}}, r"num_frames 51 twice"),
    ({"144p": {}}, r"must be a non-empty dict"),
    ({}, r"bucket_config must be a non-empty dict"),
    ([("144p", {})], r"bucket_config must be a non-empty dict"),
    ({"144p": {1: (0.0, None)}}, r"every bucket_config entry has keep probability 0"),
    ({"144p": {1: (1.0, 10**30)}}, r"\[1\] batch size 1000000000000000000000000000000 is more than the 65,536 samples "
                                   r"a bucket batch may hold \(per GPU\); give at most 65,536"),
    ({"144p": {1: (1.0, 4), 51: (0.0, 65537)}}, r"\[51\] batch size 65537 is more than the 65,536"),
    ({"144p": {1: (1.0, 10**400)}}, r"batch size <an integer of about 401 digits> is more than the 65,536"),
])
def test_config_errors(config, match):
    with pytest.raises(UserError, match=match) as err:
        parse_bucket_config(config)
    assert "\n" not in str(err.value)


def test_the_largest_batch_size_is_taken():
    assert parse_bucket_config({"144p": {1: (1.0, 65536)}}).entries[0].batch_size == 65536


@pytest.mark.parametrize("command", [["plan", "{config}", "--gpu-mem", "80GiB"], ["buckets", "{csv}", "--config", "{config}"],
                                     ["config", "show", "{config}"]])
def test_a_huge_bucket_batch_size_is_one_line_in_every_command(tmp_path, capsys, command):
    csv = tmp_path / "meta.csv"
    csv.write_text("path,text,num_frames,height,width,aspect_ratio,fps\na.mp4,t,51,144,256,0.56,24\n")
    config = tmp_path / "c.yaml"
    config.write_text(f"data:\n  csv: {csv}\n  bucket_config:\n    144p: {{1: [1.0, {10**30}], 51: [1.0, 4]}}\n")
    assert main([a.format(config=config, csv=csv) for a in command]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: bucket_config['144p'][1] batch size 10000") and captured.err.count("\n") == 1
    assert "more than the 65,536 samples a bucket batch may hold" in captured.err and captured.out == ""


def test_zero_probability_allows_missing_batch_size():
    cfg = parse_bucket_config({"144p": {1: (1.0, 4), 51: (0.0, None), 102: (0.0, 0)}})
    assert [e.batch_size for e in cfg.entries] == [None, None, 4]


@pytest.mark.parametrize("text, match", [
    (None, r"cannot read Open-Sora config"),
    ("x = 1\n", r"no top-level `bucket_config = \{...\}`"),
    ("bucket_config = dict(a=1)\n", r"\(line 1\) is not a plain literal"),
    ("bucket_config = [1, 2]\n", r"is a list, not a dict"),
    ("bucket_config = {\n", r"not valid Python"),
])
def test_load_errors(tmp_path, text, match):
    path = tmp_path / "cfg.py"
    if text is not None:
        path.write_text(text)
    with pytest.raises(UserError, match=match) as err:
        load_opensora_bucket_config(path)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_frames=[1, 2], heights=[10], widths=[10, 10]), r"heights has 1 rows but num_frames has 2"),
    (dict(heights=[0, 10]), r"heights has 1 values outside \[1, 2147483647\] \(first at row 0: 0\)"),
    (dict(num_frames=[1.0, np.nan]), r"num_frames has 1 missing or non-integer values"),
    (dict(widths=["a", "b"]), r"widths must be integers"),
    (dict(frame_interval=0), r"frame_interval must be an integer >= 1"),
    (dict(epoch=-1), r"epoch must be an integer >= 0"),
    (dict(seed=1.5), r"seed must be an integer"),
])
def test_input_errors(kwargs, match):
    args = dict(num_frames=[1, 60], heights=[100, 100], widths=[100, 100],
                config={"144p": {1: (1.0, 4)}}, seed=0, epoch=0)
    args.update(kwargs)
    with pytest.raises(UserError, match=match) as err:
        assign_buckets(args.pop("num_frames"), args.pop("heights"), args.pop("widths"),
                       args.pop("config"), **args)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------ released sizes: Wan 2.1's, LTX-2's

SIZED_BUCKETS = {"wan720p": {81: (1.0, 1)}, "wan480p": {1: (1.0, 8), 81: (1.0, 2)}, "ltx544p": {49: (1.0, 1)}}


@pytest.mark.parametrize("t, h, w, expected", [
    (97, 480, 854, ("wan480p", 81, "0.58", 480, 832)),     # 16:9 480p video -> Wan's 832x480
    (97, 854, 480, ("wan480p", 81, "1.73", 832, 480)),     # and upright
    (97, 720, 1280, ("wan720p", 81, "0.56", 720, 1280)),   # 720p keeps its size
    (97, 720, 960, ("wan480p", 81, "0.76", 544, 720)),     # 4:3 at 691,200 px: below 0.8 x 720p
    (1, 1000, 1000, ("wan480p", 1, "1.00", 624, 624)),     # a square image
    (60, 544, 960, ("ltx544p", 49, "0.57", 544, 960)),     # LTX's trainer's 960x544 bucket
    (60, 960, 544, ("ltx544p", 49, "1.76", 960, 544)),     # and upright
    (60, 600, 800, ("ltx544p", 49, "0.74", 640, 864)),     # 4:3 near its pixel count
])
def test_released_size_resolutions(t, h, w, expected):
    """Released sizes as bucket resolutions: landscape and portrait as the model samples them, 4:3
    and square at the same pixel count, every side a multiple of the VAE's grid (Wan: 16, VAE 8 x
    patch 2; LTX-2: 32). A clip must be longer than a bucket's length, as in Open-Sora: 97 frames
    for the 81-frame buckets, 60 for LTX's 49."""
    family = ("ltx544p",) if expected[0] == "ltx544p" else ("wan480p", "wan720p")
    assert assign_one({name: SIZED_BUCKETS[name] for name in family}, t, h, w) == expected
    assert all(side % grid == 0 for name, grid in (("wan480p", 16), ("wan720p", 16), ("ltx544p", 32))
               for hw in ASPECT_RATIOS[name].values() for side in hw)


def test_a_bucket_config_file_with_an_alias_bomb_is_refused_in_one_line(tmp_path):
    """data.bucket_config_file is a file users share: its YAML aliases are bounded as configs' are."""
    from dataclasses import replace

    from videodit.config import DataConfig
    from videodit.data.buckets.config import resolve_bucket_config

    levels = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    path = tmp_path / "buckets.yaml"
    path.write_text("\n".join(levels) + "\nbucket_config: *a8\n")
    with pytest.raises(UserError, match="refused") as err:
        resolve_bucket_config(replace(DataConfig(), bucket_config_file=str(path)))
    assert "\n" not in str(err.value)
