"""Wan 2.1 text-to-video DiT: the model (``model.py``) and its weights on disk in Wan's and
diffusers' layouts (``layouts.py``)."""

from videodit.models.wan.layouts import is_wan_folder, load_wan, read_wan_folder, write_wan_folder
from videodit.models.wan.model import RMSNormAcrossHeads, WanBlock, WanDiT, WanGeometry

__all__ = ["RMSNormAcrossHeads", "WanBlock", "WanDiT", "WanGeometry", "is_wan_folder", "load_wan",
           "read_wan_folder", "write_wan_folder"]
