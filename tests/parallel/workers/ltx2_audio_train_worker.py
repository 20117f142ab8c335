"""LTX-2 training both streams (``model.train_audio``) in a process of its own, on the toy text
encoder given an audio stream's text (``tests/conftest.py``'s ``TwoStreamText``, set in place of the
trainer's ``build_encoders`` before anything runs: a test's monkeypatch does not reach a subprocess).

Usage:
    ltx2_audio_train_worker.py train --out RUN OVERRIDES...   # ``videodit train``, as the CLI runs it
    torchrun --nproc-per-node N ltx2_audio_train_worker.py SPEC.json

The first is the training command of tests/train/test_kill_resume.py's A/V case (killed and resumed).
The second runs tests/parallel/test_ltx2_audio_train_parallel.py's layouts in one launch. SPEC:
{"out": dir, "runs": [{"name", "overrides", "steps"}]}; per run rank 0 writes OUT/NAME.pt: every
step's global ``loss``, ``grad_norm`` and ``audio_loss`` (as the trainer logs them), the layout
(``ParallelDims.describe``), the whole final weights and the names of the trained parameters.
"""

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # tests/: conftest's helpers

import videodit.train.trainer as trainer_module  # noqa: E402
from conftest import two_stream_encoders  # noqa: E402
from videodit.config import load_config  # noqa: E402

trainer_module.build_encoders = two_stream_encoders(trainer_module.build_encoders)


def train(name: str, overrides: list[str], steps: int, out: Path) -> None:
    cfg = load_config("tiny", overrides)
    trainer = trainer_module.Trainer(cfg, out / name)
    batches = trainer.batches()
    losses, grad_norms, audio_losses = [], [], []
    for _ in range(steps):
        loss, grad_norm = trainer.train_step([next(batches) for _ in range(cfg.train.grad_accum)])
        losses.append(loss)
        grad_norms.append(grad_norm)
        audio_losses.append(trainer.audio.metrics(trainer.ctx)["audio_loss"])   # a collective, as in the loop
    weights = trainer.state.gather(trainer.model.state_dict())   # every shard
    trained = sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad)
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "grad_norms": grad_norms, "audio_losses": audio_losses, "trained": trained,
                    "layout": trainer.ctx.dims.describe(),
                    "weights": {k: v.cpu() for k, v in weights.items()}}, out / f"{name}.pt")


def layouts(spec_file: str) -> None:
    spec = json.loads(Path(spec_file).read_text())
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for run in spec["runs"]:
        train(run["name"], run["overrides"], run["steps"], Path(spec["out"]))
        gc.collect()   # free the run's gloo groups while Python is whole (see worker.py)
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()


if __name__ == "__main__":
    if sys.argv[1] == "train":
        from videodit.cli import main
        raise SystemExit(main(sys.argv[1:]))
    layouts(sys.argv[1])
