"""Which expert a training step trains, in a run of both experts of a two-expert model
(``model.expert=both``, Wan 2.2 A14B).

Every micro-batch of a step, on every data-parallel rank, goes to the same expert: with FSDP2
each expert's blocks are gathered by all ranks together, so ranks that ran different experts
would wait on each other forever. The step's expert is drawn from a seed of (train.seed, step),
the same on every rank and after a resume, with the probability that a training timestep lies
on its side of the boundary; the step's timesteps are then drawn from the expert's side
(``RectifiedFlow.sample_timesteps``' truncated draw). Over steps the two experts together see
the timestep distribution of a one-model run, each its own share of it, as when they are
trained apart (``model.expert=high|low``).

The share is exact with ``diffusion.constant_shift`` (Wan's recipes); with the resolution-
dependent shift it is taken at the data's base size (``data.num_frames/height/width``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from videodit.diffusion.rectified_flow import RectifiedFlow


@dataclass(frozen=True)
class Route:
    expert: str                              # "high" or "low"
    time_range: tuple[float, float]          # the expert's shifted timesteps


class ExpertRouting:
    def __init__(self, flow: RectifiedFlow, boundary: float, ratio: float, seed: int):
        self.boundary = boundary
        self.seed = seed
        self.high_share = flow.share(boundary, 1.0, ratio)

    def route(self, step: int) -> Route:
        """The expert of optimizer step ``step`` (0-based), the same on every rank."""
        draw = np.random.default_rng((self.seed, step, 0xE)).random()
        if draw < self.high_share:
            return Route("high", (self.boundary, 1.0))
        return Route("low", (0.0, self.boundary))
