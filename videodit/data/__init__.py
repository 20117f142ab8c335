"""Data: metadata CSVs, video decoding, buckets, the bucket sampler and the loaders built
from them (``loader.py`` assembles; each part lives in its own module)."""

from videodit.data.dataset import Batch, VideoDataset
from videodit.data.loader import TrainData, build_training_data, build_validation_data
from videodit.data.metadata import Metadata, read_metadata
from videodit.data.sampler import BucketBatchSampler

__all__ = ["Batch", "BucketBatchSampler", "Metadata", "TrainData", "VideoDataset", "build_training_data",
           "build_validation_data", "read_metadata"]
