"""Rectified flow: timesteps, interpolation, the velocity target, the loss and Euler sampling."""

from videodit.diffusion.rectified_flow import RectifiedFlow

__all__ = ["RectifiedFlow"]
