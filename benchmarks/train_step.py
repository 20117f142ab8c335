"""Trainer step time against a minimal hand-written loop on the same model and batch.

    python benchmarks/train_step.py [--preset tiny] [--steps 30] [--batch-size 32]

Both sides do the same work per step: text encoding, VAE encoding, timesteps and noise,
forward, backward, clipping, AdamW. The Trainer additionally updates the LR schedule
and the EMA. Data loading is excluded (one fixed batch), so the ratio isolates the loop's
own overhead. Steps alternate between the two (A/B/A/B) so machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from videodit.config import load_config
from videodit.toy.make import make_toy_dataset
from videodit.train.trainer import Trainer


def minimal_step(model, optimizer, vae, text, batch, generator):
    x0 = vae.encode(batch.video)
    y, mask = text.encode(batch.text)
    t = torch.sigmoid(torch.randn(x0.shape[0], generator=generator))
    noise = torch.randn(x0.shape, generator=generator)
    x_t = (1 - t.view(-1, 1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1, 1) * noise
    loss = F.mse_loss(model(x_t, t, y, mask, batch.fps), noise - x0)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        toy = Path(tmp) / "toy"
        make_toy_dataset(toy, clips_per_combination=1, height=16, width=16)
        overrides = [f"data.csv={toy / 'train.csv'}", f"train.batch_size={args.batch_size}", "validation.csv=null"]
        overrides.append(f"model.preset={args.preset}")
        cfg = load_config("tiny", overrides)
        trainer = Trainer(cfg, Path(tmp) / "run")
        batch = next(trainer.batches())
        model = type(trainer.model)(trainer.model.geometry)
        model.load_state_dict(trainer.model.state_dict())
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)
        generator = torch.Generator().manual_seed(0)

        timings = {"trainer": [], "minimal": []}
        for step in range(args.warmup + args.steps):
            for name in ("trainer", "minimal"):
                start = time.perf_counter()
                if name == "trainer":
                    trainer.train_step([batch])
                else:
                    minimal_step(model, optimizer, trainer.vae, trainer.text, batch, generator)
                if step >= args.warmup:
                    timings[name].append(time.perf_counter() - start)

    median = {k: statistics.median(v) for k, v in timings.items()}
    print(f"preset {args.preset}, batch {args.batch_size}, {args.steps} steps each, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{'loop':<10}{'median s/step':>15}{'samples/s':>12}")
    for name, value in median.items():
        print(f"{name:<10}{value:>15.4f}{args.batch_size / value:>12.1f}")
    print(f"ratio trainer/minimal: {median['trainer'] / median['minimal']:.3f}")


if __name__ == "__main__":
    main()
