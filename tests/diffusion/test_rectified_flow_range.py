"""diffusion.timestep_range: one expert's timesteps, drawn from the restricted distribution."""

import pytest
import torch

from videodit.config import load_config
from videodit.diffusion.rectified_flow import RectifiedFlow


@pytest.mark.parametrize("sampling", ["logit_normal", "uniform"])
@pytest.mark.parametrize("edges", [(0.875, 1.0), (0.0, 0.875), (0.3, 0.6)])
def test_timesteps_stay_in_range_with_the_restricted_distribution(sampling, edges):
    """In range, and distributed as the unrestricted draw conditioned on the range (quantiles
    agree within sampling error), after the same shift."""
    ratio = 5.0
    free = RectifiedFlow(load_config("tiny", [f"diffusion.timestep_sampling={sampling}"]).diffusion)
    bound = RectifiedFlow(load_config("tiny", [f"diffusion.timestep_sampling={sampling}",
                                               f"diffusion.timestep_range=[{edges[0]}, {edges[1]}]"]).diffusion)
    generator = torch.Generator().manual_seed(0)
    t = bound.sample_timesteps(40_000, ratio, generator)
    assert t.dtype == torch.float32 and t.min() >= edges[0] - 1e-6 and t.max() <= edges[1] + 1e-6
    reference = free.sample_timesteps(400_000, ratio, torch.Generator().manual_seed(1))
    reference = reference[(reference >= edges[0]) & (reference <= edges[1])]
    q = torch.tensor([0.1, 0.5, 0.9])
    assert torch.allclose(t.quantile(q), reference.quantile(q), atol=0.01)


def test_no_range_draws_as_before():
    cfg = load_config("tiny").diffusion
    flow, generator = RectifiedFlow(cfg), torch.Generator().manual_seed(3)
    normal = torch.randn(8, generator=torch.Generator().manual_seed(3))
    expected = flow.shift(torch.sigmoid(normal * cfg.logit_std + cfg.logit_mean), 2.0)
    assert torch.equal(flow.sample_timesteps(8, 2.0, generator), expected)

