"""Run under torchrun by tests/parallel/test_two_nodes.py: ``videodit train`` as it is, plus a
report of what each rank did that is local to its node.

Usage: torchrun ... tests/parallel/workers/node_worker.py REPORT_DIR train --out RUN key=value ...

Each process writes REPORT_DIR/rank-R.PID.json (again after every change, so a killed process
leaves what it had): the torchrun environment (RANK, LOCAL_RANK, GROUP_RANK, ...), the node the
test says it runs on (``VIDEODIT_TEST_NODE``), the DistContext's rank, local rank and device, its
place in the HSDP mesh, the GPU ``pick_device`` would choose for this local rank were the node's
GPUs visible (``torch.cuda`` stubbed with LOCAL_WORLD_SIZE devices: the test runs on CPU), and
every node-cache folder the process built or found ready (``build_once``).

Two stand-ins make one machine look like two nodes:
- ``socket.gethostname()`` answers ``node-N``, so what videodit records per host (the run
  folder's ``.lock``) sees two hosts;
- ``data.metadata_cache=auto`` applies to files of any size (``AUTO_CACHE_BYTES = 0``), so the
  tiny CSV goes through the node cache under ``$XDG_CACHE_HOME``, which the test sets per node
  (a node-local home) or to one folder for both (a shared one).
"""

import json
import os
import socket
import sys
from pathlib import Path
from unittest import mock

import torch

from videodit.cli import main
from videodit.data import metadata
from videodit.parallel import distributed
from videodit.train import trainer as trainer_module

ENV = ("RANK", "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "GROUP_WORLD_SIZE",
       "TORCHELASTIC_RESTART_COUNT", "VIDEODIT_TEST_NODE", "XDG_CACHE_HOME")
report: dict = {"env": {name: os.environ.get(name) for name in ENV}, "pid": os.getpid(), "builds": []}
out = Path(sys.argv[1]) / f"rank-{os.environ['RANK']}.{os.getpid()}.json"


def save() -> None:
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, out)


def simulated_gpu(local_rank: int) -> dict:
    """The device ``pick_device("cuda", local_rank)`` takes on a node with LOCAL_WORLD_SIZE GPUs."""
    chosen: list = []
    gpus = int(os.environ["LOCAL_WORLD_SIZE"])
    with mock.patch.object(torch.cuda, "is_available", return_value=True), \
            mock.patch.object(torch.cuda, "device_count", return_value=gpus), \
            mock.patch.object(torch.cuda, "set_device", side_effect=chosen.append):
        try:
            device = str(distributed.pick_device("cuda", local_rank))
        except Exception as exc:   # a rank index past the node's GPUs: the message is the finding
            device = f"error: {exc}"
    return {"device": device, "set_device": [str(d) for d in chosen]}


real_init, real_build_once = trainer_module.init_distributed, metadata.build_once


def init_distributed(cfg):
    ctx = real_init(cfg)
    hsdp = ctx.meshes.get("hsdp") if ctx.meshes else None
    report["ctx"] = {"rank": ctx.rank, "local_rank": ctx.local_rank, "device": str(ctx.device),
                     "world_size": ctx.world_size, "dp_rank": ctx.dp_rank,
                     "replica": None if hsdp is None else hsdp.get_local_rank(0),
                     "shard": None if hsdp is None else hsdp.get_local_rank(1)}
    report["gpu"] = simulated_gpu(ctx.local_rank)
    save()
    return ctx


def build_once(entry, build):
    built = real_build_once(entry, build)
    report["builds"].append({"entry": str(entry), "built": built})
    save()
    return built


if __name__ == "__main__":
    node = os.environ["VIDEODIT_TEST_NODE"]
    metadata.AUTO_CACHE_BYTES = 0
    save()
    status = 1
    with mock.patch.object(trainer_module, "init_distributed", init_distributed), \
            mock.patch.object(metadata, "build_once", build_once), \
            mock.patch.object(socket, "gethostname", return_value=f"node-{node}"):
        try:
            status = main(sys.argv[2:])
        finally:
            report["exit"] = status
            save()
    raise SystemExit(status)
