"""videodit: train and sample Open-Sora-style spatial-temporal video diffusion transformers."""

__version__ = "0.1.0"
