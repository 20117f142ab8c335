"""Wan 2.2's two-expert models (T2V-A14B, I2V-A14B): two full Wan DiTs split by timestep.

The high-noise expert denoises where the timestep is at least ``boundary`` x 1000 (T2V: 0.875,
I2V: 0.900), the low-noise expert below it; Wan switches once per sampling run, at the first step
under the boundary, and guides each expert with its own scale (``wan/text2video.py``,
``sample_guide_scale = (low, high)``). On disk they are two ordinary Wan folders:
``high_noise_model/`` and ``low_noise_model/`` in Wan's download, ``transformer/`` (high) and
``transformer_2/`` (low) in diffusers' pipeline.

Training one expert (``model.expert=high|low``) is training a WanDiT on its timestep range;
``model.expert=both`` trains a WanExperts, each step routed to one expert
(``diffusion/expert_routing.py``). Pure: no torch.distributed; the parallel layers are applied to
each of :meth:`WanExperts.models` from outside.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from videodit.errors import UserError
from videodit.models.wan.model import WanDiT

EXPERTS = ("high", "low")
# expert -> its folder in (Wan's download, diffusers' pipeline)
FOLDERS = {"high": ("high_noise_model", "transformer"), "low": ("low_noise_model", "transformer_2")}
# Wan 2.2's recipes (wan/configs/wan_{t2v,i2v}_A14B.py): boundary, (low, high) guidance, shift, steps
RECIPES = {"t2v": dict(boundary=0.875, guidance=(3.0, 4.0), shift=12.0, steps=40),
           "i2v": dict(boundary=0.900, guidance=(3.5, 3.5), shift=5.0, steps=40)}


def high_noise(t: torch.Tensor, boundary: float) -> torch.Tensor:
    """Where the high-noise expert runs, for t in [0, 1]: Wan compares its integer timestep,
    ``round(t * 1000)``, with ``boundary * 1000`` (the boundary step itself is the high expert's)."""
    return torch.round(t.float() * 1000) >= round(boundary * 1000, 6)


def expert_folder(path: str | Path, expert: str) -> Path | None:
    """The folder of ``expert`` inside a two-expert model at ``path`` (either layout), or None
    when ``path`` is not one."""
    path = Path(path)
    for name in FOLDERS[expert]:
        if (path / name).is_dir():
            return path / name
    return None


def is_experts_folder(path: str | Path) -> bool:
    return all(expert_folder(path, expert) is not None for expert in EXPERTS)


class WanExperts(nn.Module):
    """Two WanDiTs of one geometry; each sample goes to the expert its time belongs to."""

    def __init__(self, high: WanDiT, low: WanDiT, boundary: float):
        super().__init__()
        if high.geometry != low.geometry:
            raise UserError("the two experts of a Wan 2.2 model must have the same geometry; their config.json "
                            "files differ: restore the download")
        if not 0 < boundary < 1:
            raise UserError(f"the expert boundary must lie strictly between 0 and 1, not {boundary}")
        self.high_noise_model, self.low_noise_model = high, low
        self.boundary = boundary
        self.geometry = high.geometry
        # Training both (diffusion/expert_routing.py): the step's expert takes every sample, even one
        # whose time rounds to the other side; None routes each sample by its time.
        self.pinned: str | None = None

    def expert(self, name: str) -> WanDiT:
        return self.high_noise_model if name == "high" else self.low_noise_model

    def models(self) -> list[WanDiT]:
        """The experts, high then low: each a whole WanDiT with its own ``blocks``."""
        return [self.high_noise_model, self.low_noise_model]

    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """WanDiT's forward, with t [B] per sample: each sample through its own expert (a batch on
        one side of the boundary, as in sampling, runs one expert on the whole batch)."""
        if self.pinned is not None:
            return self.expert(self.pinned)(x, t, context, *args, **kwargs)
        if t.dim() != 1:
            raise UserError("a two-expert Wan model routes by the time of each sample: give t per sample [B]")
        high = high_noise(t, self.boundary)
        if high.all() or not high.any():
            return self.expert("high" if high.all() else "low")(x, t, context, *args, **kwargs)
        out = None
        for name, rows in (("high", high), ("low", ~high)):
            pick = lambda v: v[rows] if torch.is_tensor(v) and v.shape[:1] == t.shape else v   # noqa: E731
            part = self.expert(name)(x[rows], t[rows], context[rows], *map(pick, args),
                                     **{k: pick(v) for k, v in kwargs.items()})
            out = part.new_empty((x.shape[0], *part.shape[1:])) if out is None else out
            out[rows] = part
        return out


def expert_guidance(boundary: float, guidance: tuple[float, float]):
    """CFG scale by time, as Wan 2.2 guides its experts: ``guidance`` = (low, high)."""
    low, high = guidance

    def scale(t: torch.Tensor) -> float:
        return high if bool(high_noise(t.flatten()[:1], boundary)) else low
    return scale
