"""The feature cache: VAE latents and caption embeddings encoded once (``videodit cache build``)
and read back in training (``data.cache=DIR``) instead of decoding and encoding every step.

``format.py`` (folder layout, manifest, identities, checks), ``writer.py`` (shards and index),
``reader.py`` (samples by key, the cached batch, encoder stand-ins), ``verify.py`` (each shard's
SHA-256 and header against the index, checked once per process), ``training.py`` (training and
validation loaders), ``info.py`` (``cache info``), ``lock.py`` (one ``cache build`` at a time
per folder). The build itself, which needs the encoders, is ``videodit/cache.py``.
docs/feature_cache.md describes the format and decisions.
"""

from videodit.data.feature_cache.reader import CachedBatch, FeatureCache
from videodit.data.feature_cache.training import build_cached_training_data, build_cached_validation_data

__all__ = ["CachedBatch", "FeatureCache", "build_cached_training_data", "build_cached_validation_data"]
