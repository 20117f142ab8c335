"""The feature cache on disk: its folder layout, manifest, identities and checks.

A cache folder holds::

    manifest.json                   what was encoded, how, and with which encoders (written first)
    shards/shard-00000.safetensors  latents and valid caption tokens of up to ``shard_size`` samples
                                    (and, for a model that takes a given first frame, that frame's
                                    latents and image features: conditions.py)
    shards/shard-00000.parquet      that shard's index rows (written after its tensors: a shard is
                                    complete exactly when this file exists)
    index.parquet                   every encoded sample (written last: the cache is complete)
    failed.parquet                  the videos that could not be read, with the reason
    validation/                     the same layout for validation.csv, when the config has one
    .lock                           while a ``cache build`` writes the folder: its process and host

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
import math
import os
from pathlib import Path
from typing import Any

from videodit.config import Config, DataConfig
from videodit.config.schema import WEIGHT_FREE_VAE_KINDS
from videodit.data.feature_cache.audio import audio_problem
from videodit.data.feature_cache.conditions import conditions_problem
from videodit.errors import UserError
from videodit.user_files import FileTooLarge, NotRegularFile, check_regular_file, open_user_file, read_user_text

FORMAT = "videodit-feature-cache"
VERSION = 1
MANIFEST, INDEX, FAILED, SHARDS, VALIDATION = "manifest.json", "index.parquet", "failed.parquet", "shards", \
    "validation"
LOCK = ".lock"   # held by the `cache build` writing the folder (lock.py)
MAX_MANIFEST_BYTES = 16 << 20   # a manifest is ~10 KB; anything near this is not one
DTYPES = ("bf16", "fp32")
# Where frame counts are looked up when training from a cache (no VAE is built): the VAE's
# latent frame count for every clip length up to this.
MAX_FRAMES = 1024
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".json", ".model", ".txt")
_SAMPLED_BLOCKS, _BLOCK = 16, 1 << 16


def shard_name(shard: int) -> str:
    return f"shard-{shard:05d}"


def tensor_key(clip: int, view: int, what: str) -> str:
    """The name of one sample's tensor in its shard: ``latent``, ``text``, or a condition
    (``first_frame``, ``image``)."""
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
        with open_user_file(path) as f:   # a FIFO put in a model folder is refused, not waited on
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
    elif kind == "t5-clip" and folder.is_dir():
        weights = _t5_clip_digest(folder)
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


# The (T5, CLIP) folders text.kind=t5-clip reads inside text.path (models/mmdit/text.py's LAYOUTS).
_T5_CLIP_LAYOUTS = (("t5", "clip"), ("google/t5-v1_1-xxl", "openai/clip-vit-large-patch14"))


def _t5_clip_digest(folder: Path) -> str:
    """Open-Sora 2.0's text encoders count by the two folders ``text.kind=t5-clip`` reads (its
    ckpts/ download also holds the MMDiT and the VAEs); any other folder as a whole."""
    for parts in _T5_CLIP_LAYOUTS:
        if all((folder / part / "config.json").is_file() for part in parts):
            digests = " ".join(folder_digest(folder / part) for part in parts)
            return hashlib.sha256(digests.encode()).hexdigest()[:16]
    return folder_digest(folder)


def _image_encoder_digest(folder: Path) -> str:
    """The files the image encoder reads of ``image_encoder.path``, found as the loader finds
    them: a pipeline folder's ``image_encoder/``, or Wan's ``models_clip*.pth`` in its release
    folder (beside a 14B DiT that is not the image encoder); any other folder as a whole."""
    if (folder / "image_encoder" / "config.json").is_file():
        return folder_digest(folder / "image_encoder")
    originals = sorted(folder.glob("models_clip*.pth"))
    if originals:
        return hashlib.sha256(" ".join(folder_digest(p) for p in originals).encode()).hexdigest()[:16]
    return folder_digest(folder)


def image_encoder_identity(cfg: Config) -> dict | None:
    """The image encoder a config would build (``model.image_dim``: Wan 2.1 I2V's CLIP), as the
    cache records it; None for a model without one."""
    if cfg.model.image_dim is None:
        return None
    identity = {"kind": cfg.model.family, "dim": cfg.model.image_dim, "dtype": cfg.image_encoder.dtype}
    if not cfg.image_encoder.path:
        return identity
    where = Path(cfg.image_encoder.path).expanduser()
    weights = _image_encoder_digest(where) if where.is_dir() else folder_digest(where) if where.is_file() else None
    return {**identity, "path": str(where.resolve()), "weights": weights}


def encoder_identity(cfg: Config) -> dict:
    """The VAE and text encoder a config would build (and its image encoder, for a model with
    one), as the cache records them."""
    vae = {"kind": cfg.vae.kind, "scaling_factor": cfg.vae.scaling_factor}
    if cfg.vae.kind not in WEIGHT_FREE_VAE_KINDS:
        vae.update(subfolder=cfg.vae.subfolder, **_model_files(cfg.vae.path, cfg.vae.subfolder))
    if cfg.vae.dtype != "fp32":   # recorded only when set, so caches from before the key still match
        vae["dtype"] = cfg.vae.dtype
    text = {"kind": cfg.text.kind, "max_length": cfg.text.max_length}
    if cfg.text.kind == "toy":
        text["dim"] = cfg.text.dim
    else:
        text.update(dtype=cfg.text.dtype, **_model_files(cfg.text.path, kind=cfg.text.kind))
    # Recorded only when set, so caches from before these keys still match: both change the features.
    if not cfg.text.mask:
        text["mask"] = False
    if cfg.data.caption_suffix != "none":
        text["caption_suffix"] = cfg.data.caption_suffix
    image = image_encoder_identity(cfg)   # only for a model with one: other caches keep their manifest
    audio = audio_encoder_identity(cfg)   # only for a model.train_audio run (audio.py)
    return {"vae": vae, "text": text, **({"image": image} if image else {}), **({"audio": audio} if audio else {})}


def audio_encoder_identity(cfg: Config) -> dict | None:
    """The audio VAE of a ``model.train_audio`` config (``audio.*``), as the cache records it; None
    for a video-only run."""
    if not cfg.model.train_audio or cfg.audio.kind == "none":
        return None
    return {"kind": cfg.audio.kind, "subfolder": cfg.audio.subfolder, "dtype": cfg.audio.dtype,
            **_model_files(cfg.audio.path, cfg.audio.subfolder)}


def bucket_layout(data: DataConfig, buckets) -> dict:
    """What decides which clip lands in which shape and which frames it shows: the bucket
    table (without batch sizes), the frame sampling and the decoder's bounds."""
    from videodit.data.buckets.config import parse_bucket_config, resolve_bucket_config

    raw = resolve_bucket_config(data)
    entries = None
    if raw is not None:
        entries = [[e.resolution, e.num_frames, e.keep_prob, e.frame_prob] for e in parse_bucket_config(raw).entries]
    from videodit.data.pixels import RESIZE_METHOD
    from videodit.data.video import SHRINK_ABOVE, SHRINK_TO

    # How frames were decoded and resized: a build resumed with another bound, shrink rule or
    # resize would mix shards made two ways (same_build compares the whole manifest).
    decode = {"max_pixels": data.max_pixels, "shrink_above": SHRINK_ABOVE, "shrink_to": SHRINK_TO,
              "resize": RESIZE_METHOD}
    return {"buckets": [[b.resolution, b.num_frames, b.ratio, b.height, b.width] for b in buckets],
            "keep": entries, "frame_interval": data.frame_interval, "decode": decode}


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
    bucket table or another frame sampling than ``cfg``'s. Image features are compared where both
    the cache and ``cfg`` have them (whether the model needs conditions the cache lacks is
    ``conditions.require``'s to say)."""
    fix = f"rebuild it with `videodit cache build CONFIG --out NEW_DIR` for this config, or train with the " \
          f"settings it was built with (`videodit cache info {where}` lists them)"
    wanted = encoder_identity(cfg)
    for name, key in (("VAE", "vae"), ("text encoder", "text"), ("image encoder", "image"), ("audio VAE", "audio")):
        if key not in wanted or key not in manifest["encoders"]:   # image features or audio: one side has none
            continue
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


def regular(path: Path) -> bool:
    """Whether ``path`` is there (False: missing); a FIFO, socket, device or folder where a
    cache's file belongs is refused (``NotRegularFile``): reading one would block or never end."""
    try:
        check_regular_file(path)
    except FileNotFoundError:
        return False
    return True


def read_manifest(folder: Path, option: str = "data.cache") -> dict:
    path = folder / MANIFEST
    where = f"{option}={folder}" if option.startswith(("data.", "--")) else f"{option} {folder}"
    if not folder.is_dir():
        raise UserError(f"{where} does not exist; build it with `videodit cache build CONFIG --out {folder}`")
    fix = f"build the cache again into a new folder (`videodit cache build CONFIG --out NEW_DIR`), or delete " \
          f"{folder} first"
    try:
        if not regular(path):
            raise UserError(f"{where} is not a feature cache (no {MANIFEST}); build one with "
                            f"`videodit cache build CONFIG --out DIR`")
        manifest = json.loads(read_user_text(path, max_bytes=MAX_MANIFEST_BYTES))
    except NotRegularFile as exc:   # a FIFO would block the read forever
        raise UserError(f"{path} is {exc.strerror.split(';')[0]}; {fix}") from None
    except FileTooLarge as exc:
        raise UserError(f"{path} has {exc.strerror}: no cache manifest is that large; {fix}") from None
    except (OSError, ValueError, RecursionError) as exc:   # ValueError: not JSON, not UTF-8
        reason = "nested too deeply to be a manifest" if isinstance(exc, RecursionError) else \
            " ".join(str(exc).split())[:200] or type(exc).__name__
        raise UserError(f"{path} cannot be read ({reason}); {fix}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise UserError(f"{path} is not a version-{VERSION} {FORMAT} manifest; rebuild the cache with this videodit: "
                        f"{fix}")
    problem = manifest_problem(manifest)
    if problem:
        raise UserError(f"{path} is not a valid cache manifest ({problem}); {fix}")
    return manifest


_INT, _STR, _LIST, _DICT = (int,), (str,), (list,), (dict,)
# What the readers use of a manifest, by type: a hand-edited or crafted one is refused in one
# line instead of failing wherever a key is first used.
_MANIFEST_TYPES = {
    "shards": _INT, "items": _INT, "views": _INT, "shard_size": _INT, "seed": _INT, "dtype": _STR,
    "latents": _STR, "items_digest": _STR, "source": {"csv": _STR, "rows": _INT},
    "encoders": {"vae": {"kind": _STR}, "text": {"kind": _STR}},
    "layout": {"buckets": _LIST, "frame_interval": _INT},
    "latent": {"channels": _INT, "spatial_compression": _INT, "temporal_compression": _INT, "frames": _LIST,
               "shapes": _DICT},
    "text_geometry": {"dim": _INT, "max_length": _INT},
}
# Sizes a cache can have; beyond them a manifest would only make the reader allocate without end.
_MAX_ITEMS, _MAX_VIEWS = 1 << 31, 1 << 15


def _type_problem(value: Any, spec, where: str) -> str | None:
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            return f"{where or 'the manifest'} is not an object"
        for key, sub in spec.items():
            if key not in value:
                return f"no {(where + '.') if where else ''}{key}"
            problem = _type_problem(value[key], sub, f"{where}.{key}" if where else key)
            if problem:
                return problem
        return None
    if not isinstance(value, spec) or isinstance(value, bool):
        return f"{where} is {type(value).__name__}, not {spec[0].__name__}"
    if spec is _INT and value < 0:
        return f"{where} is negative"
    return None


def _int_list(value: Any, length: int | None = None) -> bool:
    return isinstance(value, list) and (length is None or len(value) == length) and \
        all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def manifest_problem(m: dict) -> str | None:
    """What makes ``m`` unusable as a cache manifest (types, sizes, consistency), or None."""
    problem = _type_problem(m, _MANIFEST_TYPES, "")
    if problem:
        return problem
    if m["dtype"] not in DTYPES:
        return f"dtype {str(m['dtype'])[:20]!r} is not one of {', '.join(DTYPES)}"
    if not 1 <= m["views"] <= _MAX_VIEWS or m["source"]["rows"] * m["views"] > _MAX_ITEMS \
            or m["items"] > _MAX_ITEMS:
        return f"{m['views']} views of {m['source']['rows']} clips, {m['items']} samples: more than a cache holds"
    if m["shard_size"] < 1 or m["shards"] != math.ceil(m["items"] / m["shard_size"]):
        return f"{m['shards']} shards do not hold {m['items']} samples of {m['shard_size']}"
    buckets, latent = m["layout"]["buckets"], m["latent"]
    if not all(isinstance(b, list) and len(b) == 5 and _int_list(b[1:2] + b[3:5]) for b in buckets):
        return "layout.buckets is not a list of [resolution, frames, ratio, height, width]"
    keep = m["layout"].get("keep", 0)   # missing: refused too
    if keep is not None and not (isinstance(keep, list) and all(isinstance(k, list) for k in keep)):
        return "layout.keep is neither null nor a list of bucket entries"
    if set(latent["shapes"]) != {str(b) for b in range(len(buckets))} or \
            not all(_int_list(shape, 4) for shape in latent["shapes"].values()):
        return "latent.shapes is not one [C, T, H, W] per bucket"
    if not _int_list(latent["frames"]) or min(latent["spatial_compression"], m["text_geometry"]["dim"]) < 1:
        return "latent.frames, latent.spatial_compression or text_geometry.dim is invalid"
    return conditions_problem(m) or audio_problem(m)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file, fsync, rename."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:   # a full disk, a signal: no temporary file left behind
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.filename is None:   # a failed write names no file: name it
            raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
        raise


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
    encoders = set(a["encoders"]) | set(b["encoders"])   # an image encoder on one side only differs
    return ({k: v for k, v in a.items() if k not in skip} == {k: v for k, v in b.items() if k not in skip}
            and not any(_encoder_differs(a["encoders"].get(k, {}), b["encoders"].get(k, {})) for k in encoders))


def jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value))
