"""The feature cache on disk: its folder layout, manifest, identities and checks.

A cache folder holds::

    manifest.json                   what was encoded, how, and with which encoders (written first)
    shards/shard-00000.safetensors  latents and valid caption tokens of up to ``shard_size`` samples
    shards/shard-00000.parquet      that shard's index rows (written after its tensors: a shard is
                                    complete exactly when this file exists)
    index.parquet                   every encoded sample (written last: the cache is complete)
    failed.parquet                  the videos that could not be read, with the reason
    validation/                     the same layout for validation.csv, when the config has one

Every file is written to a temporary name and renamed into place, so a killed build leaves
whole files or none; ``cache build`` then redoes only the shards without an index part.

Identities say what a cache can be used with. The *encoders* are their kinds, settings and a
digest of their files (sizes plus sampled blocks: fast on a 19 GB T5, and it tells apart two
fine-tunes of one architecture); the *layout* is the bucket table (shapes and keep
probabilities, not batch sizes, which training may change) and the frame sampling. Training
with ``data.cache`` refuses a cache whose identities differ from its config's.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from videodit.config import Config, DataConfig
from videodit.errors import UserError

FORMAT = "videodit-feature-cache"
VERSION = 1
MANIFEST, INDEX, FAILED, SHARDS, VALIDATION = "manifest.json", "index.parquet", "failed.parquet", "shards", \
    "validation"
DTYPES = ("bf16", "fp32")
# Where frame counts are looked up when training from a cache (no VAE is built): the VAE's
# latent frame count for every clip length up to this.
MAX_FRAMES = 1024
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".json", ".model", ".txt")
_SAMPLED_BLOCKS, _BLOCK = 16, 1 << 16


def shard_name(shard: int) -> str:
    return f"shard-{shard:05d}"


def tensor_key(clip: int, view: int, what: str) -> str:
    """The name of one sample's tensor in its shard: ``latent`` or ``text``."""
    return f"{clip}.{view}.{what}"


# --------------------------------------------------------------------------- identities


def folder_digest(folder: Path) -> str:
    """A digest of a model folder's weight and config files: names, sizes, and 16 blocks of
    64 KiB spread over each file (whole files up to 1 MiB). A file (Wan's ``Wan2.1_VAE.pth``) is
    digested as a folder holding it alone."""
    folder = Path(folder)
    if folder.is_file():
        return _digest_files(folder.parent, [folder])
    return _digest_files(folder, sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES))


def _digest_files(root: Path, files) -> str:
    digest = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.relative_to(root).as_posix()}\0{size}\0".encode())
        with open(path, "rb") as f:
            if size <= _SAMPLED_BLOCKS * _BLOCK:
                digest.update(f.read())
                continue
            for i in range(_SAMPLED_BLOCKS):
                f.seek((size - _BLOCK) * i // (_SAMPLED_BLOCKS - 1))
                digest.update(f.read(_BLOCK))
    return digest.hexdigest()[:16]


def _model_files(path: str | None, subfolder: str | None = None, kind: str | None = None) -> dict:
    """``path`` and, when it is a folder or a file here, the digest of its files (None where it is
    not: a cache copied to a machine without the encoders is then checked by path alone).
    ``kind="umt5"``: only the folders the umT5 encoder reads (a whole diffusers Wan folder also
    holds the transformer and the VAE, which are not the text encoder)."""
    if not path:
        return {}
    folder = Path(path).expanduser() / subfolder if subfolder else Path(path).expanduser()
    weights = None
    if kind == "umt5" and folder.is_dir():
        weights = _umt5_digest(folder)
    elif folder.is_dir() or folder.is_file():
        weights = folder_digest(folder)
    return {"path": str(Path(path).expanduser().resolve()), "weights": weights}


def _umt5_digest(folder: Path) -> str:
    """A diffusers Wan folder counts by its ``text_encoder/`` and ``tokenizer/`` only, what
    ``text.kind=umt5`` reads (a fine-tuned ``transformer/`` beside them is not the text encoder);
    any other folder as a whole."""
    parts = [folder / "text_encoder", folder / "tokenizer"]
    if not (parts[0] / "config.json").is_file():
        return folder_digest(folder)
    digests = " ".join(folder_digest(part) for part in parts if part.is_dir())
    return hashlib.sha256(digests.encode()).hexdigest()[:16]


def encoder_identity(cfg: Config) -> dict:
    """The VAE and text encoder a config would build, as the cache records them."""
    vae = {"kind": cfg.vae.kind, "scaling_factor": cfg.vae.scaling_factor}
    if cfg.vae.kind != "identity":
        vae.update(subfolder=cfg.vae.subfolder, **_model_files(cfg.vae.path, cfg.vae.subfolder))
    if cfg.vae.dtype != "fp32":   # recorded only when set, so caches from before the key still match
        vae["dtype"] = cfg.vae.dtype
    text = {"kind": cfg.text.kind, "max_length": cfg.text.max_length}
    if cfg.text.kind == "toy":
        text["dim"] = cfg.text.dim
    else:
        text.update(dtype=cfg.text.dtype, **_model_files(cfg.text.path, kind=cfg.text.kind))
    return {"vae": vae, "text": text}


def bucket_layout(data: DataConfig, buckets) -> dict:
    """What decides which clip lands in which shape and which frames it shows: the bucket
    table (without batch sizes) and the frame sampling."""
    from videodit.data.buckets.config import parse_bucket_config, resolve_bucket_config

    raw = resolve_bucket_config(data)
    entries = None
    if raw is not None:
        entries = [[e.resolution, e.num_frames, e.keep_prob, e.frame_prob] for e in parse_bucket_config(raw).entries]
    return {"buckets": [[b.resolution, b.num_frames, b.ratio, b.height, b.width] for b in buckets],
            "keep": entries, "frame_interval": data.frame_interval}


def describe_encoder(identity: dict) -> str:
    """``kind`` plus the path or settings, for messages and ``cache info``."""
    parts = [identity["kind"]]
    if identity.get("path"):
        parts.append(identity["path"])
    parts += [f"{k}={identity[k]}" for k in ("dim", "max_length", "dtype", "scaling_factor", "subfolder")
              if identity.get(k) is not None]
    if identity.get("weights"):
        parts.append(f"files {identity['weights']}")
    return " ".join(parts)


def _encoder_differs(cached: dict, wanted: dict) -> bool:
    """Whether two encoder identities differ; a folder missing on one side (weights None) is
    compared by its path."""
    keys = set(cached) | set(wanted)
    if cached.get("weights") and wanted.get("weights"):
        keys.discard("path")
    else:
        keys.discard("weights")
    return any(cached.get(k) != wanted.get(k) for k in keys)


def check_compatible(manifest: dict, cfg: Config, buckets, where: str) -> None:
    """Refuse, in one line with the reason and the fix, a cache made for other encoders, another
    bucket table or another frame sampling than ``cfg``'s."""
    fix = f"rebuild it with `videodit cache build CONFIG --out NEW_DIR` for this config, or train with the " \
          f"settings it was built with (`videodit cache info {where}` lists them)"
    wanted = encoder_identity(cfg)
    for name, key in (("VAE", "vae"), ("text encoder", "text")):
        cached = manifest["encoders"][key]
        if _encoder_differs(cached, wanted[key]):
            raise UserError(f"data.cache={where} was built with another {name} ({describe_encoder(cached)}; this "
                            f"config: {describe_encoder(wanted[key])}): {fix}")
    layout, cached = bucket_layout(cfg.data, buckets), manifest["layout"]
    if layout["frame_interval"] != cached["frame_interval"]:
        raise UserError(f"data.cache={where} was built with another frame sampling (data.frame_interval="
                        f"{cached['frame_interval']}, this config: {layout['frame_interval']}): {fix}")
    for what, key in (("resolution table", "buckets"), ("bucket keep probabilities", "keep")):
        theirs, ours = [tuple(b) for b in cached[key] or ()], [tuple(b) for b in layout[key] or ()]
        if theirs != ours:
            only = [b for b in theirs if b not in ours][:1] or [b for b in ours if b not in theirs][:1]
            example = f"; e.g. {list(only[0])} is in {'the cache' if only[0] in theirs else 'this config'} only" \
                if only else "; the same entries in another order"
            raise UserError(f"data.cache={where} was built with another {what} ({len(theirs)} entries, this "
                            f"config: {len(ours)}{example}): {fix}")


# --------------------------------------------------------------------------- manifest


def read_manifest(folder: Path, option: str = "data.cache") -> dict:
    path = folder / MANIFEST
    where = f"{option}={folder}" if option.startswith(("data.", "--")) else f"{option} {folder}"
    if not folder.is_dir():
        raise UserError(f"{where} does not exist; build it with `videodit cache build CONFIG --out {folder}`")
    if not path.is_file():
        raise UserError(f"{where} is not a feature cache (no {MANIFEST}); build one with "
                        f"`videodit cache build CONFIG --out DIR`")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{path} cannot be read ({exc}); rebuild the cache") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise UserError(f"{path} is not a version-{VERSION} {FORMAT} manifest; rebuild the cache with this videodit")
    return manifest


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file, fsync, rename."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_manifest(folder: Path, manifest: dict) -> None:
    atomic_write_bytes(folder / MANIFEST, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())


def remove_leftovers(folder: Path) -> int:
    """Delete the temporary files of writes that a kill interrupted; returns how many."""
    count = 0
    for sub in (folder, folder / SHARDS):
        if sub.is_dir():
            for path in sub.iterdir():
                if path.name.startswith(".") and ".tmp-" in path.name:
                    path.unlink(missing_ok=True)
                    count += 1
    return count


def same_build(a: dict, b: dict) -> bool:
    """Whether two manifests describe the same build (what a resumed build must match)."""
    skip = {"encoders"}
    return ({k: v for k, v in a.items() if k not in skip} == {k: v for k, v in b.items() if k not in skip}
            and not any(_encoder_differs(a["encoders"][k], b["encoders"][k]) for k in ("vae", "text")))


def jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value))
