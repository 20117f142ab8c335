"""The toy world you can hear: soundtracks of toy clips and the judges of a soundtrack."""

import csv

import av
import numpy as np
import pytest

from videodit.cli import main
from videodit.data.video import read_video
from videodit.data.video_write import write_video
from videodit.errors import UserError
from videodit.toy.audio import (COLOUR_PITCHES, SAMPLE_RATE, ClipWithAudio, click_times, dominant_pitch,
                                nearest_colour, soundtrack)
from videodit.toy.eval import HIT_TOLERANCE_FRAMES, judge_audio
from videodit.toy.make import (COLOURS, all_combinations, caption, edge_hit_frames, make_toy_dataset,
                               parse_caption, render_clip, render_clip_with_audio)
from videodit.toy.metrics import (audio_pitch_correct, audio_timing_score, dominant_colour, hit_frames,
                                  motion_direction)

FPS = 8
SMALL = dict(clips_per_combination=2, num_frames=16, fps=FPS, seed=5, image_fraction=0.25)


def _read_audio(path):
    with av.open(str(path)) as container:
        (stream,) = container.streams.audio
        return np.concatenate([f.to_ndarray() for f in container.decode(stream)], axis=1), stream.rate


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def audio_dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("toy_audio")
    return out, make_toy_dataset(out, audio=True, **SMALL)


@pytest.fixture(scope="module")
def plain_dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("toy_plain")
    return out, make_toy_dataset(out, **SMALL)


def _generated(seed=0, num_frames=16, size=32):
    """Every combination rendered with its soundtrack, in memory: [(combo, clip, hit_times)]."""
    return [(combo, *render_clip_with_audio(*combo, num_frames, size, size, FPS, np.random.default_rng([seed, i])))
            for i, combo in enumerate(all_combinations())]


# --------------------------------------------------------------------------- the sounds


def test_every_colour_has_its_own_pitch_well_apart_between_200_and_1000_hz():
    assert list(COLOUR_PITCHES) == list(COLOURS)
    pitches = sorted(COLOUR_PITCHES.values())
    assert 200 <= pitches[0] and pitches[-1] <= 1000
    semitones = 12 * np.diff(np.log2(pitches))
    assert semitones.min() >= 5.9   # a tritone apart: the nearest pitch is never in doubt
    for colour, pitch in COLOUR_PITCHES.items():
        assert nearest_colour(pitch * 2 ** (2.5 / 12)) == nearest_colour(pitch / 2 ** (2.5 / 12)) == colour


@pytest.mark.parametrize("num_frames, size", [(16, 32), (8, 32), (16, 16), (16, 64)])
def test_generated_clips_score_one_on_pitch_and_timing(num_frames, size):
    for (colour, shape, direction), clip, hits in _generated(num_frames=num_frames, size=size):
        assert clip.waveform.shape == (2, round(num_frames / FPS * SAMPLE_RATE))
        assert clip.waveform.dtype == np.float32 and np.abs(clip.waveform).max() <= 1.0
        assert len(hits) == 1 and num_frames / 2 <= hits[0] * FPS <= num_frames - 1
        assert audio_pitch_correct(clip.waveform, clip.sample_rate, colour)
        assert audio_timing_score(clip.waveform, clip.sample_rate, hits, tolerance=1 / FPS) == 1.0
        # The frames show the same hit, and still the colour and direction of the caption.
        np.testing.assert_array_equal(hit_frames(clip.frames) / FPS, hits)
        assert dominant_colour(clip.frames) == colour and motion_direction(clip.frames) == direction


def test_the_shape_rests_against_the_edge_it_moves_towards():
    for (colour, shape, direction), clip, hits in _generated(seed=1):
        hit = round(hits[0] * FPS)
        assert (clip.frames[hit:] == clip.frames[hit]).all()     # at rest from the hit on
        assert not (clip.frames[hit - 1] == clip.frames[hit]).all()
        edge = {"left": clip.frames[hit, :, 0], "right": clip.frames[hit, :, -1],
                "up": clip.frames[hit, 0], "down": clip.frames[hit, -1]}[direction]
        if shape != "triangle" or direction != "up":   # a triangle's apex is thinner than a pixel
            assert edge.any()


def test_edge_hits_come_from_the_track():
    centres = np.array([[10.0, 10.0], [10.0, 20.0], [10.0, 27.0], [10.0, 27.0], [10.0, 20.0], [10.0, 27.0]])
    np.testing.assert_array_equal(edge_hit_frames(centres, 5.0, 32, 32), [2, 5])
    np.testing.assert_array_equal(edge_hit_frames(centres[:2], 5.0, 32, 32), [])


def test_pan_follows_the_shape():
    left_then_right = soundtrack("red", 2.0, pan=np.array([0.0] * 8 + [1.0] * 8))
    first, last = left_then_right[:, : 7 * SAMPLE_RATE // 8], left_then_right[:, -7 * SAMPLE_RATE // 8:]
    assert np.abs(first[0]).max() > 0.25 and np.abs(first[1]).max() < 1e-6
    assert np.abs(last[1]).max() > 0.25 and np.abs(last[0]).max() < 1e-6
    centred = soundtrack("red", 2.0)
    np.testing.assert_allclose(centred[0], centred[1])


# --------------------------------------------------------------------------- the judges


def test_a_wrong_colour_scores_zero_on_pitch():
    for colour in COLOURS:
        for other in COLOURS:
            wave = soundtrack(other, 2.0, hit_times=[1.0])
            assert audio_pitch_correct(wave, SAMPLE_RATE, colour) == (colour == other)


def test_silence_and_noise_score_at_or_below_chance():
    rng = np.random.default_rng(0)
    silence = np.zeros((2, 2 * SAMPLE_RATE), np.float32)
    signals = [silence, 1e-4 * rng.standard_normal((2, 2 * SAMPLE_RATE))]
    signals += [0.3 * rng.standard_normal((2, 2 * SAMPLE_RATE)) for _ in range(5)]
    signals += [rng.uniform(-1, 1, (1, 2 * SAMPLE_RATE)) for _ in range(5)]
    for wave in signals:
        assert dominant_pitch(wave, SAMPLE_RATE) is None
        assert len(click_times(wave, SAMPLE_RATE)) == 0
    pitch = np.mean([audio_pitch_correct(w, SAMPLE_RATE, c) for w in signals for c in COLOURS])
    timing = np.mean([audio_timing_score(w, SAMPLE_RATE, [1.0]) for w in signals])
    assert pitch <= 1 / len(COLOURS) and timing <= 0.1


def test_timing_counts_clicks_near_the_hits_only():
    wave = soundtrack("green", 2.0, hit_times=[0.5, 1.5])
    np.testing.assert_allclose(click_times(wave, SAMPLE_RATE), [0.5, 1.5], atol=0.01)
    assert audio_timing_score(wave, SAMPLE_RATE, [0.5, 1.5]) == 1.0
    assert audio_timing_score(wave, SAMPLE_RATE, [0.5]) == pytest.approx(2 / 3)    # one click too many
    assert audio_timing_score(wave, SAMPLE_RATE, [0.5 + 3 / FPS, 1.5 - 3 / FPS], tolerance=1.5 / FPS) == 0.0
    assert audio_timing_score(soundtrack("green", 2.0), SAMPLE_RATE, []) == 1.0     # nothing to hear, nothing heard
    assert audio_timing_score(wave, SAMPLE_RATE, []) == 0.0
    # Clicks under a loud tone and quiet noise are still heard, and the tone's fades are no clicks.
    noisy = wave + 0.02 * np.random.default_rng(0).standard_normal(wave.shape)
    assert audio_timing_score(noisy, SAMPLE_RATE, [0.5, 1.5]) == 1.0
    assert len(click_times(soundtrack("white", 2.0), SAMPLE_RATE)) == 0


def test_an_unknown_colour_is_refused_in_one_line():
    with pytest.raises(UserError, match="has no pitch; use one of"):
        audio_pitch_correct(np.zeros(100), SAMPLE_RATE, "purple")


def test_judge_audio_splits_seen_and_heldout_and_catches_a_wrong_tone():
    generated = _generated(seed=2)
    clips = [clip for _, clip, _ in generated]
    captions = [caption(*combo) for combo, _, _ in generated]
    report = judge_audio(clips, captions)
    assert report["pitch_accuracy"] == report["timing_f1"] == 1.0
    assert (report["n"], report["seen"]["n"], report["heldout"]["n"]) == (60, 54, 6)
    assert report["heldout"]["pitch_accuracy"] == 1.0
    # Every tone one colour off and every click gone: both scores drop to zero.
    names = list(COLOURS)
    swapped = [ClipWithAudio(clip.frames, clip.fps, soundtrack(names[(names.index(combo[0]) + 1) % 5],
                                                             2.0), clip.sample_rate)
               for combo, clip, _ in generated]
    report = judge_audio(swapped, captions)
    assert report["pitch_accuracy"] == report["timing_f1"] == 0.0
    with pytest.raises(ValueError, match="one caption per clip"):
        judge_audio(clips, captions[:-1])


# --------------------------------------------------------------------------- the dataset


def test_the_audio_dataset_scores_one_after_the_mp4_round_trip(audio_dataset):
    out, summary = audio_dataset
    assert summary["audio"] is True
    rows = _rows(out / "val.csv")
    clips = []
    for row in rows:
        frames, fps = read_video(out / row["path"])
        waveform, rate = _read_audio(out / row["path"])
        clips.append(ClipWithAudio(frames, fps, waveform, rate))
        colour, _, direction = parse_caption(row["text"])
        assert (dominant_colour(frames), motion_direction(frames)) == (colour, direction)
    report = judge_audio(clips, [row["text"] for row in rows])
    assert report["pitch_accuracy"] == report["timing_f1"] == 1.0
    assert report["heldout"]["n"] == 6
    assert HIT_TOLERANCE_FRAMES <= 2


def test_audio_changes_the_mp4s_only_and_images_stay_silent(audio_dataset, plain_dataset):
    (loud, loud_summary), (plain, plain_summary) = audio_dataset, plain_dataset
    assert (plain_summary["audio"], loud_summary["audio"]) == (False, True)
    for name in ("train.csv", "val.csv"):
        assert (loud / name).read_bytes() == (plain / name).read_bytes()
    rows = _rows(plain / "train.csv")[:8]
    assert {row["path"][-4:] for row in rows} == {".mp4", ".png"}
    for row in rows:
        if row["path"].endswith(".png"):
            assert (loud / row["path"]).read_bytes() == (plain / row["path"]).read_bytes()
            continue
        for folder, streams in ((plain, 0), (loud, 1)):
            with av.open(str(folder / row["path"])) as container:
                assert len(container.streams.audio) == streams


def test_the_default_dataset_is_what_it_was(plain_dataset, tmp_path):
    """Without audio a clip is still render_clip's frames from its own stream [seed, split, index]."""
    plain, _ = plain_dataset
    row = _rows(plain / "train.csv")[1]
    assert row["path"].endswith(".mp4")
    frames = render_clip(*parse_caption(row["text"]), 16, 32, 32, np.random.default_rng([SMALL["seed"], 0, 1]))
    write_video(tmp_path / "expected.mp4", frames, FPS)
    assert (plain / row["path"]).read_bytes() == (tmp_path / "expected.mp4").read_bytes()


def test_cli_toy_make_passes_audio(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr("videodit.toy.make.make_toy_dataset", lambda out, **kw: calls.append(kw["audio"]))
    assert main(["toy", "make", str(tmp_path / "a"), "--audio"]) == 0
    assert main(["toy", "make", str(tmp_path / "b")]) == 0
    assert calls == [True, False]
