"""Run under torchrun by tests/parallel/test_ltx2_audio_pipeline.py: LTX-2 training both streams
(``model.train_audio``) through the trainer for a few steps, saving each step's loss and audio loss.

Usage: torchrun --nproc-per-node N ltx2_audio_worker.py SPEC.json
SPEC: {"out": file, "run": folder, "overrides": [...], "steps": k}. The text encoder is the toy one
with an audio stream's text (:class:`TwoStreamText`, as tests/train/test_ltx2_audio_train.py
builds it); rank 0 writes {"losses": [...], "audio_losses": [...]}.
"""

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from videodit.config import load_config
from videodit.toy.encoder import ToyTextEncoder


class TwoStreamText(ToyTextEncoder):
    """The toy encoder with an audio stream's text (its first 16 features), as LTX-2's
    ``encode_streams`` gives it."""

    def encode_streams(self, captions):
        y, mask = self.encode(captions)
        return y, y[..., :16], mask


def two_stream_encoders(trainer_module):
    """``build_encoders`` for ``trainer_module``: the configured VAE, the two-stream toy text."""
    real = trainer_module.build_encoders

    def build(cfg, device):
        vae, _ = real(cfg, device)
        return vae, TwoStreamText(dim=cfg.text.dim, max_length=cfg.text.max_length)
    return build


def train(overrides: list[str], steps: int, run: Path) -> dict:
    """Each step's (global) loss and audio loss, from the trainer's own step."""
    import videodit.train.trainer as trainer_module
    trainer_module.build_encoders = two_stream_encoders(trainer_module)
    trainer = trainer_module.Trainer(load_config("tiny", overrides), run)
    batches = trainer.batches()
    losses, audio_losses = [], []
    for _ in range(steps):
        losses.append(trainer.train_step([next(batches) for _ in range(trainer.cfg.train.grad_accum)])[0])
        audio_losses.append(trainer.audio.metrics(trainer.ctx)["audio_loss"])
    return {"losses": losses, "audio_losses": audio_losses}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    result = train(spec["overrides"], spec["steps"], Path(spec["run"]))
    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps(result))
    gc.collect()   # the run's groups freed while Python is whole (see worker.py)
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()


if __name__ == "__main__":
    main()
