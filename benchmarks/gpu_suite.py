"""The GPU measurements, in one command: run it on a machine with a GPU, read the section it
appends to benchmarks/RESULTS.md.

    python benchmarks/gpu_suite.py                      # everything the time budget allows (9.5 min)
    python benchmarks/gpu_suite.py --sections mfu,sdpa  # some of it
    python benchmarks/gpu_suite.py --dry-run            # CPU, tiny shapes, fp32: every code path, no figures

Everything does not fit in one 10-minute invocation on one GPU: measurements that would start
after ``--budget-minutes`` are listed as not measured. Run the rest in a second invocation, e.g.
``--sections families`` then ``--sections mfu,sdpa,fastpaths,planner,tune,levers,parallel``; each
appends its own section.

Needs nothing but this repository and its dependencies: no internet, no pip registry, no
pretrained weights (see "Offline" in ``--help``). The workload (but the families section's) is the
XL preset with Open-Sora 1.2's geometry (28 block pairs, hidden 1152, 16 heads, patch (1, 2, 2),
captions of 300 tokens x 4096 channels, 4-channel latents at 1/8 of the pixels and 17 frames ->
5 latent frames), random weights, random latents and random caption embeddings fed straight to the model (no VAE, no T5).
Every step runs what the Trainer runs: ``parallel.parallelize`` (activation checkpointing,
compile, memory levers, FSDP2/TP/SP/PP), the rectified-flow loss, gradient clipping and
AdamW (fused on CUDA).

Sections (``--sections``, default all, run in this order):

* ``families``: every model family at real width: Wan 2.1 1.3B whole at 480p x 81; Wan 2.1 14B
  (4 blocks) at 480p x 81, Open-Sora 2.0's MMDiT (2 double + 4 single blocks) at 256px x 129 and
  LTX-2.3 (4 blocks) at 960x544 x 49, scaled to the whole model by the FLOP model; each with
  checkpointing none / selective / full at the planner's largest batch, compile off and on: s/step,
  model TFLOP/s, MFU, HFU, peak memory against the planner's prediction, and a profiler breakdown
  (matmul, attention, elementwise/norm, communication, idle) with each family's top 10 kernels.
* ``mfu``: model TFLOP/s per GPU and MFU at 240p x 51 and 360p x 51 frames, bf16, full
  activation checkpointing, compile off and on. Model FLOPs from ``models.flops.
  train_step_flops`` (no recompute), the peak from ``train.metrics.peak_tflops``
  (``--peak-tflops`` for a GPU not in its table); HFU counts the recompute too.
* ``sdpa``: which SDPA kernel each attention kind gets (spatial and temporal self-attention
  are unmasked; cross-attention has the caption mask), and each kernel's forward+backward
  time when forced.
* ``fastpaths``: the Trainer's fixed GPU settings: AdamW fused against foreach (one
  optimizer step over the XL parameters) and TF32 against full fp32 matmuls.
* ``planner``: ``videodit.planner``'s predicted peak against ``torch.cuda.max_memory_allocated``
  for five buckets (batch: the planner's largest that fits, at most ``--max-batch``).
* ``tune``: the largest batch found by ``videodit tune``'s search (``planner/tune.py``: from the
  planner's prediction, doubling, then bisecting; a trial fits when its peak stays within the
  planner's budget and it does not run out of memory) against the planner's, for two buckets.
  The trials run this suite's step (random latents) rather than ``videodit tune CONFIG``,
  which needs a dataset, the VAE and T5.
* ``levers``: peak memory and step time of the activation levers (checkpointing, bf16/fp8
  compression, host offload) at 240p x 51, batch 1, no compile.
* ``fp8``: forward + backward of one Wan 2.1 14B block (480p x 81 frames: 32,760 tokens,
  batch 1) with ``train.fp8`` (torchao float8, tensorwise) against bf16 autocast, compile off
  and on: time, speed-up and peak memory. Needs torchao (``pip install videodit[lowmem]``) and
  compute capability >= 8.9; the dry run emulates float8 on CPU.
* ``swap``: ``memory.swap_blocks``: a LoRA step (r32, bf16 base, full checkpointing) of 8 Wan
  2.1 14B blocks at 480p x 81 and 240p x 17 with 0, 4 and 8 blocks swapped: step time, peak
  memory, bytes copied and how much of the copy time the side stream leaves exposed.
* ``parallel``: with more than one GPU, step time and MFU of FSDP, SP, TP and PP over all
  GPUs (torchrun, one launch per layout).
* ``data``: decode clips/s of NVDEC (torchcodec, ``data.decode_device=cuda``) against PyAV and
  torchcodec on the CPU, on the same 832x480 x 81 h264 clips and 33-frame windows, and how far
  each decoder's frames are from PyAV's (``benchmarks/decode_devices.py``), and the share of a
  training step spent waiting for data (``data_wait``) on those clips with 0 and 2 workers. The
  NVDEC row needs torchcodec (``pip install videodit[torchcodec]``) and FFmpeg's shared libraries.

What could not be measured (no GPU, one GPU, out of memory, a failure, the time budget) is
listed in the section's last table ("Not measured", with the reason) instead of silently
missing. What this suite never measures: the VAE and text encoder (bf16 on-the-fly encoding),
the data loader (pinned memory, asynchronous copies), real data and captions, pretrained
weights, and more than one node.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))   # suite/ and decode_devices, also when imported

from suite.families import section_families  # noqa: E402
from suite.memory import section_levers, section_planner, section_tune  # noqa: E402
from suite.parallel_layouts import section_parallel, worker  # noqa: E402
from suite.report import Report, attempt  # noqa: E402
from suite.speed import section_fastpaths, section_mfu, section_sdpa  # noqa: E402
from suite.wan_blocks import section_fp8, section_swap  # noqa: E402
from suite.workload import Workload, dry_workload, xl_workload  # noqa: E402

OFFLINE = """\
Offline (no internet, no pip registry; PyTorch with CUDA already installed):
  1. On a machine with internet, the same OS, CPU architecture and Python version as the GPU
     machine, make a wheel folder of videodit's other dependencies:
       pip wheel --wheel-dir videodit-wheels {requirements}
  2. Copy videodit-wheels/ and this repository to the GPU machine; in the repository:
       pip install --no-index --find-links videodit-wheels -e .
     (the installed PyTorch satisfies the torch requirement; nothing else is fetched)
  3. python benchmarks/gpu_suite.py [--sections ...]
     It downloads nothing: random weights, random latents and captions.

Output: a "## GPU suite" section appended to benchmarks/RESULTS.md (--results FILE for
another file), printed as it goes; its last table lists what was not measured and why.
"""
SECTIONS = ("families", "mfu", "sdpa", "fastpaths", "planner", "tune", "levers", "fp8", "swap", "parallel",
            "data")


def section_data(w: Workload, report: Report, args) -> None:
    from decode_devices import section_data as decode_clips   # benchmarks/ is this script's folder

    decode_clips(w, report, args)


FUNCS = {"families": section_families, "mfu": section_mfu, "sdpa": section_sdpa, "fastpaths": section_fastpaths,
         "planner": section_planner, "tune": section_tune, "levers": section_levers, "fp8": section_fp8,
         "swap": section_swap, "parallel": section_parallel, "data": section_data}


def offline_requirements() -> list[str]:
    """What ``pip wheel`` must fetch for an offline install: pyproject.toml's dependencies but
    PyTorch (preinstalled), and the build backend, quoted for a shell."""
    text = (ROOT / "pyproject.toml").read_text()
    build = re.search(r'requires = \[(.*?)\]', text, re.S).group(1)
    runtime = re.search(r'^dependencies = \[(.*?)\]', text, re.S | re.M).group(1)
    names = re.findall(r'"([^"]+)"', build) + re.findall(r'"([^"]+)"', runtime)
    return [f"'{name}'" for name in names if not re.match(r"torch\b", name)]



def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=OFFLINE.format(requirements=" ".join(offline_requirements())))
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, fp32, two steps: every code path")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated: {', '.join(SECTIONS)}")
    parser.add_argument("--results", default=None,
                        help="append the section here (default benchmarks/RESULTS.md; a dry run only prints)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per measurement (after 3 warm-up)")
    parser.add_argument("--batch", type=int, default=0, help="MFU batch (default: the planner's largest, "
                        "at most --max-batch)")
    parser.add_argument("--max-batch", type=int, default=8, help="largest batch the mfu and planner sections "
                        "use (the tune section searches up to the planner's limit)")
    parser.add_argument("--parallel-batch", type=int, default=4, help="batch per data-parallel group")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="dense bf16 peak of this GPU "
                        "(default: the table in videodit/train/metrics.py)")
    parser.add_argument("--budget-minutes", type=float, default=9.5, help="stop starting measurements after this")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.start = time.perf_counter()
    if args.worker:
        worker(args)
        return 0

    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    if args.dry_run:
        torch.set_num_threads(1)   # tiny tensors: one thread, no OpenMP spin-waiting on busy cores
        args.max_batch, args.parallel_batch = min(args.max_batch, 2), 2
        w = dry_workload(args)
    elif not torch.cuda.is_available():
        print("error: no GPU visible; run on a machine with one, or --dry-run to check the suite on CPU",
              file=sys.stderr)
        return 2
    else:
        w = xl_workload(args)
        torch.set_float32_matmul_precision("high")   # as the Trainer does on CUDA
        torch.backends.cudnn.benchmark = False
    report = Report(w)
    for name in SECTIONS:
        if name in sections:
            print(f"\n== {name}", flush=True)
            start = time.perf_counter()
            attempt(report, f"section {name}", lambda name=name: FUNCS[name](w, report, args))
            print(f"== {name}: {time.perf_counter() - start:.1f} s", flush=True)
        else:
            report.skip(f"section {name}", "not selected (--sections)")
    text = report.markdown(args, time.perf_counter() - args.start)
    results = args.results or (None if args.dry_run else str(ROOT / "benchmarks" / "RESULTS.md"))
    if results:
        with open(results, "a") as f:
            f.write("\n" + text)
        print(f"\nappended to {results}")
    else:
        print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
