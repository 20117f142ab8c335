"""Run by tests/planner/test_planner.py under torchrun: measure one training step's memory on this rank
(``videodit.planner.measure``) next to the planner's prediction, and print both as JSON."""

import json
import sys
import tempfile
from pathlib import Path

from videodit.config import load_config
from videodit.planner.measure import measure_trainer, synthetic_batch
from videodit.planner.plan import planner_from_config
from videodit.train.trainer import Trainer


def main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    cfg = load_config("tiny", spec["overrides"])
    batch, frames, height, width = spec["shape"]
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(cfg, Path(run_dir))
        measured = measure_trainer(trainer, synthetic_batch(batch, frames, height, width))
        planner = planner_from_config(cfg, gpu_bytes=1, world_size=trainer.ctx.world_size)
        predicted = planner.estimate(batch, frames, height, width)
        # One write of the whole line (under PIPE_BUF): the ranks share stdout, and print's separate
        # newline let two ranks' lines run together.
        sys.stdout.write(json.dumps({"rank": trainer.ctx.rank, "measured": measured.as_dict(),
                                     "predicted": predicted.as_dict()}) + "\n")
        sys.stdout.flush()
        ctx = trainer.ctx
        del trainer   # its gloo groups go before Python's teardown (see DistContext.close)
        ctx.close()


if __name__ == "__main__":
    main(sys.argv[1])
