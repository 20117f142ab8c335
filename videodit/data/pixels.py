"""Clip pixels on their way to the model: uint8 on the host, float in [-1, 1] on the device.

The host (DataLoader workers) only crops and, where a clip's size differs from its bucket's,
resizes, both on uint8 (``crop_resize_uint8``). Batches stay uint8 through shared memory,
pinned memory and the host-to-device copy: a quarter of the bytes of float32. Conversion to
float and normalisation happen on the device, in the one function every consumer of
``Batch.video`` calls (``to_model_input``).

Layout: a clip is ``[C, T, H, W]`` by shape, but its memory is ``[T, H, W, C]`` (what the
decoder writes): the crop is then a plain copy, where writing planar memory on the host cost
3-4x more (41-50 ms against 12 ms for 33 frames of 832x480 on one core). ``to_model_input``
writes the contiguous float tensor the encoders take.

Why resize on the host, on uint8: a clip of a bucket may have any source size, so resizing
on the device would need per-clip shapes in a batch and would send up to 2.3x the bytes
(720p to a 480p bucket); torch's uint8 antialiased bilinear kernel (AVX2) resized 33 frames of
1280x720 to cover 832x480 in ~45 ms on one core (four frames per call) against ~2.4 s for the
float path it replaces, and gives the float path's values within one level of 255
(benchmarks/RESULTS.md, ``tests/data/test_uint8_pipeline.py``). Crops without a resize are exact.
On a GPU the resize would cost nothing, but the bytes and the ragged batches would remain.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

# The largest difference, in [-1, 1] units, between a resized uint8 clip normalised here and
# the float resize of the same frames (``dataset.clip_tensor``): the uint8 kernel rounds to a
# level of 255 after each of its two passes (one level = 2/255; measured at most 1.002 levels on
# toy and 720p clips).
RESIZE_TOLERANCE = 2 / 255 * 1.01

_RESIZE_FRAMES = 4   # frames per resize call (crop_resize_uint8)
# How the host resizes, as a feature cache's manifest records it: a cache resumed by a build that
# resized another way would mix shards within a level of each other, silently.
RESIZE_METHOD = "uint8-bilinear-antialias"


def cover_size(h: int, w: int, height: int, width: int) -> tuple[int, int, float]:
    """Size that covers ``height x width`` keeping the aspect ratio, and the scale factor."""
    scale = max(height / h, width / w)
    return max(height, round(h * scale)), max(width, round(w * scale)), scale


def clip_channels_last(num_frames: int, height: int, width: int) -> torch.Tensor:
    """An uninitialised uint8 clip, ``[C, T, H, W]`` by shape over ``[T, H, W, C]`` memory."""
    return torch.empty(num_frames, height, width, 3, dtype=torch.uint8).permute(3, 0, 1, 2)


def crop_resize_uint8(frames: np.ndarray, height: int, width: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 ``[T, h, w, 3]`` -> uint8 ``[3, T, height, width]`` (``[T, H, W, 3]`` memory): scale
    to cover (antialiased when shrinking), keep the aspect ratio, crop the centre; written into
    ``out`` when given. Normalised with ``to_model_input`` it equals ``dataset.clip_tensor``
    exactly without a resize, within ``RESIZE_TOLERANCE`` with one."""
    t, h, w = frames.shape[:3]
    if out is None:
        out = clip_channels_last(t, height, width)
    new_h, new_w, scale = cover_size(h, w, height, width)
    top, left = (new_h - height) // 2, (new_w - width) // 2
    video = torch.from_numpy(frames).permute(0, 3, 1, 2)   # [T, 3, h, w], channels-last memory
    if (new_h, new_w) == (h, w):
        return out.copy_(video[..., top : top + height, left : left + width].permute(1, 0, 2, 3))
    # A few frames per call: the kernel's intermediate and output buffers then stay below
    # malloc's mmap threshold and are recycled, instead of fresh pages faulted in per clip
    # (33 frames 720p -> 480p: 41-47 ms against 74 ms in one call). Frames resize independently,
    # so the result is the one-call result.
    for start in range(0, t, _RESIZE_FRAMES):
        # Channels-last uint8 with 3 channels takes torch's vectorised uint8 kernel.
        part = F.interpolate(video[start : start + _RESIZE_FRAMES], size=(new_h, new_w), mode="bilinear",
                             align_corners=False, antialias=scale < 1)
        out[:, start : start + _RESIZE_FRAMES].copy_(part[..., top : top + height, left : left + width]
                                                     .permute(1, 0, 2, 3))
    return out


def to_model_input(video: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """A batch's clips as the encoders take them: contiguous float32 ``[B, C, T, H, W]`` in
    [-1, 1] on ``device``, from uint8 (``x / 127.5 - 1``, what the host computed before);
    float input (already normalised, e.g. synthetic batches) is only moved.

    The copy is asynchronous from pinned memory (``non_blocking``), so conversion and
    normalisation queue behind it on the device. The divisor is a device tensor: CUDA divides
    by a host scalar as a multiplication by its reciprocal, 1 ulp off for 111 of the 256 levels.
    """
    if device is not None:
        video = video.to(device, non_blocking=True)
    if video.is_floating_point():
        return video
    out = torch.empty(video.shape, dtype=torch.float32, device=video.device)   # contiguous
    out.copy_(video)
    out.div_(torch.full((), 127.5, device=video.device))
    return out.sub_(1.0)
