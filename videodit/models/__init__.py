"""Pure model code (no torch.distributed): the STDiT, its layers, its FLOP model, Open-Sora
STDiT3 weight conversion, and the frozen VAE and text encoder adapters."""

from videodit.models.pretrained import load_pretrained
from videodit.models.stdit import DiTGeometry, STDiT, count_parameters

__all__ = ["DiTGeometry", "STDiT", "count_parameters", "load_pretrained"]
