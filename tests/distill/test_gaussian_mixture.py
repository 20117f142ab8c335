"""Few-step distillation works on a 2-D Gaussian-mixture world with an exact teacher
(``gaussian_mixture.py``), using videodit's own math: ``videodit.distill.schedule`` (``warp``,
``step``, ``sample``) and ``videodit.distill.dmd`` (``score_timesteps``, ``guided``,
``dmd_gradient``, ``generator_loss``).

The world: 8 classes, each an isotropic Gaussian (std 0.2) on a circle of radius 2; the label
is the condition (a caption's stand-in) and the pooled samples are the 8-component mixture. The
teacher is the exact class-conditional posterior mean, so every error below is the sampler's or
the student's. Distances are sliced 2-Wasserstein on 8192 points, against data drawn apart.

* The noise floor: the teacher's 30-step Euler ODE against the data (independent sets; the mean
  of four pairs, ~0.057, where data against data gives ~0.052).
* The teacher at the student's 4 re-noised steps (``warp([1000, 750, 500, 250], 2)``) returns
  posterior means: each class shrinks to about a quarter of its spread, far above the floor.
* DMD2 (a data-free student with backward simulation, a critic, two time scales) and trajectory
  distillation (KD) both bring the 4-step student down to the floor.

Why class-conditional: unconditionally, a smooth MLP student needs many thousands of DMD steps
to split its first steps' blobs into 8 modes (it passes through rings of samples between the
modes); per class the target is unimodal and the test runs in seconds, and the condition is how
videodit's students are used anyway.

Why the critic learns the student's 4-step samples and not, as DMD2, Self-Forcing
(``critic_loss`` runs the generator's backward simulation) and ``videodit/train/dmd2.py`` do, the
x0 of the exit step drawn for the generator: a critic of the mixture over exit steps is satisfied once the mixture
matches the data, and in 2-D the exits settle into offsetting errors (class means off by up to
~0.16 radially at 4 steps, compensated at the earlier exits), which left the 4-step samples at
SW 0.066-0.123 over four seeds, against 0.047-0.052 over twelve seeds with this critic. The
generator still trains every exit step by backward simulation.

``pytest -s`` prints the figures.
"""

import copy
import time

import pytest
import torch

from gaussian_mixture import GaussianMixture, TeacherPlusMLP, noised, renoised_sample, sliced_wasserstein, \
    teacher_ode, teacher_trajectory
from videodit.distill import dmd, schedule

STEPS = [1000, 750, 500, 250]   # the student's timesteps (distill.steps' default)
SHIFT = 2.0                     # their warp: sigmas [1, 0.857, 0.667, 0.4]; also the score timesteps' warp
T_RANGE = (0.02, 0.98)          # distill.score_t_range's default
N = 8192                        # points per set compared
SEEDS = {"data": 0, "eval": 1, "student": 2, "critic": 3, "dmd": 4, "kd": 5}

# DMD2. The generator updates on every 5th step, the critic on every step (DMD2's two-time-scale
# rule, distill.generator_every 5); both Adam with beta1 0 (DMD2's), the critic at twice the
# generator's learning rate (at equal rates the critic lags and the class spread oscillates; at 4x
# the critic's loss spikes now and then). Each generator sample is scored at 4 independent
# timesteps: one noise draw of a 2-D point is a very noisy estimate of its gradient, where a
# video's latent averages millions of them. The student is evaluated as its EMA (DMD2's).
DMD_ITERS, GENERATOR_EVERY, BATCH, SCORE_DRAWS = 1500, 5, 512, 4
GENERATOR_LR, CRITIC_LR, EMA_DECAY = 5e-4, 1e-3, 0.95
TEACHER_CFG = 1.0               # guidance off: the conditional teacher is the real score
KD_ITERS, KD_TRAJECTORIES = 400, 8192

# The pass mark: within 1.5x the noise floor, the distance between independent sets of the data and
# of the teacher's 30-step samples (~0.057); the 4-step teacher sits at ~2.3x it.
FLOOR_FACTOR = 1.5
FLOOR_SETS = 4


def _rows(title: str, figures: dict) -> None:
    print(f"\n{title}")
    for name, value in figures.items():
        print(f"  {name:<44} {value:.4f}" if isinstance(value, float) else f"  {name:<44} {value}")


@pytest.fixture(scope="module")
def world():
    """The world, its evaluation sets (data, noise, labels) and the teacher's figures."""
    mixture = GaussianMixture(components=8, radius=2.0, std=0.2)
    g = torch.Generator().manual_seed(SEEDS["data"])
    data = mixture.sample(N, g)
    e = torch.Generator().manual_seed(SEEDS["eval"])
    noise, labels = torch.randn(N, 2, generator=e), mixture.labels(N, e)
    sigmas = schedule.warp(STEPS, SHIFT)
    teacher4 = renoised_sample(lambda x, t: mixture.velocity(x, t, labels), noise, sigmas,
                               torch.Generator().manual_seed(SEEDS["eval"] + 100))
    # The floors: means over FLOOR_SETS independent pairs (one pair's figure varies by +-20%).
    data_vs_data = [sliced_wasserstein(mixture.sample(N, g), mixture.sample(N, g)) for _ in range(FLOOR_SETS)]
    teacher30 = [teacher_ode(mixture, torch.randn(N, 2, generator=e)) for _ in range(FLOOR_SETS)]
    data_vs_ode = [sliced_wasserstein(mixture.sample(N, g), ode) for ode in teacher30]
    return {"mixture": mixture, "data": data, "noise": noise, "labels": labels, "sigmas": sigmas,
            "teacher4": teacher4,
            "data_vs_data": sum(data_vs_data) / FLOOR_SETS, "floor": sum(data_vs_ode) / FLOOR_SETS,
            "teacher4_sw": sliced_wasserstein(data, teacher4),
            "teacher4_vs_teacher30": sliced_wasserstein(teacher30[0], teacher4)}


def _four_step(world, model) -> torch.Tensor:
    """The student's 4-step samples of the evaluation noise and labels (re-noised, the same fresh
    noise as the teacher's), as videodit samples a student."""
    with torch.no_grad():
        return renoised_sample(lambda x, t: model(x, t, world["labels"]), world["noise"], world["sigmas"],
                               torch.Generator().manual_seed(SEEDS["eval"] + 100))


def _class_std(x: torch.Tensor, labels: torch.Tensor, classes: int) -> torch.Tensor:
    """Each class's spread (the mean of its two coordinates' std)."""
    return torch.stack([x[labels == k].std(0).mean() for k in range(classes)])


def test_world_teacher_is_exact(world):
    """The analytic teacher: the denoiser's limits, its velocity as the flow-matching optimum
    (no other field beats it on the loss), and a 30-step ODE that reproduces the data."""
    mixture = world["mixture"]
    g = torch.Generator().manual_seed(7)
    x0, labels = mixture.sample(4096, g).double(), mixture.labels(4096, g)
    eps = torch.randn(4096, 2, generator=g, dtype=torch.float64)
    # t -> 0: the denoiser returns its input; t = 1: the class mean (conditional) or mixture mean.
    assert torch.allclose(mixture.denoise(x0, 1e-9), x0, atol=1e-6)
    assert torch.allclose(mixture.denoise(eps, 1.0, labels), mixture.means[labels], atol=1e-12)
    assert mixture.denoise(eps, 1.0).abs().max() < 1e-12
    # The flow-matching loss of the exact velocity is below that of its perturbations.
    t = torch.rand(4096, generator=g, dtype=torch.float64) * 0.96 + 0.02
    xt = noised(x0, eps, t)
    target = eps - x0
    v = mixture.velocity(xt, t)
    best = (v - target).pow(2).mean()
    for scale in (0.95, 1.05):
        assert (scale * v - target).pow(2).mean() > best
    assert ((v + 0.05) - target).pow(2).mean() > best
    # The 30-step ODE is as close to the data as fresh data is (the noise floor is the sampling's).
    _rows("world", {"SW data vs data (mean of 4 pairs)": world["data_vs_data"],
                    "SW data vs teacher 30-step (floor, 4 pairs)": world["floor"]})
    assert world["floor"] < 1.25 * world["data_vs_data"]


def test_teacher_at_four_renoised_steps_collapses(world):
    """The teacher run as a 4-step student (x0 prediction, then fresh noise) outputs posterior
    means: each class keeps a fraction of its spread, and the set is far from the data."""
    mixture = world["mixture"]
    spread = _class_std(world["teacher4"], world["labels"], mixture.components)
    _rows("teacher at 4 re-noised steps", {"sigmas": [round(s, 4) for s in world["sigmas"].tolist()],
                                           "SW data vs teacher 4-step": world["teacher4_sw"],
                                           "SW teacher 30-step vs teacher 4-step": world["teacher4_vs_teacher30"],
                                           "class std (data 0.2)": f"{spread.min():.3f}-{spread.max():.3f}"})
    assert spread.max() < 0.5 * mixture.std
    assert world["teacher4_sw"] > 2 * world["floor"]
    assert world["teacher4_vs_teacher30"] > 2 * world["floor"]


def _dmd2(world) -> tuple[TeacherPlusMLP, dict]:
    """DMD2 on the world: the student (x0 prediction) learns from the teacher's and the critic's
    scores only, never from data."""
    mixture, sigmas = world["mixture"], world["sigmas"]
    levels = [float(s) for s in sigmas] + [0.0]
    g = torch.Generator().manual_seed(SEEDS["dmd"])
    student = TeacherPlusMLP(mixture, "x0", torch.Generator().manual_seed(SEEDS["student"]))
    critic = TeacherPlusMLP(mixture, "velocity", torch.Generator().manual_seed(SEEDS["critic"]))
    ema = copy.deepcopy(student).requires_grad_(False)
    opt_g = torch.optim.Adam(student.net.parameters(), lr=GENERATOR_LR, betas=(0.0, 0.999))
    opt_c = torch.optim.Adam(critic.net.parameters(), lr=CRITIC_LR, betas=(0.0, 0.999))
    critic_losses = []
    for it in range(DMD_ITERS):
        # The critic (fake score): flow matching on the student's 4-step samples, at uniform t.
        labels = mixture.labels(BATCH, g)
        with torch.no_grad():
            x0 = renoised_sample(lambda x, t: student(x, t, labels), torch.randn(BATCH, 2, generator=g), sigmas, g)
        t = T_RANGE[0] + (T_RANGE[1] - T_RANGE[0]) * torch.rand(BATCH, generator=g)
        eps = torch.randn(BATCH, 2, generator=g)
        loss_c = (critic(noised(x0, eps, t), t, labels) - (eps - x0)).pow(2).mean()
        opt_c.zero_grad()
        loss_c.backward()
        opt_c.step()
        critic_losses.append(loss_c.item())
        if it % GENERATOR_EVERY:
            continue
        # The generator: backward simulation to an exit step drawn uniformly, x0 there with grad.
        exit_step = int(torch.randint(len(STEPS), (1,), generator=g))
        labels = mixture.labels(BATCH, g)
        x = torch.randn(BATCH, 2, generator=g)
        with torch.no_grad():
            for j in range(exit_step):
                v = student(x, levels[j], labels)
                x = schedule.step(x, v, levels[j], levels[j + 1], torch.randn(BATCH, 2, generator=g))
        x0 = schedule.step(x, student(x, levels[exit_step], labels), levels[exit_step], 0.0, None)
        x0, labels = x0.repeat(SCORE_DRAWS, 1), labels.repeat(SCORE_DRAWS)
        t = dmd.score_timesteps(len(x0), T_RANGE, SHIFT, g)
        xt = noised(x0.detach(), torch.randn(x0.shape, generator=g), t)
        with torch.no_grad():
            real = dmd.guided(mixture.denoise(xt, t, labels), mixture.denoise(xt, t), TEACHER_CFG)
            fake = critic.x0(xt, t, labels)
        loss_g = dmd.generator_loss(x0, dmd.dmd_gradient(x0, fake, real))
        opt_g.zero_grad()
        loss_g.backward()
        opt_g.step()
        with torch.no_grad():
            for pe, ps in zip(ema.net.parameters(), student.net.parameters()):
                pe.lerp_(ps, 1 - EMA_DECAY)
    return ema, {"critic loss, first/last 50 steps": f"{sum(critic_losses[:50]) / 50:.3f} / "
                                                     f"{sum(critic_losses[-50:]) / 50:.3f}"}


def test_dmd2_student_matches_the_data_in_four_steps(world):
    """DMD2 from a copy of the teacher (the MLP's correction starts at zero, so the student starts
    as the collapsed 4-step teacher, the generator DMD2 starts from) to the noise floor."""
    mixture = world["mixture"]
    initial = TeacherPlusMLP(mixture, "x0", torch.Generator().manual_seed(SEEDS["student"]))
    initial_sw = sliced_wasserstein(world["data"], _four_step(world, initial))
    start = time.perf_counter()
    student, extra = _dmd2(world)
    seconds = time.perf_counter() - start
    samples = _four_step(world, student)
    final_sw = sliced_wasserstein(world["data"], samples)
    spread = _class_std(samples, world["labels"], mixture.components)
    threshold = FLOOR_FACTOR * world["floor"]
    _rows("DMD2 student, 4 re-noised steps", {
        "SW data vs teacher 30-step (floor)": world["floor"], "SW data vs teacher 4-step": world["teacher4_sw"],
        "SW data vs student, initial": initial_sw, "SW data vs student, final (EMA)": final_sw,
        "threshold (1.5 x floor)": threshold, "class std (data 0.2)": f"{spread.min():.3f}-{spread.max():.3f}",
        "iterations / generator steps": f"{DMD_ITERS} / {DMD_ITERS // GENERATOR_EVERY}",
        "training seconds": f"{seconds:.1f}", "seeds": SEEDS, **extra})
    # The student starts as the teacher (its correction is zero), so as collapsed as it.
    assert initial_sw == pytest.approx(world["teacher4_sw"], rel=1e-3)
    assert world["teacher4_sw"] > threshold
    assert final_sw < threshold
    assert spread.min() > 0.8 * mixture.std and spread.max() < 1.2 * mixture.std


def test_trajectory_distilled_student_matches_the_data_in_four_steps(world):
    """KD: the student regressed onto the endpoints of the teacher's 30-step ODE trajectories from
    its own 4 sigmas (the ODE's flow map); re-noised sampling then keeps every step on the data's
    marginals."""
    mixture, sigmas = world["mixture"], world["sigmas"]
    g = torch.Generator().manual_seed(SEEDS["kd"])
    labels = mixture.labels(KD_TRAJECTORIES, g)
    states, endpoints = teacher_trajectory(mixture, torch.randn(KD_TRAJECTORIES, 2, generator=g), sigmas, labels)
    student = TeacherPlusMLP(mixture, "x0", torch.Generator().manual_seed(SEEDS["student"]))
    opt = torch.optim.Adam(student.net.parameters(), lr=1e-3)
    for _ in range(KD_ITERS):
        rows = torch.randint(KD_TRAJECTORIES, (BATCH,), generator=g)
        step = torch.randint(len(STEPS), (BATCH,), generator=g)
        t = sigmas.float()[step]
        loss = (student.x0(states[step, rows], t, labels[rows]) - endpoints[rows]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    sw = sliced_wasserstein(world["data"], _four_step(world, student))
    threshold = FLOOR_FACTOR * world["floor"]
    _rows("KD student, 4 re-noised steps", {"SW data vs teacher 4-step": world["teacher4_sw"],
                                            "SW data vs KD student": sw, "threshold (1.5 x floor)": threshold,
                                            "regression loss, last batch": f"{loss.item():.2e}"})
    assert sw < threshold < world["teacher4_sw"]
