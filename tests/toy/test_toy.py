"""The toy dataset generator and the metrics that evaluate generated toy clips."""

import csv
import numpy as np
import pytest

from videodit.toy import make as toy
from videodit.toy.make import (COLOURS, CSV_COLUMNS, DIRECTIONS, HELDOUT, SHAPES,
                               all_combinations, caption, make_toy_dataset, parse_caption,
                               render_clip, seen_combinations)
from videodit.data.video import IMAGE_FPS, read_video
from videodit.data.video_write import write_video
from videodit.errors import UserError
from videodit.toy.metrics import (dominant_colour, measure_clip, motion_direction,
                                       score)

# Small enough to keep the file fast, large enough to exercise every code path.
SMALL = dict(clips_per_combination=2, num_frames=8, seed=3)


def _read_csv(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def _combo(row):
    return parse_caption(row["text"])


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("toy")
    summary = make_toy_dataset(out, **SMALL)
    return out, summary


# --------------------------------------------------------------------------- grammar


def test_caption_round_trip_and_rejects_other_text():
    for combo in all_combinations():
        assert parse_caption(caption(*combo)) == combo
    assert caption("red", "circle", "left") == "a red circle moving left"
    for bad in ("a purple circle moving left", "a red circle moving", "red circle moving left"):
        with pytest.raises(UserError):
            parse_caption(bad)


def test_combinations():
    combos = all_combinations()
    assert len(combos) == len(set(combos)) == 60
    seen = seen_combinations()
    assert len(seen) == 54 and not set(seen) & set(HELDOUT)
    assert set(HELDOUT) <= set(combos)
    # Every word is still trained somewhere, so held-out combos test composition only.
    for index, vocabulary in enumerate((COLOURS, SHAPES, DIRECTIONS)):
        assert {combo[index] for combo in seen} == set(vocabulary)


# --------------------------------------------------------------------------- rendering


@pytest.mark.parametrize("size", [(32, 32), (32, 48), (48, 32), (16, 16)])
def test_render_clip_moves_the_right_way_and_stays_in_frame(size):
    height, width = size
    expected_step = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}
    for seed, combo in enumerate(all_combinations()):
        colour, shape, direction = combo
        frames = render_clip(colour, shape, direction, 16, height, width,
                             np.random.default_rng(seed))
        assert frames.shape == (16, height, width, 3) and frames.dtype == np.uint8
        mask = frames.any(axis=-1)
        assert set(map(tuple, frames[mask])) == {COLOURS[colour]}
        # Never clipped by the border, so the area only varies with sub-pixel placement
        # (which matters most for a 16x16 frame's tiny triangle).
        area = mask.sum(axis=(1, 2))
        assert area.min() > 0.6 * area.max()
        assert area.min() > 0.9 * min(height, width) ** 2 / 36  # ~r^2 at least
        # Travel 40-50% of the frame along the motion axis, in the right direction.
        rows, cols = (np.array([np.nonzero(m)[axis].mean() for m in mask]) for axis in (0, 1))
        d_row, d_col = rows[-1] - rows[0], cols[-1] - cols[0]
        step = expected_step[direction]
        along, across = (d_col, d_row) if step[0] == 0 else (d_row, d_col)
        side = width if step[0] == 0 else height
        assert 0.35 * side < along * sum(step) < 0.55 * side
        assert abs(across) < 1.0


def test_shape_box_stays_inside_the_frame():
    # The precise guarantee behind "fully inside": the 2r x 2r box around every centre
    # lies within the frame, for every direction, size and random start.
    for seed in range(200):
        rng = np.random.default_rng(seed)
        height, width = (16, 16) if seed % 2 else (32, 48)
        radius = min(height, width) / 6 * 1.1  # the largest jittered radius
        track = toy._centre_track(DIRECTIONS[seed % 4], 16, height, width, radius, rng)
        assert (track - radius >= 0).all()
        assert (track + radius <= np.array([height, width])).all()


def test_render_single_frame():
    frames = render_clip("green", "square", "up", 1, 32, 32, np.random.default_rng(0))
    assert frames.shape == (1, 32, 32, 3) and frames.any()


# --------------------------------------------------------------------------- dataset


def test_same_seed_gives_identical_csvs_and_frames(dataset, tmp_path):
    first, _ = dataset
    make_toy_dataset(tmp_path, **SMALL)
    for name in ("train.csv", "val.csv"):
        assert (first / name).read_bytes() == (tmp_path / name).read_bytes()
    _, rows = _read_csv(first / "train.csv")
    _, val_rows = _read_csv(first / "val.csv")
    for row in rows + val_rows:
        a, fps_a = read_video(first / row["path"])
        b, fps_b = read_video(tmp_path / row["path"])
        np.testing.assert_array_equal(a, b)
        assert fps_a == fps_b


def test_csv_layout_and_splits(dataset):
    out, summary = dataset
    train_columns, train = _read_csv(out / "train.csv")
    val_columns, val = _read_csv(out / "val.csv")
    assert train_columns == list(CSV_COLUMNS)
    assert val_columns == list(CSV_COLUMNS) + ["heldout"]
    assert len(train) == summary["num_train"] == 54 * SMALL["clips_per_combination"]
    per_heldout = SMALL["clips_per_combination"] // 2
    assert len(val) == summary["num_val"] == 54 * 2 + 6 * per_heldout

    train_combos = {_combo(row) for row in train}
    assert train_combos == set(seen_combinations())
    assert not train_combos & set(HELDOUT)
    for index, vocabulary in enumerate((COLOURS, SHAPES, DIRECTIONS)):
        assert {combo[index] for combo in train_combos} == set(vocabulary)

    val_heldout = {_combo(row) for row in val if row["heldout"] == "true"}
    assert val_heldout == set(HELDOUT)
    assert {_combo(row) for row in val if row["heldout"] == "false"} == set(seen_combinations())
    assert {row["heldout"] for row in val} == {"true", "false"}

    paths = [row["path"] for row in train + val]
    assert len(set(paths)) == len(paths)
    row = train[0]
    assert row["path"].startswith("videos/") and (out / row["path"]).is_file()
    assert (row["num_frames"], row["height"], row["width"]) == ("8", "32", "32")
    assert float(row["aspect_ratio"]) == 1.0 and float(row["fps"]) == 8.0
    assert probe_matches(out / row["path"], row)


def probe_matches(path, row):
    frames, fps = read_video(path)
    return (frames.shape[:3] == (int(row["num_frames"]), int(row["height"]), int(row["width"]))
            and fps == pytest.approx(float(row["fps"])))


def test_sizes_and_images(tmp_path):
    make_toy_dataset(tmp_path, clips_per_combination=2, num_frames=4,
                     sizes=[(32, 32), (32, 48)], image_fraction=0.5)
    _, train = _read_csv(tmp_path / "train.csv")
    _, val = _read_csv(tmp_path / "val.csv")

    images = [row for row in train if row["path"].endswith(".png")]
    assert len(images) == len(train) // 2
    for row in images:
        assert row["num_frames"] == "1" and float(row["fps"]) == IMAGE_FPS
    assert all(row["num_frames"] == "4" for row in train if row not in images)
    assert not any(row["path"].endswith(".png") for row in val)  # val is all video

    sizes = {("32", "32"), ("32", "48")}
    assert {(row["height"], row["width"]) for row in train} == sizes
    assert {(row["height"], row["width"]) for row in images} == sizes  # not tied to one
    for row in train[:8] + val[:4]:
        assert float(row["aspect_ratio"]) == pytest.approx(int(row["height"]) / int(row["width"]))
        assert probe_matches(tmp_path / row["path"], row)


def test_dataset_rejects_bad_options(tmp_path):
    with pytest.raises(UserError, match="even"):
        make_toy_dataset(tmp_path, sizes=[(31, 32)])
    with pytest.raises(UserError, match="image_fraction"):
        make_toy_dataset(tmp_path, image_fraction=1.5)


# --------------------------------------------------------------------------- metrics


@pytest.mark.parametrize("seed", [0, 1])
def test_metrics_recover_every_combination_after_mp4_round_trip(tmp_path, seed):
    # The metrics are the evaluation instrument: on real clips they must be exact.
    rng = np.random.default_rng(seed)
    results = []
    for combo in all_combinations():
        colour, shape, direction = combo
        frames = render_clip(colour, shape, direction, 16, 32, 32, rng)
        path = tmp_path / "clip.mp4"
        write_video(path, frames, fps=8)
        decoded, _ = read_video(path)
        assert measure_clip(frames) == {"colour": colour, "direction": direction}, combo
        measured = measure_clip(decoded)
        assert measured == {"colour": colour, "direction": direction}, combo
        results.append({"colour": colour, "direction": direction,
                        "pred_colour": measured["colour"],
                        "pred_direction": measured["direction"],
                        "heldout": combo in HELDOUT})
    summary = score(results)
    assert summary["colour_accuracy"] == summary["direction_accuracy"] == 1.0
    assert (summary["n"], summary["seen"]["n"], summary["heldout"]["n"]) == (60, 54, 6)


def test_metrics_on_generated_like_clips():
    black = np.zeros((16, 32, 32, 3), np.uint8)
    assert measure_clip(black) == {"colour": None, "direction": None}

    still = render_clip("blue", "circle", "left", 1, 32, 32, np.random.default_rng(0))
    static = np.repeat(still, 16, axis=0)
    assert dominant_colour(static) == "blue"
    assert motion_direction(static) is None

    # A dim, noisy object still reads correctly: colour is judged by hue, not level.
    clip = render_clip("yellow", "triangle", "up", 16, 32, 32, np.random.default_rng(1))
    noise = np.random.default_rng(2).integers(0, 40, clip.shape)
    dim = np.clip(clip * 0.6 + noise, 0, 255).astype(np.uint8)
    assert measure_clip(dim) == {"colour": "yellow", "direction": "up"}

    # Visible in too few frames -> no direction.
    flicker = render_clip("red", "square", "right", 16, 32, 32, np.random.default_rng(3))
    flicker[3:] = 0
    assert motion_direction(flicker) is None


def test_score_splits_seen_and_heldout():
    results = [
        {"colour": "red", "direction": "left", "pred_colour": "red",
         "pred_direction": "left", "heldout": False},
        {"colour": "red", "direction": "up", "pred_colour": None,
         "pred_direction": "up", "heldout": False},
        {"colour": "blue", "direction": "right", "pred_colour": "blue",
         "pred_direction": "left", "heldout": "true"},
    ]
    summary = score(results)
    assert summary["n"] == 3
    assert summary["colour_accuracy"] == pytest.approx(2 / 3)
    assert summary["direction_accuracy"] == pytest.approx(2 / 3)
    assert summary["seen"] == {"colour_accuracy": 0.5, "direction_accuracy": 1.0, "n": 2}
    assert summary["heldout"] == {"colour_accuracy": 1.0, "direction_accuracy": 0.0, "n": 1}
    assert score([])["seen"] == {"colour_accuracy": None, "direction_accuracy": None, "n": 0}


def test_ranks_starting_together_generate_the_toy_dataset_once(tmp_path, capsys):
    # torchrun starts every rank on a missing toy folder at once: one generates, the others
    # wait for it and then find the whole folder (train.csv, written last, and val.csv).
    import threading

    from videodit.config import load_config
    from videodit.toy.make import ensure_toy_data

    folder = tmp_path / f"{toy.TOY_FOLDER_PREFIX}-race"
    cfg = load_config("tiny", [f"data.csv={folder / 'train.csv'}", "toy.clips_per_combination=1",
                               "toy.num_frames=2", "toy.sizes=[[8, 8]]"])
    found = []

    def rank():
        ensure_toy_data(cfg)
        found.append((folder / "train.csv").exists() and (folder / "val.csv").exists())

    ranks = [threading.Thread(target=rank) for _ in range(3)]
    for thread in ranks:
        thread.start()
    for thread in ranks:
        thread.join()
    assert found == [True, True, True]
    assert capsys.readouterr().out.count("generating the toy dataset") == 1
