"""Batches stay uint8 to the device (issue 27): the host crops/resizes on uint8, the device
normalises (``pixels.to_model_input``) to the former float path's values; workers persist
across epochs and reuse their shared-memory buffers, and the mid-epoch resume stays exact."""

import numpy as np
import pytest
import torch

from clipgen import moving_frames
from conftest import tiny_overrides
from videodit.config import load_config
from videodit.data import shared_slots
from videodit.data.dataset import clip_tensor
from videodit.data.in_flight import IN_FLIGHT_BYTES, MAX_PREFETCH, batch_bytes, prefetch_factor
from videodit.data.loader import build_training_data
from videodit.data.pixels import RESIZE_TOLERANCE, cover_size, crop_resize_uint8, to_model_input
from videodit.train.trainer import Trainer

HEIGHT, WIDTH = 32, 48


def _frames(t: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    """Smooth content with edges (a coarse texture scrolled) plus noise, uint8 [T, h, w, 3]."""
    rng = np.random.default_rng(seed)
    noisy = moving_frames(t, h, w, seed=seed).astype(np.int16) + rng.integers(-40, 41, (t, h, w, 3))
    return np.clip(noisy, 0, 255).astype(np.uint8)


# --------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("size", [(32, 48), (32, 64), (48, 48), (40, 40), (64, 96), (70, 130), (20, 24), (17, 33)])
def test_uint8_resize_normalised_on_the_device_matches_the_float_path(size):
    frames = _frames(3, *size, seed=sum(size))
    got = crop_resize_uint8(frames, HEIGHT, WIDTH)
    assert got.dtype == torch.uint8 and got.shape == (3, 3, HEIGHT, WIDTH)
    normalised = to_model_input(got[None])[0]
    want = clip_tensor(frames, HEIGHT, WIDTH)
    if size in ((32, 48), (32, 64)):   # crop only: exactly the float path
        assert torch.equal(normalised, want)
    else:                               # resized: within one level of 255
        assert (normalised - want).abs().max() <= RESIZE_TOLERANCE


@pytest.mark.parametrize("size", [(64, 100), (24, 30)])   # down and up, 9 frames: resized a few at a time
def test_resizing_a_few_frames_at_a_time_is_resizing_them_all_at_once(size):
    import torch.nn.functional as F

    frames = _frames(9, *size, seed=1)
    new_h, new_w, scale = cover_size(*size, HEIGHT, WIDTH)
    whole = F.interpolate(torch.from_numpy(frames).permute(0, 3, 1, 2), size=(new_h, new_w), mode="bilinear",
                          align_corners=False, antialias=scale < 1)
    top, left = (new_h - HEIGHT) // 2, (new_w - WIDTH) // 2
    want = whole[..., top : top + HEIGHT, left : left + WIDTH].permute(1, 0, 2, 3)
    assert torch.equal(crop_resize_uint8(frames, HEIGHT, WIDTH), want)


def test_to_model_input_is_x_over_127_5_minus_1_for_every_level_and_contiguous():
    # Every level, in the loader's layout: [B, C, T, H, W] over [B, T, H, W, C] memory.
    video = (torch.arange(2 * 4 * 4 * 8 * 3) % 256).to(torch.uint8).view(2, 4, 4, 8, 3).permute(0, 4, 1, 2, 3)
    assert not video.is_contiguous()
    out = to_model_input(video, "cpu")
    assert out.dtype == torch.float32 and out.is_contiguous() and out.shape == video.shape
    want = video.numpy().astype(np.float32) / np.float32(127.5) - np.float32(1.0)
    assert np.array_equal(out.numpy(), want)
    assert out.min() == -1 and out.max() == 1
    already = torch.rand(1, 3, 1, 2, 2) * 2 - 1   # synthetic float batches pass through
    assert to_model_input(already) is already


# --------------------------------------------------------------------------- batches


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_are_uint8_and_pinned_when_asked(toy_dir, workers, monkeypatch):
    cfg = load_config("tiny", tiny_overrides(toy_dir, **{"data.num_workers": workers}))
    pin = torch.cuda.is_available()
    data = build_training_data(cfg.data, batch_size=4, seed=0, pin_memory=pin)
    assert data.loader.persistent_workers == (workers > 0)
    batch = next(iter(data.loader))
    assert batch.video.dtype == torch.uint8 and batch.video.shape == (4, 3, 4, 16, 16)
    assert (batch.lease is not None) == (workers > 0 and shared_slots.available())
    if pin:
        assert batch.video.is_pinned() and batch.lease is None
        return
    # CPU torch cannot pin: what DataLoader(pin_memory=True) calls, with pinning stubbed.
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, *args: t.clone())
    pinned = batch.pin_memory()
    assert pinned.video.dtype == torch.uint8 and pinned.lease is None
    assert torch.equal(pinned.video, batch.video)


def test_worker_batches_equal_main_process_batches_and_held_ones_are_never_overwritten(toy_dir):
    # Workers reuse their shared-memory buffers; a batch still held must keep its values.
    overrides = tiny_overrides(toy_dir)
    main = build_training_data(load_config("tiny", overrides).data, batch_size=4, seed=0)
    workers = build_training_data(load_config("tiny", overrides + ["data.num_workers=2"]).data, batch_size=4, seed=0)
    held, copies, leases = [], [], []
    for epoch in range(3):
        main.sampler.set_position(epoch, 0)
        workers.sampler.set_position(epoch, 0)
        for number, (a, b) in enumerate(zip(main.loader, workers.loader, strict=True)):
            assert torch.equal(a.video, b.video) and a.text == b.text
            leases.append(b.lease)
            if number % 4 == 0:
                held.append(b.video if number % 8 else b.video[1])   # whole batches and views
                copies.append(held[-1].clone())
    assert all(torch.equal(tensor, copy) for tensor, copy in zip(held, copies))
    if shared_slots.available():   # buffers were reused: far fewer buffers than batches
        buffers = {(lease.worker, lease.slot, lease.allocation) for lease in leases if lease is not None}
        assert len(buffers) <= len(leases) // 2


def test_prefetch_keeps_the_largest_buckets_bytes_in_flight_within_the_budget():
    from videodit.data.buckets.assign import Bucket

    toy = Bucket("16px", 4, "1.00", 16, 16, 4)
    p720 = Bucket("720p", 121, "0.56", 720, 1280, 4)   # 1.3 GB a batch
    p480 = Bucket("480p", 33, "0.58", 480, 832, 4)
    assert prefetch_factor([toy], 0) is None
    assert prefetch_factor([toy], 2) == MAX_PREFETCH
    assert prefetch_factor([toy, p720], 2) == 1   # at least one batch each
    assert prefetch_factor([toy, p480], 2) == IN_FLIGHT_BYTES // (2 * batch_bytes(p480)) == 3


# --------------------------------------------------------------------------- resume


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop_after", [1, 4])
def test_persistent_workers_keep_the_mid_epoch_resume_exact(toy_dir, workers, stop_after):
    """Iterate the way ``Trainer.batches`` does (position, then the loader, every epoch); stop
    after ``stop_after`` batches, abandon the iteration mid-epoch, set the saved position on the
    same loader (its workers kept) and go on: the batches are those of a straight run."""
    cfg = load_config("tiny", tiny_overrides(toy_dir, **{"data.num_workers": workers}))

    def run(data, epoch, offset, count):
        out = []
        while len(out) < count:
            data.sampler.set_position(epoch, offset)
            for batch in data.loader:
                out.append((epoch, offset, batch.text, batch.video.clone()))
                offset += 1
                if len(out) == count:
                    return out, epoch, offset
            epoch, offset = epoch + 1, 0
        return out, epoch, offset

    steps = 2 * len(build_training_data(cfg.data, batch_size=4, seed=0).sampler) + 3   # crosses 2 epochs
    straight, _, _ = run(build_training_data(cfg.data, batch_size=4, seed=0), 0, 0, steps)
    data = build_training_data(cfg.data, batch_size=4, seed=0)
    first, epoch, offset = run(data, 0, 0, stop_after)
    data.sampler.set_position(0, 0)
    next(iter(data.loader))   # an iteration that is abandoned with batches in flight
    rest, _, _ = run(data, epoch, offset, steps - stop_after)
    for (e1, o1, t1, v1), (e2, o2, t2, v2) in zip(straight, first + rest, strict=True):
        assert (e1, o1, t1) == (e2, o2, t2) and torch.equal(v1, v2)


def test_training_with_persistent_workers_resumes_with_the_same_losses(toy_dir, tmp_path):
    from safetensors.torch import load_file

    common = tiny_overrides(toy_dir, **{"train.max_steps": 8, "train.batch_size": 8, "data.num_workers": 2,
                                        "train.deterministic": True})
    straight = tmp_path / "straight"
    Trainer(load_config("tiny", common), straight).fit()
    split = tmp_path / "split"   # 6 batches of 8 an epoch: stops mid-epoch, ends in the next one
    Trainer(load_config("tiny", common + ["train.max_steps=3"]), split).fit()
    Trainer(load_config("tiny", common + ["resume=auto"]), split).fit()
    a = load_file(str(straight / "checkpoints/step-0000008/model.safetensors"))
    b = load_file(str(split / "checkpoints/step-0000008/model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
