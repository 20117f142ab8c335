"""The trajectory cache (``videodit distill trajectories``, ``distill.trajectories``): its layout,
what it depends on, and the math that fills it (the guided teacher's Euler ODE at the student's
sigmas). Pure like the rest of ``distill/``: files are written and read in ``train/trajectory.py``,
with the feature cache's helpers (atomic writes, SHA-256 records, the build lock).

A folder holds::

    manifest.json                   format, what the trajectories depend on (``depends``), items, shards
    shards/shard-00000.safetensors  per item i: "i.state0" ... "i.state{K-1}" [C, T', H', W'] the teacher's
                                    state at each student sigma ("i.state0": the seeded noise itself),
                                    "i.x0" its endpoint, "i.text" [n, D] the caption's valid tokens,
                                    "i.pooled" [P] (an encoder with a pooled vector)
    shards/shard-00000.parquet      that shard's index rows; its metadata: the shard file's SHA-256 and size
    index.parquet                   every item (written last: the cache is complete); its metadata: every
                                    shard's record

An item is one clip of the run's data in epoch 0's bucket; its noise is seeded by (train.seed,
item) alone, so any number of ranks, any resume, writes the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import torch

from videodit.errors import UserError
from videodit.user_files import FileTooLarge, NotRegularFile, read_user_json

FORMAT, VERSION = "videodit-trajectory-cache", 1
MANIFEST, INDEX, SHARDS = "manifest.json", "index.parquet", "shards"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ST_DTYPES = {"fp32": "F32", "bf16": "BF16"}   # as safetensors headers name them
INDEX_SCHEMA = pa.schema([
    ("item", pa.int64()), ("clip", pa.int64()), ("bucket", pa.int32()), ("shard", pa.int32()),
    ("frames", pa.int32()), ("height", pa.int32()), ("width", pa.int32()), ("fps", pa.float32()),
    ("noise_seed", pa.int64()), ("text_offset", pa.int32()), ("text_len", pa.int32()), ("caption", pa.string()),
])
BUILD_FIX = "videodit distill trajectories CONFIG --out DIR"
_SEED_TAG = 0x7A7EC   # keeps item noise apart from the batches' noise seeds


def tensor_key(item: int, what: str) -> str:
    return f"{item}.{what}"


def item_seed(seed: int, item: int) -> int:
    """The noise seed of item ``item`` of a cache built with ``train.seed`` ``seed``."""
    return int(np.random.SeedSequence((seed, item, _SEED_TAG)).generate_state(1)[0])


def item_noise(shape, seed: int) -> torch.Tensor:
    """An item's starting noise [1, C, T', H', W']: what the online step draws for a batch of one
    whose noise seed is ``seed`` (``torch.randn(x0.shape, generator=...)``)."""
    return torch.randn((1, *shape), generator=torch.Generator().manual_seed(seed))


def teacher_trajectory(teacher_x0: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], noise: torch.Tensor,
                       sigmas: list[float], substeps: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(the teacher's state at every student sigma, its x0 at the end): guided Euler steps from
    ``noise`` (at ``sigmas[0]``), ``substeps`` of them between successive student sigmas (and from
    the last one to 0), so the student's sigmas lie on the teacher's grid. ``teacher_x0(x, t)``:
    the guided teacher's clean sample at (x, t)."""
    levels = list(sigmas) + [0.0]
    x, states = noise.float(), []
    for hi, lo in zip(levels[:-1], levels[1:]):
        states.append(x)
        grid = torch.linspace(hi, lo, substeps + 1).tolist()
        for s, s_next in zip(grid[:-1], grid[1:]):
            t = torch.full((x.shape[0],), s, device=x.device)
            v = (x - teacher_x0(x, t)) / s   # the guided velocity: x0 = x - s v
            x = x + (s_next - s) * v
    return states, x


def draw(candidates: np.ndarray, n: int, seed: int) -> np.ndarray:
    """``n`` of ``candidates`` (item numbers) from ``seed`` alone: without repeats where there are
    enough, so a resumed run (same seed) draws what the first did."""
    g = torch.Generator().manual_seed(seed)
    picks = torch.randperm(len(candidates), generator=g)[:n] if len(candidates) >= n else \
        torch.randint(len(candidates), (n,), generator=g)
    return candidates[picks.numpy()]


# --------------------------------------------------------------------------- what the trajectories depend on

# depends key -> (what a message calls it, the config keys that set it)
_DEPENDS = {
    "teacher": ("teacher", "distill.teacher / model.init_from"),
    "model": ("model architecture", "model.*"),
    "prediction": ("model output", "diffusion.prediction"),
    "sigmas": ("student sigmas", "distill.steps, distill.shift"),
    "teacher_cfg": ("teacher guidance", "distill.teacher_cfg"),
    "teacher_substeps": ("teacher substeps", "distill.teacher_substeps"),
    "negative_prompt": ("negative prompt", "sample.negative_prompt"),
    "vae": ("VAE (latent space)", "vae.*"),
    "text": ("text encoder", "text.*"),
}


def _identity_differs(a: dict, b: dict) -> bool:
    """Two encoder or teacher identities: by their files' digests where both have them, else by path."""
    if a.get("fingerprint") is not None or b.get("fingerprint") is not None:   # a teacher: its weights only
        return a.get("fingerprint") != b.get("fingerprint")
    keys = set(a) | set(b)
    keys.discard("path" if a.get("weights") and b.get("weights") else "weights")
    return any(a.get(k) != b.get(k) for k in keys)


def depends_problem(cached: dict, wanted: dict) -> tuple[str, str, str] | None:
    """The first thing the trajectories were computed with that differs from ``wanted``: (what,
    the cache's value, this config's), or None."""
    for key, (what, keys) in _DEPENDS.items():
        a, b = cached.get(key), wanted.get(key)
        differs = _identity_differs(a, b) if isinstance(a, dict) and isinstance(b, dict) and key != "model" \
            else a != b
        if differs:
            return f"{what} ({keys})", _short(a), _short(b)
    return None


def _short(value) -> str:
    if isinstance(value, dict) and "path" in value:
        value = value["path"]
    text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."


def check_depends(manifest: dict, wanted: dict, where: str) -> None:
    """Refuse, in one line naming the fix, trajectories computed for another teacher, schedule,
    guidance or encoders than the run's."""
    problem = depends_problem(manifest["depends"], wanted)
    if problem:
        what, theirs, ours = problem
        raise UserError(f"distill.trajectories={where} was computed with another {what}: {theirs} there, {ours} "
                        f"in this config; compute them for this config (`{BUILD_FIX.replace('DIR', 'NEW_DIR')}`) "
                        f"or set it back")


# --------------------------------------------------------------------------- the manifest

_TYPES = {"items": int, "shards": int, "shard_size": int, "dtype": str, "depends": dict, "latent_shapes": dict,
          "text_geometry": dict, "buckets": list}


def manifest_problem(m) -> str | None:
    """What makes ``m`` unusable as a trajectory cache manifest, or None."""
    if not isinstance(m, dict) or m.get("format") != FORMAT or m.get("version") != VERSION:
        return f"not a version-{VERSION} {FORMAT} manifest"
    for key, kind in _TYPES.items():
        if not isinstance(m.get(key), kind) or isinstance(m.get(key), bool):
            return f"{key} is missing or not {kind.__name__}"
    if m["dtype"] not in DTYPES or m["shard_size"] < 1 or m["shards"] != -(-m["items"] // m["shard_size"]):
        return f"dtype {m['dtype']!r}, {m['items']} items in {m['shards']} shards of {m['shard_size']} do not agree"
    sigmas = m["depends"].get("sigmas")
    if not (isinstance(sigmas, list) and sigmas and all(isinstance(s, float) for s in sigmas)):
        return "depends.sigmas is not a list of numbers"
    if not all(isinstance(s, list) and len(s) == 4 and all(isinstance(v, int) for v in s)
               for s in m["latent_shapes"].values()):
        return "latent_shapes is not one [C, T, H, W] per bucket"
    return None


def read_manifest(folder: Path, option: str = "distill.trajectories") -> dict:
    """The manifest of a trajectory cache, checked; one line naming the fix otherwise."""
    folder = Path(folder)
    where = f"{option}={folder}"
    fix = f"compute them again into a new folder (`{BUILD_FIX.replace('DIR', 'NEW_DIR')}`)"
    if not folder.is_dir():
        raise UserError(f"{where} does not exist; compute it with `{BUILD_FIX.replace('DIR', str(folder))}`")
    try:
        manifest = read_user_json(folder / MANIFEST, max_bytes=16 << 20)
    except FileNotFoundError:
        raise UserError(f"{where} is not a trajectory cache (no {MANIFEST}); {fix}") from None
    except (NotRegularFile, FileTooLarge, OSError, ValueError) as exc:
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise UserError(f"{folder / MANIFEST} cannot be read ({reason}); {fix}") from None
    problem = manifest_problem(manifest)
    if problem:
        raise UserError(f"{folder / MANIFEST} is not a valid trajectory cache manifest ({problem}); {fix}")
    return manifest


def expected_tensors(manifest: dict, rows: dict) -> dict[str, tuple[list[int], str]]:
    """Tensor name -> (shape, safetensors dtype) of a shard's items (``rows``: its index columns
    item, bucket, text_len), as the manifest says: what a shard's header must list."""
    dtype, dim = ST_DTYPES[manifest["dtype"]], int(manifest["text_geometry"]["dim"])
    steps, pooled = len(manifest["depends"]["sigmas"]), manifest["text_geometry"].get("pooled_dim")
    out = {}
    for item, bucket, n in zip(*(np.asarray(rows[k]).tolist() for k in ("item", "bucket", "text_len"))):
        shape = manifest["latent_shapes"][str(bucket)]
        for what in [f"state{k}" for k in range(steps)] + ["x0"]:
            out[tensor_key(item, what)] = (shape, dtype)
        out[tensor_key(item, "text")] = ([n, dim], dtype)
        if pooled:
            out[tensor_key(item, "pooled")] = ([pooled], dtype)
    return out
