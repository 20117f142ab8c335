"""Sequence parallelism: activation bytes saved for backward per rank, and communication.

    python benchmarks/sequence_parallel.py [--sizes 1 2 4] [--frames 16] [--side 32] [--device cpu]

For each SP size, that many processes (gloo on CPU, NCCL on GPU) run forward + backward
of one DiT on the same batch. Per rank it measures:

- bytes saved for backward: every tensor autograd keeps (``saved_tensors_hooks``),
  counted once per storage, weights excluded. Expected close to 1/sp of SP=1: only the
  embedding and the output layer still see the whole token grid;
- bytes sent by the SP collectives (all-to-all and the final all-gather) in forward and
  backward, counted by wrapping ``torch.distributed``'s calls. The gradient all-reduce that
  data parallelism does anyway is not included (it is the same at every SP size);
- step time (forward + backward), and on a GPU the peak allocated memory.

It runs a video batch (frames split across ranks for spatial blocks, DSP switching) and an
image batch (head-parallel spatial attention, Ulysses). The ratio against SP=1 in the same
run is the figure to read.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from videodit.models.stdit.model import DiTGeometry, STDiT
from videodit.parallel import sequence
from videodit.parallel.sequence import apply_sequence_parallel

GEOMETRY = dict(in_channels=4, caption_channels=64, caption_length=16, depth=2, hidden_size=256, num_heads=8,
                patch_size=(1, 2, 2))


class SentBytes:
    """Wraps the collectives sequence.py uses and adds up the bytes this rank sends."""

    def __init__(self):
        self.total = 0
        self._all_to_all, self._all_gather = dist.all_to_all_single, dist.all_gather

    def install(self):
        def all_to_all_single(output, input, *args, **kwargs):
            # Everything but the piece this rank keeps crosses the wire.
            size = dist.get_world_size(kwargs.get("group"))
            self.total += input.numel() * input.element_size() * (size - 1) // size
            return self._all_to_all(output, input, *args, **kwargs)

        def all_gather(tensors, tensor, *args, **kwargs):
            self.total += tensor.numel() * tensor.element_size() * (len(tensors) - 1)
            return self._all_gather(tensors, tensor, *args, **kwargs)

        sequence.dist.all_to_all_single = all_to_all_single
        sequence.dist.all_gather = all_gather


def saved_bytes_of_forward(model, inputs) -> tuple[torch.Tensor, int]:
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(*inputs)
    return out, sum(seen.values())


def worker(rank: int, size: int, port: int, args, result_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=size)
    torch.set_num_threads(max(1, args.threads // size))
    torch.manual_seed(0)
    model = STDiT(DiTGeometry(**GEOMETRY)).to(device)
    if size > 1:
        apply_sequence_parallel(model, dist.group.WORLD)
    sent = SentBytes()
    sent.install()
    rows = {}
    for name, frames in (("video", args.frames), ("image", 1)):
        gen = torch.Generator().manual_seed(1)
        b = args.batch
        inputs = (torch.randn(b, 4, frames, args.side, args.side, generator=gen).to(device),
                  torch.rand(b, generator=gen).to(device),
                  torch.randn(b, 16, 64, generator=gen).to(device), torch.ones(b, 16, dtype=torch.bool, device=device))
        times = []
        for step in range(args.warmup + args.steps):
            model.zero_grad(set_to_none=True)
            sent.total = 0
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            out, saved = saved_bytes_of_forward(model, inputs)
            out.square().mean().backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
        rows[name] = {"saved_bytes": saved, "sent_bytes": sent.total, "seconds": sorted(times)[len(times) // 2],
                      "peak_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
                      "tokens": frames * (args.side // 2) ** 2}
    if rank == 0:
        Path(result_file).write_text(json.dumps(rows))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--side", type=int, default=32, help="latent height and width")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            out = str(Path(tmp) / f"sp{size}.json")
            mp.spawn(worker, args=(size, free_port(), args, out), nprocs=size, join=True)
            results[size] = json.loads(Path(out).read_text())

    print(f"DiT depth {GEOMETRY['depth']} pairs, hidden {GEOMETRY['hidden_size']}, {GEOMETRY['num_heads']} heads, "
          f"patch {GEOMETRY['patch_size']}; batch {args.batch}, latent {args.frames}x{args.side}x{args.side}; "
          f"device {args.device}, torch {torch.__version__}")
    print("| batch | sp | tokens | saved for backward / rank (MiB) | vs sp=1 | SP traffic sent / rank / step (MiB) "
          "| step s (median) | peak MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    base = results[args.sizes[0]]
    for name in ("video", "image"):
        for size, rows in results.items():
            row = rows[name]
            peak = f"{row['peak_bytes'] / 2**20:.0f}" if row["peak_bytes"] else "-"
            print(f"| {name} | {size} | {row['tokens']} | {row['saved_bytes'] / 2**20:.1f} | "
                  f"{row['saved_bytes'] / base[name]['saved_bytes']:.3f} | {row['sent_bytes'] / 2**20:.1f} | "
                  f"{row['seconds']:.3f} | {peak} |")


if __name__ == "__main__":
    main()
