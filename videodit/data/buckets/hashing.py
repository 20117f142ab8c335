"""The random stream of bucket assignment: counter-based, identical on every rank.

Random draws come from a counter-based hash of (seed, epoch, sample id, resolution,
num_frames, draw slot), so every rank computes the same assignment without communicating.
"""

from __future__ import annotations

import numpy as np

from videodit.data.buckets.tables import RESOLUTION_NAMES

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_ROW_TAG, _DRAW_TAG = 0x6275636B65747321, 0x64726177736C6F74  # arbitrary distinct starts
GATE, KEEP = 0, 1  # draw slots: the p_frames gate and the keep coin of one entry


def _mix64(z: int) -> int:
    """splitmix64's finalizer on a Python int (a bijection of 64-bit words)."""
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK
    return z ^ (z >> 31)


def chain(h: int, word: int) -> int:
    """Fold one 64-bit word into hash ``h``."""
    return _mix64(((h ^ (word & _MASK)) + _GOLDEN) & _MASK)


def _mix64_np(z: np.ndarray) -> np.ndarray:
    z = z ^ (z >> np.uint64(30))
    z *= np.uint64(_MIX1)  # uint64 arrays wrap modulo 2**64, as the masks above do
    z ^= z >> np.uint64(27)
    z *= np.uint64(_MIX2)
    z ^= z >> np.uint64(31)
    return z


def _chain_np(h: np.ndarray | int, word: np.ndarray | int) -> np.ndarray:
    """``chain`` where either side is a uint64 array (the xor is symmetric)."""
    z = np.bitwise_xor(np.uint64(h & _MASK) if isinstance(h, int) else h,
                       np.uint64(word & _MASK) if isinstance(word, int) else word)
    z += np.uint64(_GOLDEN)
    return _mix64_np(z)


def row_prefix(seed: int, epoch: int) -> int:
    """The hash every row of (seed, epoch) starts from; chain a sample id onto it."""
    return chain(chain(_ROW_TAG, seed), epoch)


def draw_key(resolution: str, num_frames: int, slot: int) -> int:
    """The word that picks one draw (entry and slot) out of a row's hash."""
    code = RESOLUTION_NAMES.index(resolution)
    return chain(chain(chain(_DRAW_TAG, code), num_frames), slot)


def to_unit(h: int) -> float:
    """Top 53 bits as a float in [0, 1)."""
    return (h >> 11) * (1.0 / (1 << 53))


def uniform(seed: int, epoch: int, sample_id: int, resolution: str, num_frames: int,
            slot: int) -> float:
    """One draw of the stream; slot 0 is the p_frames gate, slot 1 the keep coin."""
    row = chain(row_prefix(seed, epoch), sample_id)
    return to_unit(chain(row, draw_key(resolution, num_frames, slot)))


def row_hashes(seed: int, epoch: int, sample_ids: np.ndarray) -> np.ndarray:
    """Each row's hash, as ``chain(row_prefix(seed, epoch), sample_id)``, for an id array."""
    ids = sample_ids.astype(np.int64, copy=False).view(np.uint64)
    return _chain_np(row_prefix(seed, epoch), ids)


def uniform_np(row_hash: np.ndarray, resolution: str, num_frames: int, slot: int) -> np.ndarray:
    """``uniform`` for an array of row hashes (from ``row_hashes``)."""
    h = _chain_np(row_hash, draw_key(resolution, num_frames, slot))
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))

