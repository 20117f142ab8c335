"""A 2-D Gaussian-mixture world with an exact teacher, for testing few-step distillation.

The data are ``K`` isotropic Gaussians of std ``s`` whose means sit evenly on a circle; the
component index is the class label (the stand-in for a video's caption). Under videodit's
rectified-flow convention (x_t = (1 - t) x0 + t eps, t = 1 is noise, v = eps - x0,
x0 = x_t - t v) the posterior mean is closed form:

* given component k, x_t ~ N((1 - t) mu_k, var I) with var = (1 - t)^2 s^2 + t^2, so the
  responsibilities r_k(x_t) are a softmax of log w_k - |x_t - (1 - t) mu_k|^2 / (2 var);
* E[x0 | x_t, k] = mu_k + (1 - t) s^2 / var * (x_t - (1 - t) mu_k);
* E[x0 | x_t] = sum_k r_k E[x0 | x_t, k] (unconditional), or E[x0 | x_t, k] given the label;
* the exact velocity, the flow-matching optimum (a perfectly trained teacher), is
  v(x_t, t) = (x_t - E[x0 | x_t]) / t.

Everything is computed in float64 (the velocity divides by t, which DMD's timesteps take down
to 0.02). The module also holds the teacher's many-step Euler sampler, the re-noising few-step
sampler (both ``videodit.distill.schedule.sample``), the sliced Wasserstein distance, and the
MLP that the tests train as student and critic.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from videodit.distill import schedule


class GaussianMixture:
    """``components`` Gaussians of std ``std``, means evenly on a circle of ``radius``, equal weights."""

    def __init__(self, components: int = 8, radius: float = 2.0, std: float = 0.2):
        angles = torch.arange(components, dtype=torch.float64) * (2 * math.pi / components)
        self.means = radius * torch.stack([angles.cos(), angles.sin()], dim=1)         # (K, 2)
        self.log_weights = torch.full((components,), -math.log(components), dtype=torch.float64)
        self.std = std

    @property
    def components(self) -> int:
        return len(self.means)

    def labels(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """``n`` component indices drawn with the mixture's weights."""
        return torch.multinomial(self.log_weights.exp(), n, replacement=True, generator=generator)

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """``n`` float32 draws from the data distribution."""
        k = self.labels(n, generator)
        eps = torch.randn(n, 2, generator=generator, dtype=torch.float64)
        return (self.means[k] + self.std * eps).float()

    def denoise(self, x: torch.Tensor, t: torch.Tensor | float, labels: torch.Tensor | None = None) -> torch.Tensor:
        """E[x0 | x_t = x] for ``x`` (N, 2) at times ``t`` ((N,) or a scalar), in ``x``'s dtype;
        with ``labels`` (N,), E[x0 | x_t = x, component = label] (the class-conditional teacher)."""
        xd = x.double()
        a = 1 - torch.as_tensor(t, dtype=torch.float64).expand(x.shape[0])[:, None]     # (N, 1)
        var = a ** 2 * self.std ** 2 + (1 - a) ** 2
        gain = a * self.std ** 2 / var
        if labels is not None:
            mu = self.means[labels]
            return (mu + gain * (xd - a * mu)).to(x.dtype)
        centred = xd[:, None, :] - a[:, :, None] * self.means[None]                    # (N, K, 2)
        resp = torch.softmax(self.log_weights[None] - centred.pow(2).sum(-1) / (2 * var), dim=1)
        means_k = self.means[None] + gain[:, :, None] * centred
        return (resp[:, :, None] * means_k).sum(1).to(x.dtype)

    def velocity(self, x: torch.Tensor, t: torch.Tensor | float, labels: torch.Tensor | None = None) -> torch.Tensor:
        """The exact teacher velocity (x_t - E[x0 | x_t]) / t (t > 0)."""
        td = torch.as_tensor(t, dtype=torch.float64).expand(x.shape[0])[:, None]
        return ((x.double() - self.denoise(x, t, labels).double()) / td).to(x.dtype)


def noised(x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = (1 - t) x0 + t eps, ``t`` of shape (N,)."""
    return (1 - t)[:, None] * x0 + t[:, None] * eps


def ode_sigmas(steps: int = 30, stops: torch.Tensor | None = None) -> torch.Tensor:
    """The teacher's uniform Euler grid 1, 1 - 1/steps, ..., 1/steps (``RectifiedFlow``'s), joined
    with ``stops`` (descending, distinct) where a caller must halt on them."""
    sigmas = torch.linspace(1, 0, steps + 1, dtype=torch.float64)[:-1]
    if stops is not None:
        sigmas = torch.unique(torch.cat([sigmas, stops.double()]).round(decimals=12)).flip(0)
    return sigmas[sigmas > 0]


def teacher_ode(world: GaussianMixture, noise: torch.Tensor, steps: int = 30,
                labels: torch.Tensor | None = None) -> torch.Tensor:
    """The teacher's Euler ODE sample: ``schedule.sample`` without re-noising on the uniform grid."""
    return schedule.sample(lambda x, t: world.velocity(x, t, labels), noise, ode_sigmas(steps))


def teacher_trajectory(world: GaussianMixture, noise: torch.Tensor, stops: torch.Tensor, labels: torch.Tensor,
                       steps: int = 30) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's Euler ODE from ``noise`` on the uniform ``steps`` grid joined with ``stops``
    (moved by ``schedule.step``): its states at ``stops`` (S, N, 2) and its endpoint (N, 2)."""
    grid = [float(s) for s in ode_sigmas(steps, stops)] + [0.0]
    wanted = [round(float(s), 12) for s in stops]
    states, x = {}, noise.clone()
    for sigma, sigma_next in zip(grid[:-1], grid[1:]):
        if round(sigma, 12) in wanted:
            states[round(sigma, 12)] = x
        x = schedule.step(x, world.velocity(x, sigma, labels), sigma, sigma_next, None)
    return torch.stack([states[w] for w in wanted]), x


def renoised_sample(velocity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], noise: torch.Tensor,
                    sigmas: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``schedule.sample`` with re-noising (the LCM-style few-step sampler of the students), each
    fresh noise drawn from ``generator`` in step order."""
    return schedule.sample(velocity, noise, sigmas,
                           fresh=lambda i: torch.randn(noise.shape, generator=generator, dtype=noise.dtype))


def sliced_wasserstein(a: torch.Tensor, b: torch.Tensor, projections: int = 256, seed: int = 0) -> float:
    """The sliced 2-Wasserstein distance between two equally sized 2-D point sets: the root mean,
    over ``projections`` fixed random unit directions (drawn from ``seed``), of the squared 1-D W2
    between the sorted projections."""
    assert a.shape == b.shape and a.shape[1] == 2, (a.shape, b.shape)
    directions = torch.randn(2, projections, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    directions = directions / directions.norm(dim=0, keepdim=True)
    pa = (a.double() @ directions).sort(dim=0).values
    pb = (b.double() @ directions).sort(dim=0).values
    return float((pa - pb).pow(2).mean().sqrt())


class TeacherPlusMLP(torch.nn.Module):
    """The class-conditional teacher plus an MLP correction whose last layer starts at zero: at
    initialisation exactly the teacher, as DMD2 copies the teacher into both generator and fake
    score. The MLP sees x, the teacher's x0 and eps predictions (the features a copied network
    starts from), the one-hot label and t (sin and cos of pi f t). ``predict`` says what it
    corrects: ``x0`` (x0 = x0_teacher + mlp, the same scale at every t) or ``velocity``
    (v = v_teacher + mlp). Either way ``forward`` returns the velocity, as the samplers want."""

    FREQUENCIES = (1, 2, 4, 8, 16)

    def __init__(self, world: GaussianMixture, predict: str, generator: torch.Generator, hidden: int = 128):
        super().__init__()
        assert predict in ("x0", "velocity"), predict
        self.world, self.predict = world, predict
        inputs = 6 + world.components + 2 * len(self.FREQUENCIES)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(inputs, hidden), torch.nn.SiLU(),
            torch.nn.Linear(hidden, hidden), torch.nn.SiLU(),
            torch.nn.Linear(hidden, hidden), torch.nn.SiLU(),
            torch.nn.Linear(hidden, 2))
        with torch.no_grad():
            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):   # PyTorch's default init, drawn from our generator
                    bound = 1 / math.sqrt(layer.in_features)
                    layer.weight.copy_(torch.rand(layer.weight.shape, generator=generator) * 2 * bound - bound)
                    layer.bias.copy_(torch.rand(layer.bias.shape, generator=generator) * 2 * bound - bound)
            self.net[-1].weight.zero_()
            self.net[-1].bias.zero_()

    def forward(self, x: torch.Tensor, t: torch.Tensor | float, labels: torch.Tensor) -> torch.Tensor:
        t = torch.as_tensor(t, dtype=x.dtype).expand(x.shape[0])
        with torch.no_grad():
            x0 = self.world.denoise(x, t, labels)
            v = (x - x0) / t[:, None]
        angles = math.pi * t[:, None] * torch.tensor(self.FREQUENCIES, dtype=x.dtype)
        onehot = torch.nn.functional.one_hot(labels, self.world.components).to(x.dtype)
        out = self.net(torch.cat([x, x0, x0 + v, onehot, angles.sin(), angles.cos()], 1))
        return v - out / t[:, None] if self.predict == "x0" else v + out

    def x0(self, x: torch.Tensor, t: torch.Tensor | float, labels: torch.Tensor) -> torch.Tensor:
        """The clean sample its velocity implies, x - t v."""
        t = torch.as_tensor(t, dtype=x.dtype).expand(x.shape[0])
        return x - t[:, None] * self(x, t, labels)
