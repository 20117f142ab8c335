"""Data commands: ``videodit toy``, ``videodit data`` and ``videodit buckets``."""

from __future__ import annotations

import json
import time

from videodit.errors import UserError


def cmd_toy_make(ns) -> int:
    from videodit.toy.make import make_toy_dataset

    started = time.time()
    sizes = [tuple(int(v) for v in size.lower().split("x")) for size in ns.sizes] if ns.sizes else None
    make_toy_dataset(ns.dir, clips_per_combination=ns.clips_per_combination, num_frames=ns.num_frames,
                     height=ns.height, width=ns.width, sizes=sizes, image_fraction=ns.image_fraction,
                     seed=ns.seed, audio=ns.audio)
    print(f"wrote {ns.dir}/train.csv and {ns.dir}/val.csv in {time.time() - started:.1f}s")
    return 0


def cmd_toy_eval(ns) -> int:
    from videodit.toy.eval import evaluate
    from videodit.sample import Pipeline

    pipeline = Pipeline(ns.ckpt, device=ns.device, audio=True)   # a model that trained sound makes it
    report = evaluate(pipeline, n=ns.num_prompts, seed=ns.seed, steps=ns.steps, guidance=ns.cfg)
    if ns.json:
        print(json.dumps(report))
        return 0
    audio = report.get("audio")
    print(f"checkpoint {report['checkpoint']}  ({report['n']} prompts)")
    print(f"{'group':<10}{'n':>5}{'colour':>10}{'direction':>11}" + (f"{'pitch':>8}{'timing':>8}" if audio else ""))
    fmt = lambda v, width: f"{'-' if v is None else f'{v:.3f}':>{width}}"   # noqa: E731
    for name, key in (("all", None), ("seen", "seen"), ("held-out", "heldout")):
        group = report[key] if key else report
        line = f"{name:<10}{group['n']:>5}{fmt(group['colour_accuracy'], 10)}{fmt(group['direction_accuracy'], 11)}"
        if audio:
            sound = audio[key] if key else audio
            line += f"{fmt(sound['pitch_accuracy'], 8)}{fmt(sound['timing_f1'], 8)}"
        print(line)
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


def register(sub) -> None:
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
    q.add_argument("--audio", action="store_true",
                   help="give every mp4 a soundtrack: a tone pitched by colour, a click when the shape hits an edge")
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
