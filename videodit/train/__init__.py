"""Training: the loop (``trainer.py``), what a checkpoint of it holds (``state.py``), and the
small objects plugged into it (EMA, metrics, validation, run bookkeeping, GPU tuning)."""

from videodit.train.state import Progress, TrainState
from videodit.train.trainer import Trainer

__all__ = ["Progress", "TrainState", "Trainer"]
