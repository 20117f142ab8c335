"""Data: metadata CSVs, video decoding, buckets, the bucket sampler and the loaders built
from them (``loader.py`` assembles; each part lives in its own module).

The names below load on first use, so that the metadata and bucket modules (``videodit
buckets``, ``data filter``, ``data convert``) run without importing torch."""

from importlib import import_module

_HOMES = {"Batch": "dataset", "VideoDataset": "dataset", "TrainData": "loader", "build_training_data": "loader",
          "build_validation_data": "loader", "Metadata": "metadata", "read_metadata": "metadata",
          "BucketBatchSampler": "sampler"}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_HOMES[name]}"), name)
