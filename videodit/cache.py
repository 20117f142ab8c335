"""``videodit cache build``: decode every sample of a config's data once, encode it with the
config's VAE and text encoder, and store latents and valid caption tokens in shards; for a model
that takes a given first frame (Wan i2v), also that frame's latents and, where the model embeds
them (Wan 2.1 I2V), its image features (data/feature_cache/conditions.py).

The samples and their frames are exactly those on-the-fly training draws: the config's bucket
plan assigns view ``v`` as epoch ``v`` (``plan_items``), and ``VideoDataset.load`` decodes the
frame window of epoch ``v``. Latents are the posterior mode, as ``FrozenVAE.encode`` gives
(docs/feature_cache.md says why). Under torchrun every rank encodes the shards ``rank``,
``rank + world``, ...; rank 0 checks and prepares the folder first, and at the end waits for
every shard (by its file, without a collective that could time out on a slow rank) and writes
the index. A killed build started again redoes only the shards without their index part.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from safetensors.torch import save as save_safetensors
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from videodit.components import build_audio_encoder, build_encoders, build_image_encoder, first_frame_features, model_geometry
from videodit.config import Config
from videodit.data.buckets.plan import BucketPlan
from videodit.data.dataset import VideoDataset
from videodit.data.decoder_choice import current_decoder, decoding_workers, resolve_decoder, using_decoder
from videodit.data.audio import AudioSpec
from videodit.data.feature_cache import audio as cache_audio
from videodit.data.feature_cache import conditions
from videodit.data.feature_cache.background import ShardWriterThread
from videodit.data.feature_cache.format import (DTYPES, FAILED, FORMAT, INDEX, LOCK, MANIFEST, MAX_FRAMES,
                                                SHARDS, VALIDATION, VERSION, atomic_write_bytes, bucket_layout,
                                                encoder_identity, jsonable, read_manifest, remove_leftovers,
                                                same_build, shard_name, write_manifest)
from videodit.data.feature_cache.lock import BuildLock
from videodit.data.feature_cache.reader import index_problem
from videodit.data.feature_cache.writer import (Items, ShardWriter, finish_index, part_problem, plan_items,
                                                shard_count, shard_done, shard_slice)
from videodit.data.metadata import read_metadata
from videodit.data.pixels import to_model_input
from videodit.data.video import VideoReadError
from videodit.errors import UserError
from videodit.models.families import get_spec
from videodit.parallel.distributed import join_process_group, on_main_then_all, pick_device
from videodit.toy.make import ensure_toy_data

_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class Encoders:
    """The frozen encoders of a build, and what they are asked to store beyond latents and captions."""

    vae: object
    text: object
    image: object | None       # the image encoder of a model that embeds the given frame's features
    conditions: tuple[str, ...]   # conditions.py: the first-frame conditions the config's model takes
    in_bf16: bool              # encode under bf16 autocast, as the trainer does on GPUs
    device: torch.device
    audio: object | None = None   # the audio VAE of a model.train_audio run (feature_cache/audio.py)


def _wanted_conditions(cfg: Config, vae, text, image) -> tuple[str, ...]:
    """What the config's model takes from each clip's first frame, asked of its family's spec."""
    geometry = model_geometry(cfg, vae.latent_channels, text.dim)
    return conditions.wanted(get_spec(cfg.model.family).takes_first_frame(geometry), image is not None,
                             pooled=getattr(text, "pooled_dim", None) is not None)


@dataclass
class Part:
    """One cache folder to fill: the training set (``out``) or the validation set (``out/validation``)."""

    folder: Path
    meta: object
    plan: BucketPlan
    items: Items
    manifest: dict


def build_cache(cfg: Config, out: str | Path, *, views: int = 1, shard_size: int = 256, dtype: str = "bf16",
                batch_size: int = 8, log=print) -> dict:
    """Build (or finish) the cache of ``cfg``'s data (and validation set) in ``out``; returns
    what this process did. Runs alone or under torchrun."""
    if views < 1 or shard_size < 1 or batch_size < 1:
        raise UserError(f"--views {views}, --shard-size {shard_size} and --batch-size {batch_size} must be >= 1")
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype} is not one of {', '.join(DTYPES)}")
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    device = pick_device(cfg.train.device, int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1 and not dist.is_initialized():
        join_process_group(device, timedelta(minutes=cfg.parallel.timeout_minutes))
    say = log if rank == 0 else (lambda *a, **k: None)
    lock = BuildLock(out)   # taken by rank 0, before anything in the folder is touched
    try:
        decoder = resolve_decoder(cfg.data.decoder, cfg.data.decode_device, notice=lambda line: say(line, flush=True))
        on_main_then_all(lambda: ensure_toy_data(cfg))
        vae, text = build_encoders(cfg, device)
        image = build_image_encoder(cfg, device)   # None unless the model embeds image features
        in_bf16 = device.type == "cuda" and cfg.train.precision in ("auto", "bf16")   # as the trainer encodes
        if in_bf16:
            text.to(torch.bfloat16)
        audio = build_audio_encoder(cfg, device) if cfg.model.train_audio else None   # its soundtracks' latents
        if audio is not None and not hasattr(text, "encode_streams"):
            raise UserError(f"model.train_audio: text.kind={cfg.text.kind} gives no audio-stream text to cache "
                            "(text.kind=gemma3-ltx2 does); set model.train_audio=false or use that text encoder")
        encoders = Encoders(vae, text, image, _wanted_conditions(cfg, vae, text, image), in_bf16, device, audio)
        out = Path(out)
        parts = [_part(cfg, out, cfg.data.csv, "data.csv", views, None, encoders, dtype, shard_size, batch_size)]
        if cfg.validation.csv:
            parts.append(_part(cfg, out / VALIDATION, cfg.validation.csv, "validation.csv", 1,
                               cfg.validation.max_samples, encoders, dtype, shard_size, batch_size))
        def prepare() -> list[str]:
            _refuse_foreign(out)   # before the lock: a folder of other files gets no .lock written into it
            lock.acquire()
            lines = [_prepare(p.folder, p.manifest) for p in parts]
            if conditions.POOLED in encoders.conditions:
                _write_empty_caption(out, encoders)
            return lines

        for line in on_main_then_all(prepare):
            say(line, flush=True)
        if dist.is_initialized():   # no collective after this point: ranks finish at their own pace
            dist.destroy_process_group()
        started, encoded = time.perf_counter(), 0
        with using_decoder(decoder):
            for part in parts:
                encoded += _encode_shards(cfg, part, encoders, device, rank, world, batch_size, _TORCH_DTYPES[dtype],
                                          show=rank == 0)
        seconds = time.perf_counter() - started
        rate = encoded / seconds if seconds > 0 else 0.0
        if rank != 0:
            log(f"rank {rank}: encoded {encoded} clips in {seconds:.1f} s ({rate:.1f} clips/s)", flush=True)
            return {"encoded": encoded, "seconds": seconds, "clips_per_s": rate}
        for part in parts:
            _finish(part, say)
        say(f"this run encoded {encoded} clips in {seconds:.1f} s: {rate:.1f} clips/s on rank 0"
            f"{f' (of {world} ranks)' if world > 1 else ''}", flush=True)
        return {"encoded": encoded, "seconds": seconds, "clips_per_s": rate, "samples": _samples(out)}
    finally:
        lock.release()
        if dist.is_initialized():
            dist.destroy_process_group()


def _part(cfg: Config, folder: Path, csv: str, option: str, views: int, limit: int | None, encoders: Encoders,
          dtype: str, shard_size: int, batch_size: int) -> Part:
    meta = read_metadata(csv, bad_rows=cfg.data.bad_rows, option=option, cache=cfg.data.metadata_cache)
    plan = BucketPlan(meta, cfg.data, cfg.train.batch_size, cfg.train.seed)
    items = plan_items(plan.assign, views, limit)
    if not len(items):
        raise UserError(f"no sample of {csv} lands in a bucket, so there is nothing to cache "
                        f"(videodit buckets {csv} --config CONFIG shows why)")
    vae, text = encoders.vae, encoders.text
    s = vae.spatial_compression
    frames = []
    for n in range(1, MAX_FRAMES + 1):
        try:
            frames.append(int(vae.latent_size(n, s, s)[0]))
        except (ValueError, UserError):
            frames.append(-1)
    shapes = {str(i): [vae.latent_channels, *vae.latent_size(b.num_frames, b.height, b.width)]
              for i, b in enumerate(plan.buckets)}
    manifest = jsonable({
        "format": FORMAT, "version": VERSION,
        "source": {"csv": str(Path(csv).expanduser().resolve()), "digest": meta.digest, "rows": len(meta)},
        "encoders": encoder_identity(cfg), "layout": bucket_layout(cfg.data, plan.buckets),
        "seed": cfg.train.seed, "views": views, "dtype": dtype, "latents": "mode",
        "encode_precision": "bf16 autocast" if encoders.in_bf16 else "fp32", "encode_batch": batch_size,
        "latent": {"channels": vae.latent_channels, "spatial_compression": vae.spatial_compression,
                   "temporal_compression": vae.temporal_compression, "frames": frames, "shapes": shapes},
        "text_geometry": {"dim": text.dim, "max_length": text.max_length},
        "items": len(items), "items_digest": items.digest(), "shard_size": shard_size,
        "shards": shard_count(len(items), shard_size),
        **conditions.manifest_entries(encoders.conditions, *_image_geometry(encoders, plan.buckets[0]),
                                      pooled_dim=getattr(text, "pooled_dim", None)),
        **cache_audio.manifest_entries(encoders.audio, _audio_text_dim(encoders)),
    })
    return Part(folder, meta, plan, items, manifest)


def _image_geometry(encoders: Encoders, bucket) -> tuple[int | None, int | None]:
    """(tokens, dim) of the image encoder's features of one frame (None, None without one), from
    a grey frame of ``bucket``'s size (the manifest is written before anything is encoded)."""
    if encoders.image is None:
        return None, None
    frame = torch.zeros(1, 3, 1, bucket.height, bucket.width, device=encoders.device)
    features = first_frame_features(encoders.image, frame)
    return int(features.shape[1]), int(features.shape[2])


def _write_empty_caption(folder: Path, encoders: Encoders) -> None:
    """The encoding of "" (fp32) that caption dropout of a pooled text encoder trains on, encoded
    as the trainer encodes it; kept when a resumed build finds it."""
    if (folder / conditions.EMPTY_CAPTION).is_file():
        return
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if encoders.in_bf16 else contextlib.nullcontext()
    with torch.no_grad(), autocast:
        y, mask = encoders.text.encode([""])
        pooled = encoders.text.encode_pooled([""])
    tensors = {"y": y.float().cpu().contiguous(), "mask": mask.cpu().contiguous(),
               "pooled": pooled.float().cpu().contiguous()}
    atomic_write_bytes(folder / conditions.EMPTY_CAPTION, save_safetensors(tensors))


def _refuse_foreign(folder: Path) -> None:
    """Refuse an ``--out`` that is a file, or a folder of files that are no cache."""
    if folder.exists() and (not folder.is_dir() or (not (folder / MANIFEST).exists() and any(
            p.name not in (VALIDATION, LOCK) for p in folder.iterdir()))):
        raise UserError(f"--out {folder} is not an empty folder and holds no cache; pick a new or empty folder")


def _prepare(folder: Path, manifest: dict) -> str:
    """On rank 0, holding the folder's lock: start, resume or refuse ``folder``; one line saying which."""
    if (folder / MANIFEST).exists():   # read_manifest refuses a FIFO or anything else in its place
        old = read_manifest(folder, option="--out")
        if not same_build(old, manifest):
            differs = sorted(k for k in set(old) | set(manifest) if old.get(k) != manifest.get(k))
            raise UserError(f"{folder} holds a cache of another build (differs in: {', '.join(differs)}); pick another "
                            "--out, or delete that folder to rebuild it")
        removed = remove_leftovers(folder)
        damaged = _remove_damaged(folder, manifest)
        index = (folder / INDEX).exists() or (folder / INDEX).is_symlink()
        bad_index = index and not damaged and index_problem(folder, manifest)
        if damaged or bad_index:
            (folder / INDEX).unlink(missing_ok=True)   # written again once the damaged shards are
            (folder / FAILED).unlink(missing_ok=True)
        repair = (f"; {len(damaged)} damaged shard(s) removed, to encode again: "
                  f"{', '.join(map(str, damaged[:10]))}{' ...' if len(damaged) > 10 else ''}") if damaged else ""
        repair += f"; damaged index removed, to write again ({bad_index})" if bad_index else ""
        if (folder / INDEX).is_file():
            return f"{folder}: complete already ({manifest['items']} samples, every shard checked), nothing to do"
        done = sum(shard_done(folder, s) for s in range(manifest["shards"]))
        return (f"{folder}: resuming, {done} of {manifest['shards']} shards already written and checked"
                + (f" ({removed} unfinished file(s) of the interrupted build removed)" if removed else "") + repair)
    _refuse_foreign(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_manifest(folder, manifest)
    return f"{folder}: {manifest['items']} samples in {manifest['shards']} shard(s) of {manifest['shard_size']}"


def _remove_damaged(folder: Path, manifest: dict) -> list[int]:
    """Check every finished shard (SHA-256 and header against its index part); delete the
    damaged ones' files so that this build encodes them again. Returns their numbers."""
    damaged = [s for s in range(manifest["shards"]) if shard_done(folder, s) and part_problem(folder, s, manifest)]
    for s in damaged:   # the index part first: a shard without it is unfinished whatever else is there
        (folder / SHARDS / f"{shard_name(s)}.parquet").unlink(missing_ok=True)
        (folder / SHARDS / f"{shard_name(s)}.safetensors").unlink(missing_ok=True)
    return damaged


class _Decode(Dataset):
    """Items by position: the decoded clip of (clip, view, bucket), or why it could not be read."""

    def __init__(self, dataset: VideoDataset, items: Items):
        self.dataset, self.items = dataset, items

    def __getitem__(self, position: int) -> dict:
        clip, view, bucket = (int(a[position]) for a in (self.items.clip, self.items.view, self.items.bucket))
        try:
            return self.dataset.load(clip, view, bucket)
        except VideoReadError as exc:
            return {"failed": exc.reason, "path": self.dataset.meta.paths[clip]}

    def __getitems__(self, positions: list[int]) -> list[dict]:
        return [self[p] for p in positions]


def _groups(items: Items, shards: list[int], shard_size: int, batch_size: int) -> list[tuple[int, list[int]]]:
    """(shard, positions) encode batches: each shard's items by bucket, in order, ``batch_size`` at most."""
    out = []
    for shard in shards:
        positions = range(len(items))[shard_slice(shard, shard_size)]
        by_bucket: dict[int, list[int]] = {}
        for p in positions:
            by_bucket.setdefault(int(items.bucket[p]), []).append(p)
        for group in by_bucket.values():
            out += [(shard, group[i : i + batch_size]) for i in range(0, len(group), batch_size)]
    return out


def _encode_shards(cfg: Config, part: Part, encoders: Encoders, device: torch.device, rank: int, world: int,
                   batch_size: int, dtype: torch.dtype, show: bool) -> int:
    """Encode and write this rank's unfinished shards of ``part``; returns the clips read."""
    shards = part.manifest["shards"]
    mine = [s for s in range(rank, shards, world) if not shard_done(part.folder, s)]
    groups = _groups(part.items, mine, part.manifest["shard_size"], batch_size)
    if not groups:
        return 0
    dataset = VideoDataset(part.meta, part.plan, cfg.data.frame_interval, seed=cfg.train.seed,
                           max_pixels=cfg.data.max_pixels, caption_suffix=cfg.data.caption_suffix,
                           audio=AudioSpec.from_config(cfg.data) if encoders.audio is not None else None)
    decode = _Decode(dataset, part.items)
    # Workers decode while this process encodes.
    loader = DataLoader(decode, batch_sampler=[g for _, g in groups], collate_fn=list,
                        num_workers=cfg.data.num_workers, **decoding_workers(current_decoder(), cfg.data.num_workers))
    total = sum(len(g) for _, g in groups)
    bar = tqdm(total=total, desc=f"cache {part.folder.name}", unit="clip", dynamic_ncols=True,
               disable=None if show else True)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if encoders.in_bf16 else contextlib.nullcontext()
    items, writer, done, started, shown = part.items, None, 0, time.perf_counter(), time.perf_counter()
    background = ShardWriterThread()   # writes each finished shard while the next one is encoded
    try:
        for (shard, positions), samples in zip(groups, loader):
            if writer is not None and writer.shard != shard:
                background.submit(writer)
            if writer is None or writer.shard != shard:
                writer = ShardWriter(part.folder, shard, dtype)
            good = []
            for p, sample in zip(positions, samples):
                if "failed" in sample:
                    writer.fail(int(items.clip[p]), int(items.view[p]), int(items.bucket[p]), sample["path"],
                                sample["failed"])
                else:
                    good.append((p, sample))
            if good:
                video = to_model_input(torch.stack([s["video"] for _, s in good]), device)
                with torch.no_grad(), autocast:
                    latents = encoders.vae.encode(video).float()
                    y, mask = encoders.text.encode([s["text"] for _, s in good])
                    extra = _first_frame_conditions(encoders, video)
                    if conditions.POOLED in encoders.conditions:
                        extra[conditions.POOLED] = encoders.text.encode_pooled([s["text"] for _, s in good]).float()
                    if encoders.audio is not None:
                        extra.update(cache_audio.soundtrack_tensors(encoders.audio, encoders.text, [s for _, s in good],
                                                                    [s["text"] for _, s in good], mask, device))
                for j, (p, sample) in enumerate(good):
                    writer.add(int(items.clip[p]), int(items.view[p]), int(items.bucket[p]), float(sample["fps"]),
                               latents[j], y[j].float(), mask[j], {name: t[j] for name, t in extra.items()})
            done += len(positions)
            bar.update(len(positions))
            now = time.perf_counter()
            if show and bar.disable and now - shown > 10:
                print(f"cache {part.folder.name}: {done}/{total} clips, {done / (now - started):.1f} clips/s",
                      flush=True)
                shown = now
        if writer is not None:
            background.submit(writer)
        background.close()   # the last shards written; the thread's error, if any, raised here
    finally:
        background.close(abort=True)   # after an error: nothing more is written once this returns
        bar.close()
    return done


def _audio_text_dim(encoders: Encoders) -> int | None:
    """The width of the audio stream's caption tokens (None without audio), from one short caption."""
    if encoders.audio is None:
        return None
    with torch.no_grad():
        return int(encoders.text.encode_streams([""])[1].shape[-1])


def _first_frame_conditions(encoders: Encoders, video: torch.Tensor) -> dict[str, torch.Tensor]:
    """The first-frame conditions ``encoders.conditions`` of a batch ``video`` [B, 3, T, H, W], as
    training on the fly computes them: the VAE latents of the clip with every frame after the
    first zero (``components.first_frame_given`` before its mask), and the image features."""
    out = {}
    if conditions.FIRST_FRAME in encoders.conditions:
        first = torch.zeros_like(video)
        first[:, :, 0] = video[:, :, 0]
        out[conditions.FIRST_FRAME] = encoders.vae.encode(first).float()
    if conditions.IMAGE in encoders.conditions:
        out[conditions.IMAGE] = first_frame_features(encoders.image, video)
    return out


def _finish(part: Part, say) -> None:
    """On rank 0: wait for every shard of ``part`` (other ranks write theirs), then the index."""
    if (part.folder / INDEX).is_file():
        return
    shards, waited = part.manifest["shards"], time.perf_counter()
    while missing := [s for s in range(shards) if not shard_done(part.folder, s)]:
        if time.perf_counter() - waited > 60:
            say(f"waiting for {len(missing)} shard(s) of other ranks, e.g. {missing[0]}", flush=True)
            waited = time.perf_counter()
        time.sleep(0.5)
    table = finish_index(part.folder, shards)
    ok = table.column("ok").to_pylist()
    failed = ok.count(False)
    say(f"{part.folder}: complete, {ok.count(True)} samples in {shards} shard(s)", flush=True)
    if failed:
        bad = pq.read_table(part.folder / FAILED).to_pylist()[:3]
        say(f"skipped {failed} unreadable video(s) (not in the cache), e.g. "
            + "; ".join(f"{r['path']}: {r['reason']}" for r in bad), flush=True)


def _samples(out: Path) -> int:
    return pq.read_metadata(out / INDEX).num_rows if (out / INDEX).is_file() else 0


__all__ = ["build_cache"]
