"""The ``videodit`` command line.

Every subcommand turns a :class:`UserError` into one ``error: ...`` line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from videodit.errors import UserError, os_error_message


def _split_config_args(args: list[str]) -> tuple[str | None, list[str]]:
    """``[CONFIG] [key=value ...]``: the first argument without '=' names the config."""
    config = None
    overrides = []
    for arg in args:
        if "=" in arg:
            overrides.append(arg)
        elif config is None:
            config = arg
        else:
            raise UserError(f"unexpected argument {arg!r}: give one CONFIG, then key=value overrides")
    return config, overrides


# ---------------------------------------------------------------------------- commands


def cmd_train(ns) -> int:
    from videodit.config import load_config
    from videodit.parallel.distributed import launched_world_size
    from videodit.train.trainer import Trainer

    config, overrides = _split_config_args(ns.args)
    cfg = load_config(config, overrides)
    if ns.out:
        run_dir = Path(ns.out)
    elif launched_world_size() > 1:   # clocks differ: ranks would pick different folders
        raise UserError("under torchrun pass --out DIR, so that every rank writes the same run folder")
    else:
        run_dir = Path("runs") / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    trainer = Trainer(cfg, run_dir)
    try:
        say = print if trainer.is_main else (lambda *a, **k: None)
        say(f"run folder: {run_dir}  |  model: {cfg.model.preset}, {trainer.num_params:,} parameters  |  "
            f"data: {len(trainer.meta)} clips, device: {trainer.device}  |  {trainer.ctx.dims.describe()}, "
            f"global batch {cfg.train.batch_size} x {trainer.ctx.dp_size} rank(s) x {cfg.train.grad_accum}",
            flush=True)
        if trainer.meta.read_report is not None:
            say(trainer.meta.read_report.describe(), flush=True)
        if trainer.meta.bad_rows:
            kind = "CSV " if trainer.meta.unit == "line" else ""
            say(f"skipped {len(trainer.meta.bad_rows)} bad {kind}row(s), first: {trainer.meta.unit} "
                f"{trainer.meta.bad_rows[0][0]}: {trainer.meta.bad_rows[0][1]}", flush=True)
        result = trainer.fit()
        say(f"done: step {result['step']}, loss {result.get('loss', float('nan')):.4f}; samples in "
            f"{run_dir / 'samples'}, checkpoints in {run_dir / 'checkpoints'}", flush=True)
    finally:
        trainer.ctx.close()
    return 0


def cmd_sample(ns) -> int:
    from videodit.sample import Pipeline, write_clips
    from videodit.data.video import write_video

    prompts = _read_prompts(ns)
    out = Path(ns.out)
    pipeline = Pipeline(ns.ckpt, device=ns.device)
    size = pipeline.resolve(num_frames=ns.num_frames, height=ns.height, width=ns.width)
    if not ns.gif and out.suffix != ".gif" and (size["height"] % 2 or size["width"] % 2):
        raise UserError(f"mp4 needs an even height and width, got {size['height']}x{size['width']}; pass even "
                        "--height/--width, or --gif")
    try:
        clips = pipeline(prompts, **size, steps=ns.steps, guidance=ns.cfg, seed=ns.seed)
    except (MemoryError, RuntimeError) as exc:   # CUDA's OutOfMemoryError is a RuntimeError
        if not _out_of_memory(exc):
            raise
        raise UserError(f"sampling {len(prompts)} clip(s) of {size['num_frames']} frames at {size['height']}x"
                        f"{size['width']} needs more memory than {pipeline.device} has ({_first_line(exc)}); lower "
                        "--num-frames, --height or --width") from None
    fps = pipeline.cfg.sample.fps
    if len(prompts) == 1 and out.suffix in (".mp4", ".gif"):
        write_video(out, clips[0], fps)
        paths = [out]
    else:
        paths = write_clips(out, prompts, clips, fps, ".gif" if ns.gif else ".mp4")
    for path in paths:
        print(path)
    return 0


def _out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is running out of memory: Python's MemoryError, CUDA's OutOfMemoryError,
    or the RuntimeError of torch's CPU allocator."""
    text = str(exc)
    return isinstance(exc, MemoryError) or "out of memory" in text.lower() or "can't allocate memory" in text


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:160] if text else type(exc).__name__


def _read_prompts(ns) -> list[str]:
    if ns.prompt is not None:
        return [ns.prompt]
    path = Path(ns.prompts)
    if not path.is_file():
        raise UserError(f"prompt file {ns.prompts!r} does not exist; pass --prompts FILE with one prompt a line")
    prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise UserError(f"prompt file {ns.prompts!r} holds no prompts; write one prompt a line")
    return prompts


def cmd_config_show(ns) -> int:
    from videodit.config import load_config, to_yaml
    from videodit.data.buckets.config import parse_bucket_config, resolve_bucket_config

    config, overrides = _split_config_args(ns.args)
    cfg = load_config(config, overrides)
    # load_config leaves data.bucket_config to the data package; check it before printing.
    bucket_config = resolve_bucket_config(cfg.data)
    if bucket_config is not None:
        parse_bucket_config(bucket_config)
    print(to_yaml(cfg), end="")
    return 0


def cmd_config_keys(ns) -> int:
    from videodit.config import describe

    rows = describe()
    width = max(len(key) for key, _, _ in rows)
    for key, type_name, help_text in rows:
        print(f"{key:<{width}}  {help_text}  [{type_name}]")
    return 0


def cmd_toy_make(ns) -> int:
    from videodit.toy.make import make_toy_dataset

    started = time.time()
    sizes = [tuple(int(v) for v in size.lower().split("x")) for size in ns.sizes] if ns.sizes else None
    make_toy_dataset(ns.dir, clips_per_combination=ns.clips_per_combination, num_frames=ns.num_frames,
                     height=ns.height, width=ns.width, sizes=sizes, image_fraction=ns.image_fraction,
                     seed=ns.seed)
    print(f"wrote {ns.dir}/train.csv and {ns.dir}/val.csv in {time.time() - started:.1f}s")
    return 0


def cmd_toy_eval(ns) -> int:
    from videodit.toy.eval import evaluate
    from videodit.sample import Pipeline

    pipeline = Pipeline(ns.ckpt, device=ns.device)
    report = evaluate(pipeline, n=ns.num_prompts, seed=ns.seed, steps=ns.steps, guidance=ns.cfg)
    if ns.json:
        print(json.dumps(report))
        return 0
    print(f"checkpoint {report['checkpoint']}  ({report['n']} prompts)")
    print(f"{'group':<10}{'n':>5}{'colour':>10}{'direction':>11}")
    for name, group in (("all", report), ("seen", report["seen"]), ("held-out", report["heldout"])):
        fmt = lambda v: "-" if v is None else f"{v:.3f}"   # noqa: E731
        print(f"{name:<10}{group['n']:>5}{fmt(group['colour_accuracy']):>10}"
              f"{fmt(group['direction_accuracy']):>11}")
    return 0


def cmd_data_scan(ns) -> int:
    from videodit.data.scan import scan

    summary = scan(ns.paths, ns.out, captions=ns.captions, workers=ns.workers, verify=ns.verify)
    print(f"scanned {summary['found']} files in {summary['seconds']:.1f}s: {summary['ok']} rows in {summary['csv']}, "
          f"{summary['failed']} unreadable (listed in {summary['report']})")
    return 0


def cmd_data_filter(ns) -> int:
    from videodit.data.scan import filter_metadata

    bounds = {name: getattr(ns, name) for name in (
        "min_frames", "max_frames", "min_height", "max_height", "min_width", "max_width", "min_resolution",
        "max_resolution", "min_fps", "max_fps", "min_aspect_ratio", "max_aspect_ratio")}
    summary = filter_metadata(ns.csv, ns.out, images=not ns.no_images, videos=not ns.no_videos, progress=True,
                              **bounds)
    reasons = ", ".join(f"{k} {v}" for k, v in summary["dropped_by"].items() if v)
    print(f"kept {summary['kept']} of {summary['rows']} rows in {summary['csv']}"
          + (f"; dropped: {reasons}" if reasons else ""))
    return 0


def cmd_data_convert(ns) -> int:
    from videodit.data.metadata import convert_metadata

    summary = convert_metadata(ns.src, ns.dst)
    first = summary["first_bad"]
    print(f"wrote {summary['rows']:,} rows to {summary['out']}" + (
        f"; left out {summary['bad_rows']:,} bad row(s), first: {summary['unit']} {first[0]}: {first[1]}"
        if first else ""))
    return 0


def cmd_buckets(ns) -> int:
    import yaml

    from videodit.data.buckets.config import load_opensora_bucket_config, parse_bucket_config

    if ns.from_opensora:
        config = load_opensora_bucket_config(ns.from_opensora)
        parse_bucket_config(config)   # validate before printing
        text = yaml.safe_dump({"data": {"bucket_config": config}}, sort_keys=False, default_flow_style=None)
        if ns.meta is None:
            print(text, end="")
            return 0
        overrides = [f"data.bucket_config={json.dumps(config)}"]
    elif ns.meta is None:
        raise UserError("give a metadata CSV (videodit buckets META.csv --config CONFIG) or --from-opensora FILE.py")
    else:
        overrides = []

    from videodit.config import load_config
    from videodit.data.buckets.plan import BucketPlan
    from videodit.data.metadata import read_metadata
    from videodit.data.bucket_report import bucket_report, format_report

    cfg = load_config(ns.config, [*overrides, *ns.overrides])
    meta = read_metadata(ns.meta, bad_rows=cfg.data.bad_rows, cache=cfg.data.metadata_cache, progress=True)
    plan = BucketPlan(meta, cfg.data, cfg.train.batch_size, cfg.train.seed)
    report = bucket_report(plan, dp_size=ns.dp_size, epoch=ns.epoch)
    report["bad_rows"] = len(meta.bad_rows)
    report["read"] = dict(vars(meta.read_report))
    print(json.dumps(report) if ns.json else format_report(report))
    return 0


def cmd_ckpt_list(ns) -> int:
    from videodit.checkpoint import format_list, list_run

    run = Path(ns.run)
    if not run.is_dir():
        raise UserError(f"run folder {ns.run!r} does not exist")
    rows = list_run(run)
    print(json.dumps(rows, default=str) if ns.json else format_list(rows))
    return 0


def cmd_ckpt_inspect(ns) -> int:
    from videodit.checkpoint import format_inspect, inspect

    info = inspect(ns.ckpt)
    print(json.dumps(info, default=str) if ns.json else format_inspect(info))
    return 0


def cmd_ckpt_export(ns) -> int:
    from videodit.checkpoint import export

    out = export(ns.ckpt, ns.out, use_ema=ns.ema, dtype=ns.dtype)
    print(f"exported to {out} (videodit sample --ckpt {out} loads it)")
    return 0


def cmd_model_info(ns) -> int:
    import torch

    from videodit.components import model_geometry
    from videodit.config import MODEL_PRESETS, ModelConfig, load_config
    from videodit.models.stdit import STDiT, count_parameters

    cfg = load_config(ns.config, [])
    cfg.text.max_length = ns.caption_length
    print(f"{'preset':<7}{'depth':>6}{'hidden':>8}{'heads':>7}  {'patch':<10}{'parameters':>15}")
    for name, preset in MODEL_PRESETS.items():
        cfg.model = ModelConfig(preset=name).resolved()
        geometry = model_geometry(cfg, ns.latent_channels, ns.caption_channels)
        with torch.device("meta"):   # count without allocating weights
            count = count_parameters(STDiT(geometry))
        print(f"{name:<7}{preset['depth']:>6}{preset['hidden_size']:>8}{preset['num_heads']:>7}  "
              f"{str(tuple(preset['patch_size'])):<10}{count:>15,}")
    return 0


def _planner(ns, cfg):
    from videodit.planner.plan import LatentGeometry, planner_from_config
    from videodit.planner.report import parse_bytes

    gpu = parse_bytes(ns.gpu_mem)
    latent = LatentGeometry.parse(ns.latent) if ns.latent else None
    caption = None
    if ns.caption:
        try:
            channels, length = (int(v) for v in ns.caption.split(","))
        except ValueError:
            raise UserError(f"--caption {ns.caption!r} must be two integers CHANNELS,LENGTH, e.g. 4096,300") from None
        caption = (channels, length)
    encoder_bytes = 0 if ns.encoders_cached else (parse_bytes(ns.encoder_mem) if ns.encoder_mem else None)
    if not 0 <= ns.margin < 1:
        raise UserError(f"--margin {ns.margin} must be in [0, 1), e.g. 0.1 for 10% of the GPU kept free")
    return planner_from_config(cfg, gpu, world_size=ns.world_size, margin=ns.margin, latent=latent, caption=caption,
                               encoder_bytes=encoder_bytes), gpu


def cmd_plan(ns) -> int:
    from videodit.config import load_config
    from videodit.planner.plan import bucket_rows, plan_buckets, written_bucket_config
    from videodit.planner.report import plan_json, plan_summary, plan_table, write_bucket_config

    config, overrides = _split_config_args(ns.args)
    cfg = load_config(config, overrides)
    planner, gpu = _planner(ns, cfg)
    plans = plan_buckets(planner, bucket_rows(cfg), equal_step_time=ns.equal_step_time)
    if ns.write_bucket_config:
        write_bucket_config(ns.write_bucket_config, written_bucket_config(cfg, plans),
                            f"videodit plan: {plan_summary(planner, gpu)}")
    if ns.json:
        print(plan_json(planner, plans, gpu))
    else:
        print(plan_summary(planner, gpu))
        print(plan_table(planner, plans))
        if ns.write_bucket_config:
            print(f"bucket_config written to {ns.write_bucket_config} (data.bucket_config_file)")
    return 0


def cmd_tune(ns) -> int:
    from videodit.config import load_config
    from videodit.planner.plan import bucket_rows, equalise_step_time, plan_buckets, written_bucket_config
    from videodit.planner.report import gib, plan_summary, write_bucket_config
    from videodit.planner.tune import require_gpu
    from videodit.train.tune import tune_buckets

    require_gpu()
    config, overrides = _split_config_args(ns.args)
    cfg = load_config(config, overrides)
    if ns.gpu_mem is None:
        import torch
        ns.gpu_mem = str(torch.cuda.get_device_properties(0).total_memory)
    planner, gpu = _planner(ns, cfg)
    fits = plan_buckets(planner, bucket_rows(cfg))
    print(plan_summary(planner, gpu))
    print(f"{'resolution':<11}{'frames':>7}{'planned max':>12}{'tuned max':>10}{'peak GiB':>9}"
          f"{'predicted GiB':>14}{'step s':>8}")
    for tuned in tune_buckets(cfg, planner, fits, ns.steps):
        p, best = tuned.fit, tuned.best
        print(f"{p.resolution:<11}{p.num_frames:>7}{tuned.planned_max:>12}{p.max_batch_size:>10}"
              f"{gib(best.peak_bytes) if best else '-':>9}{gib(tuned.predicted_peak):>14}"
              f"{best.step_seconds if best else float('nan'):>8.3f}", flush=True)
    if ns.equal_step_time:
        equalise_step_time(planner, fits)
    if ns.write_bucket_config:
        write_bucket_config(ns.write_bucket_config, written_bucket_config(cfg, fits),
                            f"videodit tune: {plan_summary(planner, gpu)}")
        print(f"bucket_config written to {ns.write_bucket_config} (data.bucket_config_file)")
    return 0


# ---------------------------------------------------------------------------- parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be 1 or more")
    return value


def _guidance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be a finite number >= 0 (1 = no guidance)")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="videodit", description="Train and sample Open-Sora-style video "
                                     "diffusion transformers.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="train a model", description="Train. CONFIG is a YAML file or a preset "
                       "name (default: tiny, on the toy dataset); key.sub=value overrides follow it. "
                       "'videodit config keys' lists every key.")
    p.add_argument("args", nargs="*", metavar="[CONFIG] [key=value ...]")
    p.add_argument("--out", help="run folder (default: runs/NAME-TIMESTAMP)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("sample", help="sample videos from a checkpoint", description="Sample videos.")
    p.add_argument("--ckpt", required=True, help="run folder (newest checkpoint) or checkpoint folder")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", help="one prompt")
    group.add_argument("--prompts", help="file with one prompt a line")
    p.add_argument("--num-frames", type=_positive_int, help="frames (default: the training config's)")
    p.add_argument("--height", type=_positive_int, help="height in pixels (default: the training config's)")
    p.add_argument("--width", type=_positive_int, help="width in pixels (default: the training config's)")
    p.add_argument("--steps", type=_positive_int, help="Euler steps (default: sample.steps)")
    p.add_argument("--cfg", type=_guidance, help="classifier-free guidance scale, >= 0 (default: sample.cfg)")
    p.add_argument("--seed", type=int, default=0, help="noise seed")
    p.add_argument("--out", default="samples", help="output folder, or a .mp4/.gif file for one prompt")
    p.add_argument("--gif", action="store_true", help="write gif instead of mp4")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.set_defaults(func=cmd_sample)

    p = sub.add_parser("config", help="show the resolved config or list its keys")
    csub = p.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    q = csub.add_parser("show", help="print the resolved config", description="Print the resolved config.")
    q.add_argument("args", nargs="*", metavar="[CONFIG] [key=value ...]")
    q.set_defaults(func=cmd_config_show)
    q = csub.add_parser("keys", help="list every config key with its description")
    q.set_defaults(func=cmd_config_keys)

    p = sub.add_parser("toy", help="the synthetic toy dataset: make it, evaluate a model on it")
    tsub = p.add_subparsers(dest="toy_command", required=True, metavar="ACTION")
    q = tsub.add_parser("make", help="write captioned toy clips (mp4) and metadata CSVs",
                        description="Write DIR/videos/*.mp4, DIR/train.csv and DIR/val.csv.")
    q.add_argument("dir")
    q.add_argument("--clips-per-combination", type=int, default=10)
    q.add_argument("--num-frames", type=int, default=16)
    q.add_argument("--height", type=int, default=32)
    q.add_argument("--width", type=int, default=32)
    q.add_argument("--sizes", nargs="+", metavar="HxW", help="several clip sizes, cycled (e.g. 32x32 24x24)")
    q.add_argument("--image-fraction", type=float, default=0.0, help="fraction of train clips as still images")
    q.add_argument("--seed", type=int, default=0)
    q.set_defaults(func=cmd_toy_make)
    q = tsub.add_parser("eval", help="colour and motion accuracy of a toy-trained model",
                        description="Sample toy prompts and measure colour and direction accuracy.")
    q.add_argument("--ckpt", required=True, help="run folder or checkpoint folder")
    q.add_argument("--num-prompts", "-n", type=int, default=60, help="prompts (all 60 combinations by default)")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--steps", type=int, help="Euler steps (default: sample.steps)")
    q.add_argument("--cfg", type=float, help="guidance scale (default: sample.cfg)")
    q.add_argument("--json", action="store_true", help="print one JSON object")
    q.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    q.set_defaults(func=cmd_toy_eval)

    p = sub.add_parser("data", help="prepare metadata CSVs: scan videos, filter rows, convert to Parquet")
    dsub = p.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    q = dsub.add_parser("scan", help="probe videos and images into an Open-Sora metadata CSV",
                        description="Probe files and folders with PyAV in worker processes; unreadable files "
                        "go to OUT.errors.csv.")
    q.add_argument("paths", nargs="+", help="files or folders (searched recursively)")
    q.add_argument("-o", "--out", required=True, help="metadata CSV to write")
    q.add_argument("--captions", help="captions: a CSV with path,text or lines 'path<TAB>caption'")
    q.add_argument("--workers", type=int, default=0, help="worker processes (0 = one per core)")
    q.add_argument("--verify", action="store_true", help="decode every video to count its frames")
    q.set_defaults(func=cmd_data_scan)
    q = dsub.add_parser("filter", help="keep the rows of a metadata CSV within bounds",
                        description="Write the rows of CSV within all given (inclusive) bounds to OUT.")
    q.add_argument("csv")
    q.add_argument("-o", "--out", required=True)
    for name, kind in (("frames", int), ("height", int), ("width", int), ("resolution", int), ("fps", float),
                       ("aspect-ratio", float)):
        q.add_argument(f"--min-{name}", type=kind)
        q.add_argument(f"--max-{name}", type=kind)
    q.add_argument("--no-images", action="store_true", help="drop single-frame rows")
    q.add_argument("--no-videos", action="store_true", help="drop multi-frame rows")
    q.set_defaults(func=cmd_data_filter)
    q = dsub.add_parser("convert", help="write a metadata CSV as Parquet (or back), bad rows left out",
                        description="Write the good rows of SRC to DST, as Parquet when DST ends in .parquet, "
                        "else as CSV; num_frames, height and width become integers, aspect_ratio and fps floats.")
    q.add_argument("src", help="metadata CSV or .parquet")
    q.add_argument("dst", help="output file (.parquet or .csv)")
    q.set_defaults(func=cmd_data_convert)

    p = sub.add_parser("buckets", help="how a bucket_config splits a dataset into batches",
                       description="Show samples, batches and drops per bucket for one epoch, or convert an "
                       "Open-Sora config's bucket_config (read, never executed) to videodit YAML.")
    p.add_argument("meta", nargs="?", help="metadata CSV or .parquet")
    p.add_argument("--config", default="tiny", help="config (YAML or preset) whose data.bucket_config applies")
    p.add_argument("--from-opensora", metavar="FILE.py", help="take bucket_config from an Open-Sora config file")
    p.add_argument("--dp-size", type=int, default=1, help="data-parallel ranks (for steps per epoch)")
    p.add_argument("--epoch", type=int, default=0, help="epoch whose random draws to show")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    p.set_defaults(func=cmd_buckets)

    p = sub.add_parser("ckpt", help="list, inspect and export checkpoints")
    ksub = p.add_subparsers(dest="ckpt_command", required=True, metavar="ACTION")
    q = ksub.add_parser("list", help="a run's checkpoints: step, time, metrics, size, best/resumed marks")
    q.add_argument("run")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_ckpt_list)
    q = ksub.add_parser("inspect", help="a checkpoint's manifest, state and tensors")
    q.add_argument("ckpt")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_ckpt_inspect)
    q = ksub.add_parser("export", help="write model weights + config.json for sampling or sharing")
    q.add_argument("ckpt")
    q.add_argument("out")
    q.add_argument("--ema", action="store_true", help="export the EMA weights")
    q.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    q.set_defaults(func=cmd_ckpt_export)

    for name, func, text in (
            ("plan", cmd_plan, "predict per-bucket GPU memory and the largest batch sizes, without a GPU"),
            ("tune", cmd_tune, "find per-bucket batch sizes by trial steps on the GPU (out-of-memory safe)")):
        p = sub.add_parser(name, help=text, description=f"{text[0].upper()}{text[1:]}. CONFIG is a YAML file or "
                           "preset; key.sub=value overrides follow it. See docs/memory.md.")
        p.add_argument("args", nargs="*", metavar="[CONFIG] [key=value ...]")
        p.add_argument("--gpu-mem", required=name == "plan",
                       help="memory per GPU, e.g. 80GiB" + (" (default: this GPU's)" if name == "tune" else ""))
        p.add_argument("--world-size", type=int, help="GPUs in the job (default: the product of the parallel sizes)")
        p.add_argument("--margin", type=float, default=0.1, help="fraction of GPU memory kept free (default 0.1)")
        p.add_argument("--equal-step-time", action="store_true",
                       help="pick batch sizes with about equal FLOPs per step (capped by memory)")
        p.add_argument("--write-bucket-config", metavar="OUT.yaml", help="write the batch sizes as a bucket_config")
        p.add_argument("--latent", help="VAE geometry when the config's VAE is not built in: opensora-v1.2 or "
                       "C,FT,FS (channels, frames per latent frame, pixels per latent)")
        p.add_argument("--caption", help="text encoder geometry when not built in: CHANNELS,LENGTH (T5-XXL: 4096,300)")
        p.add_argument("--encoder-mem", help="GPU memory of the frozen encoders (default: their weight files)")
        p.add_argument("--encoders-cached", action="store_true", help="features are precomputed: no encoders on GPU")
        if name == "plan":
            p.add_argument("--json", action="store_true", help="print a JSON object instead of the table")
        else:
            p.add_argument("--steps", type=int, default=3, help="training steps per trial (default 3)")
        p.set_defaults(func=func)

    p = sub.add_parser("model", help="model presets")
    msub = p.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    q = msub.add_parser("info", help="print every preset's geometry and parameter count")
    q.add_argument("--config", default="tiny", help="config whose other model keys apply")
    q.add_argument("--latent-channels", type=int, default=4, help="VAE latent channels (Open-Sora: 4)")
    q.add_argument("--caption-channels", type=int, default=4096, help="text embedding width (T5-XXL: 4096)")
    q.add_argument("--caption-length", type=int, default=300, help="caption tokens (Open-Sora: 300)")
    q.set_defaults(func=cmd_model_info)
    return parser


def _peer_gone(exc: RuntimeError) -> bool:
    """A collective that failed because another rank's process ended (gloo or NCCL)."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return False
    text = str(exc).lower()
    return any(s in text for s in ("connection closed", "connection reset", "broken pipe", "socket closed",
                                   "nccl communicator was aborted", "remote process exited"))


def _rank_tag() -> str:
    """`` (rank N)`` under torchrun, so an error names the process that hit it."""
    return f" (rank {os.environ['RANK']})" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may come before or after options (train --out DIR key=value, or the reverse).
    ns, extra = parser.parse_known_args(argv)
    if extra:
        rest = "args" if hasattr(ns, "args") else "overrides" if hasattr(ns, "overrides") else None
        if rest is None or any(e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        setattr(ns, rest, getattr(ns, rest) + extra)
    try:
        return ns.func(ns)
    except UserError as exc:
        print(f"error{_rank_tag()}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:   # a full disk, a read-only folder, a path that is a file
        if os.environ.get("VIDEODIT_TRACEBACK"):
            raise
        print(f"error{_rank_tag()}: {os_error_message(exc)} (VIDEODIT_TRACEBACK=1 shows where)", file=sys.stderr)
        return 2
    except RuntimeError as exc:   # under torchrun: another rank stopped, so a collective failed
        if not _peer_gone(exc) or os.environ.get("VIDEODIT_TRACEBACK"):
            raise
        print(f"error{_rank_tag()}: another rank stopped (see its message, if it left one), so this one stops too",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
