"""The toy world: its vocabulary, the synthetic dataset, the toy text encoder and the
evaluation of generated toy clips."""

from videodit.toy.eval import evaluate
from videodit.toy.make import ensure_toy_data, make_toy_dataset
from videodit.toy.vocabulary import all_combinations, caption, parse_caption

__all__ = ["all_combinations", "caption", "ensure_toy_data", "evaluate", "make_toy_dataset", "parse_caption"]
