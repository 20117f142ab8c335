"""``videodit distill trajectories``: the guided teacher's trajectories of a trajectory run,
computed once into the folder ``distill.trajectories`` reads (``trajectory.py``'s ``TrajectoryCache``;
the layout: ``distill/trajectory_cache.py``). Under torchrun rank r computes shards r, r + world, ...;
rank 0 prepares the folder, waits on every shard's file and writes the index. A killed build
started again checks the finished shards and redoes only the missing or damaged ones."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from safetensors.torch import save as save_safetensors

from videodit.components import build_encoders, build_model
from videodit.config import Config
from videodit.data.buckets.plan import BucketPlan
from videodit.data.dataset import VideoDataset
from videodit.data.feature_cache.format import atomic_write_bytes, jsonable, remove_leftovers, shard_name
from videodit.data.feature_cache.lock import BuildLock
from videodit.data.feature_cache.verify import INDEX_KEY, SHARD_KEY, record_of_part, shard_record
from videodit.data.feature_cache.writer import plan_items, shard_slice, valid_run
from videodit.data.metadata import read_metadata
from videodit.diffusion.rectified_flow import RectifiedFlow
from videodit.distill.dmd import guided
from videodit.distill.schedule import StudentSchedule
from videodit.distill.trajectory_cache import (DTYPES, FORMAT, INDEX, INDEX_SCHEMA, MANIFEST, SHARDS, VERSION,
                                               depends_problem, item_noise, item_seed, read_manifest, teacher_trajectory,
                                               tensor_key)
from videodit.errors import UserError
from videodit.models.families import get_spec
from videodit.models.spec import Conditions
from videodit.parallel.distributed import join_process_group, on_main_then_all, pick_device
from videodit.sample import negative_condition
from videodit.toy.make import ensure_toy_data
from videodit.train.dmd2 import check_distillation
from videodit.train.state import expert_init_source, init_weights_from
from videodit.train.trajectory import (_part_done, _refuse_given_frames, _shard_check, teacher_source,
                                       trajectory_depends)


class _Teacher:
    """The frozen, guided teacher as a run's objective calls it (``StudentObjective._teacher_x0``):
    fp32 weights, the run's autocast, the family's unconditional branch with the negative prompt."""

    def __init__(self, cfg: Config, model: torch.nn.Module, text, device: torch.device, use_bf16: bool):
        self.cfg, self.model, self.spec = cfg, model, get_spec(cfg.model.family)
        self.flow = RectifiedFlow(cfg.diffusion)
        self.autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if use_bf16 else \
            contextlib.nullcontext
        self.negative = negative_condition(text, cfg.sample.negative_prompt)

    def _x0(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditions) -> torch.Tensor:
        with self.autocast():
            out = self.model(*self.spec.model_inputs(x, sigma, cond))
        v = self.flow.model_velocity(out.float(), x, sigma)
        return x - sigma.view(-1, *([1] * (x.dim() - 1))) * v

    def x0(self, x: torch.Tensor, t: torch.Tensor, cond: Conditions) -> torch.Tensor:
        real, scale = self._x0(x, t, cond), self.cfg.distill.teacher_cfg
        if scale == 1:
            return real
        return guided(real, self._x0(x, t, self.spec.unconditional(cond, self.negative)), scale)


class _Build:
    """One build's inputs: the teacher, the encoders, the items (epoch 0's clips of the run's data,
    in clip order) with their captions, fps and noise seeds, and the manifest."""

    def __init__(self, cfg: Config, device: torch.device, dtype: str, shard_size: int, batch_size: int):
        tc = cfg.train
        self.cfg, self.device, self.dtype, self.batch_size = cfg, device, DTYPES[dtype], batch_size
        use_bf16 = tc.precision == "bf16" or (tc.precision == "auto" and device.type == "cuda")   # as the trainer
        self.encode_in_bf16 = use_bf16 and device.type == "cuda"
        vae, self.text = build_encoders(cfg, device)   # the VAE only for the latent geometry
        if self.encode_in_bf16:
            self.text.to(torch.bfloat16)
        _refuse_given_frames(cfg, vae, self.text)
        # The teacher as distillation_teacher builds it, one copy: the resolved start, or distill.teacher.
        cfg.model.init_from = cfg.model.init_from or cfg.distill.teacher
        cfg.model.init_from = expert_init_source(cfg)
        model = build_model(cfg, vae, self.text)
        init_weights_from(model, teacher_source(cfg))
        self.teacher = _Teacher(cfg, model.requires_grad_(False).eval().to(device), self.text, device, use_bf16)
        self.sigmas = StudentSchedule.of(cfg).sigmas.tolist()
        meta = read_metadata(cfg.data.csv, bad_rows=cfg.data.bad_rows, option="data.csv", cache=cfg.data.metadata_cache)
        plan = BucketPlan(meta, cfg.data, tc.batch_size, tc.seed)
        self.items = plan_items(plan.assign, 1)
        if not len(self.items):
            raise UserError(f"no clip of {cfg.data.csv} lands in a bucket, so there is nothing to compute "
                            f"(videodit buckets {cfg.data.csv} --config CONFIG shows why)")
        captions = VideoDataset(meta, plan, cfg.data.frame_interval, seed=tc.seed, max_pixels=cfg.data.max_pixels,
                                caption_suffix=cfg.data.caption_suffix)
        self.buckets = plan.buckets
        self.rows = []
        for item, (clip, bucket) in enumerate(zip(self.items.clip.tolist(), self.items.bucket.tolist())):
            b = plan.buckets[bucket]
            fps = meta.fps[clip] / (cfg.data.frame_interval if b.num_frames > 1 else 1)   # as VideoDataset.load
            self.rows.append(dict(item=item, clip=clip, bucket=bucket, frames=b.num_frames, height=b.height,
                                  width=b.width, fps=float(np.float32(fps)), noise_seed=item_seed(tc.seed, item),
                                  caption=captions.caption(clip, fps)))
        self.shapes = {str(i): [vae.latent_channels, *vae.latent_size(b.num_frames, b.height, b.width)]
                       for i, b in enumerate(plan.buckets)}
        self.manifest = jsonable({
            "format": FORMAT, "version": VERSION,
            "depends": trajectory_depends(cfg, vae, self.text),
            "source": {"csv": str(Path(cfg.data.csv).expanduser().resolve()), "digest": meta.digest, "rows": len(meta)},
            "seed": tc.seed, "items": len(self.items), "items_digest": self.items.digest(),
            "buckets": [[b.resolution, b.num_frames, b.ratio, b.height, b.width] for b in plan.buckets],
            "latent_shapes": self.shapes, "dtype": dtype, "shard_size": shard_size,
            "shards": -(-len(self.items) // shard_size), "batch_size": batch_size,
            "teacher_precision": "bf16 autocast" if use_bf16 else "fp32",
            "text_geometry": {"dim": self.text.dim, "max_length": self.text.max_length,
                              "pooled_dim": getattr(self.text, "pooled_dim", None)},
        })

    def groups(self, shard: int) -> list[list[int]]:
        """The teacher's batches of ``shard``: its items by bucket, in order, ``batch_size`` at most."""
        by_bucket: dict[int, list[int]] = {}
        for item in range(len(self.items))[shard_slice(shard, self.manifest["shard_size"])]:
            by_bucket.setdefault(self.rows[item]["bucket"], []).append(item)
        return [g[i : i + self.batch_size] for g in by_bucket.values() for i in range(0, len(g), self.batch_size)]

    @torch.no_grad()
    def run(self, items: list[int]):
        """(states at every student sigma, endpoints, caption tokens, mask, pooled or None) of
        ``items``: their captions encoded and their noise drawn as the online step does."""
        rows, device = [self.rows[i] for i in items], self.device
        encoding = torch.autocast("cuda", dtype=torch.bfloat16) if self.encode_in_bf16 else contextlib.nullcontext()
        with encoding:
            y, y_mask = self.text.encode([r["caption"] for r in rows])
            pooled = self.text.encode_pooled([r["caption"] for r in rows])
        pooled = None if pooled is None else pooled.float()
        n, shape = len(rows), self.shapes[str(rows[0]["bucket"])]
        height, width = (torch.full((n,), float(rows[0][k]), device=device) for k in ("height", "width"))
        fps = torch.tensor([r["fps"] for r in rows], dtype=torch.float32).to(device)
        cond = Conditions(y.float(), y_mask, torch.zeros(n, dtype=torch.bool, device=device), fps, height, width,
                          None, pooled=pooled)
        noise = torch.cat([item_noise(shape, r["noise_seed"]) for r in rows]).to(device)
        states, end = teacher_trajectory(lambda x, t: self.teacher.x0(x, t, cond), noise, self.sigmas,
                                         self.cfg.distill.teacher_substeps)
        return states, end, y.float(), y_mask, pooled


def write_shard(folder: Path, shard: int, tensors: dict[str, torch.Tensor], rows: list[dict]) -> None:
    """Tensors first, then the index part (its metadata: their SHA-256 and size): a shard is
    finished exactly when its part exists."""
    (folder / SHARDS).mkdir(parents=True, exist_ok=True)
    data = save_safetensors(tensors, metadata={"format": f"{FORMAT} shard {shard}"})
    record = shard_record(data)
    atomic_write_bytes(folder / SHARDS / f"{shard_name(shard)}.safetensors", data)
    table = pa.Table.from_pylist(sorted(rows, key=lambda r: r["item"]), schema=INDEX_SCHEMA)
    table = table.replace_schema_metadata({SHARD_KEY: json.dumps(record, sort_keys=True)})
    atomic_write_bytes(folder / SHARDS / f"{shard_name(shard)}.parquet", _parquet_bytes(table))


def _parquet_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def _compute_shards(build: _Build, folder: Path, rank: int, world: int, say) -> int:
    """Compute and write this rank's unfinished shards (``rank``, ``rank + world``, ...); returns the items."""
    done, started, shown = 0, time.perf_counter(), time.perf_counter()

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", build.dtype).contiguous()

    for shard in range(rank, build.manifest["shards"], world):
        if _part_done(folder, shard):
            continue
        tensors, rows = {}, []
        for items in build.groups(shard):
            states, end, y, y_mask, pooled = build.run(items)
            for j, item in enumerate(items):
                for k, state in enumerate(states):
                    tensors[tensor_key(item, f"state{k}")] = cast(state[j])
                tensors[tensor_key(item, "x0")] = cast(end[j])
                offset, count = valid_run(y_mask[j].cpu())
                tensors[tensor_key(item, "text")] = cast(y[j, offset : offset + count])
                if pooled is not None:
                    tensors[tensor_key(item, "pooled")] = cast(pooled[j])
                rows.append(dict(build.rows[item], shard=shard, text_offset=offset, text_len=count))
        write_shard(folder, shard, tensors, rows)
        done += len(rows)
        if time.perf_counter() - shown > 10:
            say(f"trajectories: {done} items, {done / (time.perf_counter() - started):.2f} items/s", flush=True)
            shown = time.perf_counter()
    return done


def _prepare(folder: Path, manifest: dict) -> str:
    """On rank 0, holding the lock: start, resume (finished shards checked, damaged ones removed) or
    refuse ``folder``; one line saying which."""
    if not (folder / MANIFEST).exists():
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(folder / MANIFEST, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
        return f"{folder}: {manifest['items']} items in {manifest['shards']} shard(s) of {manifest['shard_size']}"
    old = read_manifest(folder, option="--out")
    differs = sorted(k for k in set(old) | set(manifest) if k != "depends" and old.get(k) != manifest.get(k))
    if depends_problem(old["depends"], manifest["depends"]):
        differs.insert(0, depends_problem(old["depends"], manifest["depends"])[0])
    if differs:
        raise UserError(f"{folder} holds trajectories of another build (differs in: {', '.join(differs)}); pick "
                        "another --out, or delete that folder to compute them again")
    removed = remove_leftovers(folder)
    damaged = []
    for s in range(manifest["shards"]):
        part = folder / SHARDS / f"{shard_name(s)}.parquet"
        if not _part_done(folder, s):
            continue
        try:
            rows = pq.read_table(part, schema=INDEX_SCHEMA).to_pydict()
            problem = _shard_check(folder, s, manifest, rows, record_of_part(pq.read_schema(part).metadata))
        except Exception as exc:   # an index part pyarrow cannot read
            problem = " ".join(str(exc).split())[:200]
        if problem:   # the part first: a shard without it is unfinished whatever else is there
            part.unlink(missing_ok=True)
            (folder / SHARDS / f"{shard_name(s)}.safetensors").unlink(missing_ok=True)
            damaged.append(s)
    if damaged:
        (folder / INDEX).unlink(missing_ok=True)
    elif (folder / INDEX).is_file():
        return f"{folder}: complete already ({manifest['items']} items, every shard checked), nothing to do"
    done = sum(_part_done(folder, s) for s in range(manifest["shards"]))
    return (f"{folder}: resuming, {done} of {manifest['shards']} shards already written and checked"
            + (f" ({removed} unfinished file(s) of the interrupted build removed)" if removed else "")
            + (f"; {len(damaged)} damaged shard(s) removed, to compute again: {damaged[:10]}" if damaged else ""))


def _finish(folder: Path, shards: int, say) -> None:
    """On rank 0: wait for every shard (other ranks write theirs, no collective), then the index."""
    waited = time.perf_counter()
    while missing := [s for s in range(shards) if not _part_done(folder, s)]:
        if time.perf_counter() - waited > 60:
            say(f"waiting for {len(missing)} shard(s) of other ranks, e.g. {missing[0]}", flush=True)
            waited = time.perf_counter()
        time.sleep(0.5)
    if (folder / INDEX).is_file():
        return
    paths = [folder / SHARDS / f"{shard_name(s)}.parquet" for s in range(shards)]
    table = pa.concat_tables([pq.read_table(p, schema=INDEX_SCHEMA) for p in paths])
    records = {str(s): record_of_part(pq.read_schema(p).metadata) for s, p in enumerate(paths)}
    table = table.replace_schema_metadata({INDEX_KEY: json.dumps(records, sort_keys=True)})
    atomic_write_bytes(folder / INDEX, _parquet_bytes(table))
    say(f"{folder}: complete, {len(table)} items in {shards} shard(s)", flush=True)


def build_trajectories(cfg: Config, out: str | Path, *, shard_size: int = 32, batch_size: int = 1,
                       dtype: str = "fp32", log=print) -> dict:
    """Compute (or finish) the teacher trajectories of ``cfg``'s trajectory run in ``out``; returns
    what this process did. Runs alone or under torchrun (shard ``s`` on rank ``s % world``)."""
    if shard_size < 1 or batch_size < 1 or dtype not in DTYPES:
        raise UserError(f"--shard-size {shard_size} and --batch-size {batch_size} must be >= 1, --dtype one of "
                        f"{', '.join(DTYPES)}")
    cfg = copy.deepcopy(cfg)   # the teacher's source is resolved into it, as the trainer does
    if cfg.distill.method != "trajectory":
        raise UserError(f"videodit distill trajectories computes the teacher's trajectories of a trajectory run, not "
                        f"distill.method={cfg.distill.method}: set distill.method=trajectory (and distill.teacher)")
    check_distillation(cfg)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    device = pick_device(cfg.train.device, int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1 and not dist.is_initialized():
        join_process_group(device, timedelta(minutes=cfg.parallel.timeout_minutes))
    say = log if rank == 0 else (lambda *a, **k: None)
    out, lock = Path(out), BuildLock(out)
    try:
        if cfg.train.threads:   # as the trainer: the thread count can change a CPU forward's rounding
            torch.set_num_threads(cfg.train.threads)
        if cfg.train.deterministic:
            torch.use_deterministic_algorithms(True)
        on_main_then_all(lambda: ensure_toy_data(cfg))
        build = _Build(cfg, device, dtype, shard_size, batch_size)

        def prepare() -> str:
            if out.exists() and (not out.is_dir() or (not (out / MANIFEST).exists() and any(
                    p.name != ".lock" for p in out.iterdir()))):
                raise UserError(f"--out {out} is not an empty folder and holds no trajectory cache; pick a new or "
                                "empty folder")
            try:
                lock.acquire()
            except UserError as exc:   # the lock names the feature cache's command
                raise UserError(str(exc).replace("videodit cache build", "videodit distill trajectories")) from None
            return _prepare(out, build.manifest)

        say(on_main_then_all(prepare), flush=True)
        if dist.is_initialized():   # no collective after this point: ranks finish at their own pace
            dist.destroy_process_group()
        started = time.perf_counter()
        computed = _compute_shards(build, out, rank, world, say)
        seconds = time.perf_counter() - started
        if rank != 0:
            log(f"rank {rank}: computed {computed} trajectories in {seconds:.1f} s", flush=True)
            return {"computed": computed, "seconds": seconds}
        _finish(out, build.manifest["shards"], say)
        say(f"this run computed {computed} trajectories in {seconds:.1f} s on rank 0"
            f"{f' (of {world} ranks)' if world > 1 else ''}", flush=True)
        return {"computed": computed, "seconds": seconds, "items": build.manifest["items"]}
    finally:
        lock.release()
        if dist.is_initialized():
            dist.destroy_process_group()
