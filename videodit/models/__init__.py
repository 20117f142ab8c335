"""Pure model code (no torch.distributed): the STDiT, its layers, its FLOP model and the
frozen VAE and text encoder adapters."""

from videodit.models.stdit import DiTGeometry, STDiT, count_parameters, load_pretrained

__all__ = ["DiTGeometry", "STDiT", "count_parameters", "load_pretrained"]
