"""Open-Sora 2.0's MMDiT (a Flux-style double/single-stream DiT): the model (``model.py``), its
released weights (``layouts.py``) and its spec (``spec.py``). See docs/opensora2.md."""

from videodit.models.mmdit.model import DoubleStreamBlock, MMDiT, MMDiTGeometry, SingleStreamBlock

__all__ = ["DoubleStreamBlock", "MMDiT", "MMDiTGeometry", "SingleStreamBlock"]
