"""Pure model code (no torch.distributed): one folder per model family (``stdit/``, ``wan/``),
each behind the :class:`~videodit.models.spec.ModelSpec` seam (``families.py`` is the registry),
plus the pieces families share: layers, the FLOP model, LoRA, the frozen VAE and text encoder
adapters."""

from videodit.models.pretrained import load_pretrained
from videodit.models.spec import count_parameters

__all__ = ["count_parameters", "load_pretrained"]
