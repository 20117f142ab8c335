"""VideoDataset samples: exactly full decode + frame sampling + resize (uint8), batched
without copies, normalised on the device to the float path's values, and robust to streams
that change size mid-file."""

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from clipgen import encode_h264, moving_frames, size_change_mp4
from videodit.config import load_config
from videodit.data.buckets.plan import BucketPlan
from videodit.data.dataset import VideoDataset, collate, resize_center_crop, sample_frame_indices
from videodit.data.metadata import read_metadata
from videodit.data.pixels import RESIZE_TOLERANCE, crop_resize_uint8, to_model_input
from videodit.data.video import read_video
from videodit.data.video_write import write_video
from with_decoders import decoder  # noqa: F401 -- the fixture: tests taking it run with PyAV and torchcodec

SEED, NUM_FRAMES, INTERVAL, HEIGHT, WIDTH = 3, 5, 2, 32, 48


def _write_csv(folder, names):
    rows = ["path,text,num_frames,height,width,aspect_ratio,fps"]
    for name in names:
        frames, _ = read_video(folder / name)
        rows.append(f"{name},{name},{len(frames)},{frames.shape[1]},{frames.shape[2]},"
                    f"{frames.shape[1] / frames.shape[2]},8")
    (folder / "meta.csv").write_text("\n".join(rows) + "\n")
    return folder / "meta.csv"


def _dataset(csv, batch_size=4):
    cfg = load_config("tiny", [f"data.csv={csv}", f"data.num_frames={NUM_FRAMES}", f"data.height={HEIGHT}",
                               f"data.width={WIDTH}", f"data.frame_interval={INTERVAL}",
                               "data.make_toy_if_missing=false"])
    meta = read_metadata(csv)
    return VideoDataset(meta, BucketPlan(meta, cfg.data, batch_size, SEED), INTERVAL, seed=SEED)


def _picked(path, index, epoch):
    frames, _ = read_video(path)
    rng = np.random.default_rng([SEED, epoch, index])
    return frames[sample_frame_indices(len(frames), NUM_FRAMES, INTERVAL, rng)]


def _reference_uint8(path, index, epoch):
    """What a sample is defined to be: decode everything, sample frames, resize (uint8)."""
    return crop_resize_uint8(_picked(path, index, epoch), HEIGHT, WIDTH)


def _reference(path, index, epoch):
    """The float path samples were before they stayed uint8 to the device: decode everything,
    sample frames, resize in float, normalise."""
    video = torch.from_numpy(_picked(path, index, epoch)).permute(0, 3, 1, 2).float()
    video = resize_center_crop(video, HEIGHT, WIDTH)
    return (video / 127.5 - 1.0).clamp(-1, 1).permute(1, 0, 2, 3)


@pytest.fixture(scope="module")
def mixed_media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mixed_media")
    encode_h264(folder / "small_gop.mp4", moving_frames(90, 32, 48), keyint=4)
    encode_h264(folder / "large_gop.mp4", moving_frames(90, 32, 48, seed=1), keyint=1000)
    pts = np.cumsum(np.random.default_rng(0).integers(1, 4, 60)).tolist()
    encode_h264(folder / "vfr.mp4", moving_frames(60, 32, 48, seed=2), keyint=10, pts=pts)
    write_video(folder / "short.mp4", moving_frames(3, 32, 48, seed=3), fps=8)          # repeats its last frame
    write_video(folder / "still.png", moving_frames(1, 32, 48, seed=4), fps=8)
    write_video(folder / "anim.gif", moving_frames(12, 32, 48, seed=5), fps=8)
    write_video(folder / "crop_only.mp4", moving_frames(12, 32, 64, seed=6), fps=8)     # no resize
    write_video(folder / "upscale.mp4", moving_frames(12, 40, 40, seed=7), fps=8)
    write_video(folder / "downscale.mp4", moving_frames(12, 64, 96, seed=8), fps=8)    # antialiased
    names = ["small_gop.mp4", "large_gop.mp4", "vfr.mp4", "short.mp4", "still.png", "anim.gif",
             "crop_only.mp4", "upscale.mp4", "downscale.mp4"]
    return _write_csv(folder, names)


def test_samples_are_bit_identical_to_full_decode_and_indexing(mixed_media, decoder):
    # Re-pinned when batches became uint8 (normalised on the device): the uint8 sample is still
    # exactly full decode + indexing + resize; normalised, it equals the former float path
    # exactly where no resize is needed and within RESIZE_TOLERANCE (one level of 255: the uint8
    # resize rounds) for upscale.mp4 and downscale.mp4.
    dataset = _dataset(mixed_media)
    keys = [(index, epoch, 0) for epoch in range(3) for index in range(len(dataset))]
    loader = DataLoader(dataset, batch_sampler=[keys[i : i + 4] for i in range(0, len(keys), 4)],
                        collate_fn=collate)
    batched = torch.cat([batch.video for batch in loader])
    for row, (index, epoch, _) in enumerate(keys):
        path = dataset.meta.paths[index]
        want, want_float = _reference_uint8(path, index, epoch), _reference(path, index, epoch)
        for got in (dataset[(index, epoch, 0)]["video"], batched[row]):
            assert got.shape == (3, NUM_FRAMES, HEIGHT, WIDTH) and got.dtype == torch.uint8
            assert torch.equal(got, want), (path, epoch)
            normalised = to_model_input(got[None])[0]
            if path.endswith(("upscale.mp4", "downscale.mp4")):
                assert (normalised - want_float).abs().max() <= RESIZE_TOLERANCE, (path, epoch)
            else:
                assert torch.equal(normalised, want_float), (path, epoch)


def test_held_batches_are_never_overwritten(mixed_media):
    # Batch memory is reused once nothing refers to it: a batch (or a view of one) that is
    # still held must keep its values while later batches are made.
    dataset = _dataset(mixed_media, batch_size=2)
    keys = [[(i, epoch, 0), ((i + 1) % len(dataset), epoch, 0)] for epoch in range(2) for i in range(len(dataset))]
    kept, copies = [], []
    for number, batch in enumerate(DataLoader(dataset, batch_sampler=keys, collate_fn=collate)):
        if number % 3 == 0:
            kept.append(batch.video if number % 2 else batch.video[1])   # whole batches and views
            copies.append(kept[-1].clone())
    assert len(kept) == 6
    for tensor, copy in zip(kept, copies):
        assert torch.equal(tensor, copy)


def test_worker_batches_equal_main_process_batches(mixed_media, decoder):
    dataset = _dataset(mixed_media)
    keys = [[(i, 0, 0) for i in range(start, start + 4)] for start in (0, 4)]
    main = [b.video for b in DataLoader(dataset, batch_sampler=keys, collate_fn=collate)]
    workers = [b.video for b in DataLoader(dataset, batch_sampler=keys, collate_fn=collate, num_workers=2)]
    for a, b in zip(main, workers):
        assert torch.equal(a, b)


def test_a_file_changing_size_mid_stream_makes_a_sample(tmp_path, decoder):
    size_change_mp4(tmp_path / "joined.mp4", moving_frames(6, 32, 48), moving_frames(6, 48, 32, seed=1))
    dataset = _dataset(_write_csv(tmp_path, ["joined.mp4"]))
    for epoch in range(4):   # windows in either part and across the change
        sample = dataset[(0, epoch, 0)]   # np.stack of 48x32 and 32x48 frames used to crash here
        assert sample["video"].shape == (3, NUM_FRAMES, HEIGHT, WIDTH) and not sample["failed"]


def test_unreadable_files_in_a_batch_are_replaced_in_place(mixed_media, tmp_path, decoder):
    folder = mixed_media.parent
    (tmp_path / "broken.mp4").write_bytes(b"not a video")
    csv = tmp_path / "meta.csv"
    lines = mixed_media.read_text().splitlines()
    rows = [f"{folder / line.split(',')[0]},{line.split(',', 1)[1]}" for line in lines[1:]]
    csv.write_text("\n".join([lines[0], *rows, f"{tmp_path / 'broken.mp4'},broken,12,32,48,0.67,8"]) + "\n")
    dataset = _dataset(csv)
    broken = len(dataset) - 1
    samples = dataset.__getitems__([(0, 0, 0), (broken, 0, 0)])
    assert samples[1]["failed"] == [(str(tmp_path / "broken.mp4"), samples[1]["failed"][0][1])]
    assert "not a readable video" in samples[1]["failed"][0][1]
    batch = collate(samples)
    replacement = dataset.meta.texts.index(batch.text[1])   # each file's text is its name
    assert torch.equal(batch.video[1], _reference_uint8(dataset.meta.paths[replacement], replacement, 0))
