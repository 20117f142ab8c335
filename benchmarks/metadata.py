"""Metadata at scale: the columnar reader and node cache, the vectorized sampler plan.

    python benchmarks/metadata.py [--rows 10000000] [--small-rows 1000000] [--ranks 4]
                                  [--repeats 2] [--work DIR] [--before 610fe6b] [--before-rows N ...]
                                  [--only-startup] [--only-fingerprint]

Synthetic Open-Sora metadata is written once into ``--work`` (kept for later runs) as CSV
and Parquet: ``path,text,num_frames,height,width,aspect_ratio,fps,resolution``; 30% images
(1 frame, fps 120), videos of log-normal length around 150 frames; sizes from 25 common
sources, 30% jittered +-10%, 20% portrait; captions of 14 words (~85 characters); 0.01%
bad rows (negative num_frames). Then, each in its own process, wall seconds and peak RSS
(``wait4``), every measurement ``--repeats`` times interleaved, the best reported:

* ``pyarrow.csv.read_csv(FILE)`` with pyarrow's defaults (threads on), and
  ``pyarrow.parquet.read_table(FILE)``: the bare reads the reader is held against;
* ``videodit buckets FILE --config opensora-v1.2-stage1 --json`` (Open-Sora 1.2 stage 1:
  626 buckets), the whole command (imports, read and check, bucket assignment, the
  epoch's sampler plan, the report): cold (a fresh ``data.metadata_cache`` folder, so the
  file is read, checked and cached), warm (the same folder again: cache and epoch-0
  assignment mapped) and ``data.metadata_cache=null`` (read, not cached);
* before/after at ``--before-rows`` (default ``--small-rows``): the same command run on the
  code of commit ``--before`` (``git archive`` into a temporary folder, first on PYTHONPATH;
  a read-only git command), without a cache as the old code had none;
* training start-up under torchrun (gloo, CPU, ``OMP_NUM_THREADS=1``): on every rank,
  ``build_training_data`` (metadata, bucket plan, sampler plan and its first batch) for
  the stage-1 config, from a barrier to the end of the slowest rank, at 1 rank and at
  ``--ranks`` ranks, each with a fresh cache. Memory per rank from
  ``/proc/self/smaps_rollup`` at the end (all ranks still alive): RSS counts shared pages
  (libraries, the mapped cache) once per rank; PSS splits them between the ranks that map
  them, so the sum of PSS is the node memory the ranks use; "anon" is the anonymous
  (heap) memory, which no other process shares and the kernel cannot drop, unlike the
  mapped cache's file pages. "above floor" subtracts each rank's value measured just before
  ``build_training_data`` (Python, torch and gloo).

* the node cache's key (``node_cache.entry_key``: inode, ctime, size, mtime and 64 sampled
  64 KiB blocks) of the CSV at ``--small-rows`` and ``--rows``, in this process: cold (the
  file dropped from the page cache first: fsync, then ``posix_fadvise(DONTNEED)``; the pages
  still resident are counted with ``fincore`` where it exists) and warm (the same call
  again), best of ``--repeats``; beside it, what a hash of the whole file (SHA-256, 16 MiB
  reads) would cost, cold and warm. ``--only-fingerprint`` measures this alone.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

STAGE1 = "opensora-v1.2-stage1"
NEUTRAL = tempfile.gettempdir()
SIZES = [(144, 256), (180, 320), (240, 426), (240, 320), (270, 480), (360, 640), (360, 480), (480, 854),
         (480, 640), (540, 960), (576, 720), (720, 1280), (720, 960), (1080, 1920), (1080, 1440),
         (1440, 2560), (2160, 3840), (256, 256), (512, 512), (1024, 1024), (800, 1920), (1038, 1920),
         (1080, 2560), (100, 100), (120, 160)]
WORDS = ("a the red blue green small large person dog cat car city street forest river ocean sky sunset night "
         "walking running driving flying slowly quickly across through under over near camera pans zooms "
         "view of aerial close-up shot scene with and in on at").split()


def synthetic(n: int, folder: Path, seed: int = 0) -> tuple[Path, Path]:
    """``meta{n}.csv`` and ``meta{n}.parquet`` in ``folder`` (made once, then reused)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    csv_path, parquet_path = folder / f"meta{n}.csv", folder / f"meta{n}.parquet"
    if csv_path.exists() and parquet_path.exists():
        return csv_path, parquet_path
    rng = np.random.default_rng(seed)
    sizes = np.array(SIZES)[rng.integers(0, len(SIZES), n)]
    sizes = np.maximum(16, np.round(sizes * np.where(rng.random((n, 1)) < 0.3, rng.uniform(0.9, 1.1, (n, 2)), 1)))
    portrait = rng.random(n) < 0.2
    h = np.where(portrait, sizes[:, 1], sizes[:, 0]).astype(np.int64)
    w = np.where(portrait, sizes[:, 0], sizes[:, 1]).astype(np.int64)
    image = rng.random(n) < 0.3
    frames = np.where(image, 1, np.clip(np.round(rng.lognormal(np.log(150), 1.0, n)), 2, 5000)).astype(np.int64)
    frames[rng.random(n) < 1e-4] = -3                                     # bad rows
    fps = np.where(image, 120.0, np.array([24.0, 25.0, 30.0, 29.97, 60.0])[rng.integers(0, 5, n)])
    names = pa.array(np.arange(n)).cast(pa.string())
    path = pc.binary_join_element_wise(pa.array(np.where(image, "images/", "clips/")),
                                       pa.array(np.arange(n) // 10000).cast(pa.string()), "/", names,
                                       pa.array(np.where(image, ".jpg", ".mp4")), "")
    vocab = pa.array(WORDS)
    text = pc.binary_join_element_wise(*[vocab.take(pa.array(rng.integers(0, len(WORDS), n))) for _ in range(14)], " ")
    table = pa.table({"path": path, "text": text, "num_frames": frames, "height": h, "width": w,
                      "aspect_ratio": np.round(h / w, 4), "fps": fps, "resolution": h * w})
    folder.mkdir(parents=True, exist_ok=True)
    pcsv.write_csv(table, csv_path)
    pq.write_table(table, parquet_path)
    return csv_path, parquet_path


def run(command: list[str], env: dict | None = None, cwd: str | None = None) -> tuple[float, float, str]:
    """(wall seconds, peak RSS in GiB, stdout) of a command in its own process, started in
    ``cwd`` (default: a neutral folder, so that ``python -m videodit`` finds the package
    through PYTHONPATH or the installed one, never the current folder)."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=cwd or NEUTRAL,
                               env={**os.environ, **(env or {})})
    out = process.stdout.read().decode()
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise SystemExit(f"{' '.join(command)} failed with {process.returncode}")
    return time.perf_counter() - start, usage.ru_maxrss / 2**20, out


def buckets(meta: Path, cache: str, python_path: str | None = None) -> tuple[float, float, dict]:
    env = {"PYTHONPATH": python_path} if python_path else None
    option = [] if python_path else [f"data.metadata_cache={cache}"]   # the old code has no such key
    # The seed is named because the preset's changed (#15 set Open-Sora's 42): the keep
    # probabilities draw with it, and the old code must draw the same.
    seconds, rss, out = run([sys.executable, "-m", "videodit", "buckets", str(meta), "--config", STAGE1, "--json",
                             "train.seed=42", *option], env)
    report = json.loads(out)
    if python_path and "read" in report:
        raise SystemExit(f"the run meant for {python_path} ran the current code")
    return seconds, rss, report


def best(results: list[tuple]) -> tuple:
    return min(results, key=lambda r: r[0])


def memory() -> dict:
    fields = {}
    with open("/proc/self/smaps_rollup") as handle:
        for line in handle:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) / 2**20   # GiB
    return {"rss": fields["Rss"], "pss": fields["Pss"], "anon": fields["Anonymous"],
            "uss": fields["Private_Clean"] + fields["Private_Dirty"],
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def worker(csv: str, cache: str, out: str) -> None:
    """One torchrun rank: time ``build_training_data`` and measure memory before and after."""
    import torch.distributed as dist

    from videodit.config import load_config
    from videodit.data.loader import build_training_data

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = load_config(STAGE1, [f"data.csv={csv}", f"data.metadata_cache={cache}"])
    floor = memory()
    dist.barrier()
    start = time.perf_counter()
    data = build_training_data(cfg.data, batch_size=cfg.train.batch_size, seed=cfg.train.seed, dp_rank=rank,
                               dp_size=world)
    steps, first = len(data.sampler), next(iter(data.sampler))
    seconds = time.perf_counter() - start
    dist.barrier()   # every rank done (and alive) before any measures
    report = {"rank": rank, "seconds": seconds, "floor": floor, "end": memory(), "steps": steps,
              "first_batch": len(first), "how": data.meta.read_report.how.split(" /")[0],
              "read_s": data.meta.read_report.seconds}
    reports = [None] * world
    dist.all_gather_object(reports, report)
    if rank == 0:
        Path(out).write_text(json.dumps(reports))
    dist.barrier()
    dist.destroy_process_group()


def startup(csv: Path, ranks: int, work: Path) -> dict:
    cache, out = work / f"cache-startup-{ranks}", work / f"startup-{ranks}.json"
    shutil.rmtree(cache, ignore_errors=True)
    wall, _, _ = run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                      str(Path(__file__).resolve()), "--worker", str(csv), str(cache), str(out)],
                     {"OMP_NUM_THREADS": "1"})
    reports = json.loads(out.read_text())
    shutil.rmtree(cache, ignore_errors=True)
    total = lambda part, key: sum(r[part][key] for r in reports)
    return {"ranks": ranks, "seconds": max(r["seconds"] for r in reports), "torchrun_wall": wall,
            "read_s": max(r["read_s"] for r in reports), "how": [r["how"] for r in reports],
            "rss": total("end", "rss"), "pss": total("end", "pss"), "uss": total("end", "uss"),
            "anon": total("end", "anon"), "anon_above_floor": total("end", "anon") - total("floor", "anon"),
            "peak_rss": total("end", "peak_rss"),
            "pss_above_floor": total("end", "pss") - total("floor", "pss"),
            "rss_above_floor": total("end", "rss") - total("floor", "rss"), "steps": reports[0]["steps"]}


def drop_from_page_cache(path: Path) -> int | None:
    """Evict ``path``'s pages (written back first; DONTNEED drops only clean pages); the pages
    still resident afterwards, by ``fincore``, or None where it cannot tell."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    try:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                             capture_output=True, text=True, check=True).stdout
        return int(out.split()[0])
    except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
        return None


def whole_file_sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(16 << 20):
            digest.update(block)
    return digest.hexdigest()


def fingerprints(sizes: list[int], work: Path, repeats: int) -> list[dict]:
    """Seconds of ``entry_key`` (and of a whole-file SHA-256) on each size's CSV, cold and warm."""
    from videodit.data.metadata import _CODE
    from videodit.data.node_cache import entry_key

    rows = []
    for n in sizes:
        csv, _ = synthetic(n, work)
        size = csv.stat().st_size
        for label, call in (("entry_key (inode, ctime, size, mtime, 64 x 64 KiB)", lambda: entry_key(csv, _CODE)),
                            ("whole-file SHA-256 (for comparison)", lambda: whole_file_sha256(csv))):
            cold, warm, resident, keys = [], [], [], set()
            for _ in range(repeats):
                resident.append(drop_from_page_cache(csv))
                for times in (cold, warm):
                    start = time.perf_counter()
                    keys.add(call())
                    times.append(time.perf_counter() - start)
            rows.append({"rows": n, "bytes": size, "what": label, "cold_s": min(cold), "warm_s": min(warm),
                         "resident_before_cold": resident, "same_key": len(keys) == 1})
            print(f"{n:,} rows ({size / 2**20:,.0f} MiB) {label}: cold {min(cold) * 1e3:.2f} ms, warm "
                  f"{min(warm) * 1e3:.2f} ms (resident before cold: {resident})", flush=True)
    print("\n| rows | CSV MiB | what | cold ms | warm ms |\n|---:|---:|---|---:|---:|")
    for r in rows:
        print(f"| {r['rows']:,} | {r['bytes'] / 2**20:,.0f} | {r['what']} | {r['cold_s'] * 1e3:,.2f} | "
              f"{r['warm_s'] * 1e3:,.2f} |")
    return rows


def before_code(ref: str) -> str:
    folder = Path(tempfile.mkdtemp(prefix="videodit-before-"))
    archive = subprocess.run(["git", "archive", "--format=tar", ref, "videodit"], check=True, capture_output=True,
                             cwd=Path(__file__).resolve().parents[1]).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return str(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--small-rows", type=int, default=1_000_000)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "videodit-metadata-bench")
    parser.add_argument("--before", default="610fe6b", help="commit with the row-by-row reader ('' to skip)")
    parser.add_argument("--before-rows", type=int, nargs="*", help="row counts to run --before at (default: "
                        "--small-rows; at 10M rows the old reader needs about 15 GB)")
    parser.add_argument("--only-startup", action="store_true", help="only the torchrun start-up measurement")
    parser.add_argument("--only-fingerprint", action="store_true", help="only the node cache key's cost, cold and warm")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker)

    import pyarrow

    work = args.work
    results: dict = {"rows": args.rows, "small_rows": args.small_rows, "pyarrow": pyarrow.__version__,
                     "cpus": os.cpu_count()}
    print(f"{os.cpu_count()} CPUs, pyarrow {pyarrow.__version__}, numpy {np.__version__}; work folder {work}",
          flush=True)
    if args.only_fingerprint:
        results["fingerprint"] = fingerprints([args.small_rows, args.rows], work, args.repeats)
        (work / "results-fingerprint.json").write_text(json.dumps(results, indent=1, default=str))
        return
    rows, now = [], {}
    for n in () if args.only_startup else (args.small_rows, args.rows):
        csv, parquet = synthetic(n, work)
        for kind, path, bare in (("CSV", csv, "import pyarrow.csv as m, sys; m.read_csv(sys.argv[1])"),
                                 ("Parquet", parquet, "import pyarrow.parquet as m, sys; m.read_table(sys.argv[1])")):
            measured: dict = {"bare": [], "cold": [], "warm": [], "null": []}
            for _ in range(args.repeats):
                measured["bare"].append(run([sys.executable, "-c", bare, str(path)]))
                cache = work / "cache-buckets"
                shutil.rmtree(cache, ignore_errors=True)
                measured["cold"].append(buckets(path, str(cache)))
                measured["warm"].append(buckets(path, str(cache)))
                measured["null"].append(buckets(path, "null"))
            shutil.rmtree(work / "cache-buckets", ignore_errors=True)
            bare_s, bare_gib, _ = best(measured["bare"])
            reports = [r[2] for key in ("cold", "warm", "null") for r in measured[key]]
            same = all({k: v for k, v in r.items() if k != "read"} == {k: v for k, v in reports[0].items()
                                                                      if k != "read"} for r in reports)
            now[(n, kind)] = reports[0]
            for key, label in (("cold", "cold cache"), ("warm", "warm cache"), ("null", "no cache")):
                seconds, gib, report = best(measured[key])
                rows.append((n, kind, label, seconds, seconds / bare_s, gib, report["read"]["seconds"]))
            rows.append((n, kind, "bare pyarrow read", bare_s, 1.0, bare_gib, None))
            results[f"{n}-{kind}"] = {"bare": measured["bare"], **{k: [(s, g, r["read"]) for s, g, r in v]
                                                                   for k, v in measured.items() if k != "bare"},
                                      "same_report": same, "kept": reports[0]["kept"],
                                      "global_batches": reports[0]["global_batches"]}
            print(f"{n:,} rows {kind}: bare {bare_s:.2f}s; buckets cold {best(measured['cold'])[0]:.2f}s, warm "
                  f"{best(measured['warm'])[0]:.2f}s; identical reports: {same}", flush=True)
        if args.before and n in (args.before_rows or [args.small_rows]):
            code = before_code(args.before)
            try:
                old = [buckets(csv, "null", code) for _ in range(args.repeats)]
            finally:
                shutil.rmtree(code, ignore_errors=True)
            seconds, gib, report = best(old)
            new = [r for r in results[f"{n}-CSV"]["null"]]
            same = {k: v for k, v in report.items() if k != "read"} == {
                k: v for k, v in now[(n, "CSV")].items() if k != "read"}
            rows.append((n, "CSV", f"before ({args.before})", seconds, None, gib, None))
            results["before"] = {"runs": [(s, g) for s, g, _ in old], "same_report_as_now": same,
                                 "now_no_cache": [(s, g) for s, g, _ in new]}
            print(f"before ({args.before}) at {n:,} rows: {seconds:.1f}s, {gib:.2f} GiB; same buckets and batches as "
                  f"now: {same}", flush=True)

    if rows:
        print("\n| rows | file | videodit buckets | wall s | x bare read | peak RSS GiB | read+check s |")
        print("|---:|---|---|---:|---:|---:|---:|")
    for n, kind, label, seconds, ratio, gib, read_s in rows:
        print(f"| {n:,} | {kind} | {label} | {seconds:.2f} | {'-' if ratio is None else f'{ratio:.2f}'} | "
              f"{gib:.2f} | {'-' if read_s is None else f'{read_s:.2f}'} |")

    csv, _ = synthetic(args.rows, work)
    runs = {1: [], args.ranks: []}
    for _ in range(args.repeats):   # interleaved; the fastest run of each
        for ranks in runs:
            runs[ranks].append(startup(csv, ranks, work))
            print(f"start-up at {ranks} rank(s): {runs[ranks][-1]['seconds']:.2f}s", flush=True)
    starts = {ranks: min(found, key=lambda s: s["seconds"]) for ranks, found in runs.items()}
    results["startup"] = runs
    one, many = starts[1], starts[args.ranks]
    print(f"\ntraining start-up, {args.rows:,} rows, cold cache, torchrun gloo CPU, best of {args.repeats}:\n")
    print("| ranks | start-up s (slowest rank) | read+check s | RSS sum GiB | PSS sum GiB | PSS above floor GiB "
          "| anon above floor GiB | peak RSS sum GiB | who read |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for s in starts.values():
        print(f"| {s['ranks']} | {s['seconds']:.2f} | {s['read_s']:.2f} | {s['rss']:.2f} | {s['pss']:.2f} | "
              f"{s['pss_above_floor']:.2f} | {s['anon_above_floor']:.2f} | {s['peak_rss']:.2f} | "
              f"{', '.join(s['how'])} |")
    ratio = lambda key: f"{many[key] / one[key]:.2f}x"
    print(f"\n{args.ranks} ranks / 1 rank: time {ratio('seconds')}, RSS sum {ratio('rss')}, PSS sum {ratio('pss')}, "
          f"PSS above floor {ratio('pss_above_floor')}, anon above floor {ratio('anon_above_floor')}")
    if not args.only_startup:
        print(f"\nnode cache key, best of {args.repeats}:")
        results["fingerprint"] = fingerprints([args.small_rows, args.rows], work, args.repeats)
    (work / "results.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
