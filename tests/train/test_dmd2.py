"""DMD2 distillation on the trainer (train/dmd2.py): the critic's loss, the generator interval,
exact resume of both roles, the student's sampler, and the layouts it refuses."""

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import dmd2_overrides, random_model_folder, tiny_overrides
from videodit.cli import main
from videodit.config import load_config
from videodit.distill.dmd import score_timesteps
from videodit.errors import UserError
from videodit.sample import Pipeline
from videodit.train.trainer import Trainer


def weights(folder, stem="model"):
    return load_file(str(folder / f"{stem}.safetensors"))


def same(a, b) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_the_student_moves_on_generator_steps_the_critic_on_every_step(toy_dir, dmd2_teacher, tmp_path):
    run = tmp_path / "run"
    Trainer(load_config("tiny", dmd2_overrides(toy_dir, dmd2_teacher, **{"checkpoint.every_steps": 1})), run).fit()
    ckpts = [run / "checkpoints" / f"step-{s:07d}" for s in range(1, 5)]
    students = [weights(dmd2_teacher)] + [weights(c) for c in ckpts]   # the student starts as the teacher
    critics = [weights(dmd2_teacher)] + [weights(c, "critic") for c in ckpts]
    # Step i (0-based) updates the student when i % 2 == 0: checkpoints 1 and 3 differ from the one before.
    assert [not same(students[i], students[i + 1]) for i in range(4)] == [True, False, True, False]
    assert all(not same(critics[i], critics[i + 1]) for i in range(4))
    record = (run / "metrics.jsonl").read_text().splitlines()[0]
    assert all(key in record for key in ("generator_loss", "critic_loss", "critic_grad_norm"))


@pytest.mark.parametrize("lora", [0, 4], ids=["full", "shared-base-lora"])
def test_resume_restores_student_critic_and_both_optimizers_exactly(toy_dir, dmd2_teacher, tmp_path, lora):
    common = dmd2_overrides(toy_dir, dmd2_teacher, **{"lora.rank": lora})
    straight, split = tmp_path / "straight", tmp_path / "split"
    Trainer(load_config("tiny", common), straight).fit()
    Trainer(load_config("tiny", common + ["train.max_steps=3"]), split).fit()   # stops between generator turns
    Trainer(load_config("tiny", common + ["resume=auto"]), split).fit()
    a, b = straight / "checkpoints/step-0000004", split / "checkpoints/step-0000004"
    for stem in ("model", "ema", "critic"):
        assert same(weights(a, stem), weights(b, stem)), stem
    moments = [torch.load(c / "critic_optimizer.pt", weights_only=True)["state"] for c in (a, b)]
    assert all(torch.equal(x, y) for s in moments[0] for x, y in zip(moments[0][s].values(), moments[1][s].values()))


def test_the_critic_learns_flow_matching_on_the_students_samples(toy_dir, dmd2_teacher, tmp_path):
    trainer = Trainer(load_config("tiny", dmd2_overrides(toy_dir, dmd2_teacher)), tmp_path / "run")
    dmd = trainer.distill
    x0_data, cond, _ = dmd._conditions(next(trainer.batches()))
    with torch.no_grad():
        x0 = dmd._rollout(x0_data, cond, 1, torch.Generator().manual_seed(3))
    inputs, target = dmd._critic_inputs(x0, cond, torch.Generator().manual_seed(4))
    # The same draws by hand: t (uniform, warped, clamped), then the noise; x_t and v = noise - x0.
    generator = torch.Generator().manual_seed(4)
    t = score_timesteps(x0.shape[0], (0.02, 0.98), 5.0, generator)
    noise = torch.randn(x0.shape, generator=generator)
    x_t = (1 - t.view(-1, 1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1, 1) * noise
    want = trainer.flow.loss(dmd.critic.module(*trainer.spec.model_inputs(x_t, t, cond)), x_t, t, noise - x0)
    assert torch.equal(dmd.critic.loss(inputs, target), want)


def test_a_distilled_run_samples_with_its_own_schedule(toy_dir, dmd2_teacher, tmp_path):
    run = tmp_path / "run"
    Trainer(load_config("tiny", dmd2_overrides(toy_dir, dmd2_teacher, **{"train.max_steps": 1})), run).fit()
    assert list((run / "samples" / "step-0000001").glob("*.mp4"))   # the run's own samples, 2 steps, cfg 1
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(0 < row.get("sample_diversity", 0) <= 1 and "sample_motion" in row for row in logged)
    sampler = Pipeline(run, device="cpu")
    clips = sampler(["a red circle moving right"], seed=0)
    assert clips.shape[0] == 1
    with pytest.raises(UserError, match="distilled to sample with 2 steps"):
        sampler(["a red circle moving right"], steps=30)
    with pytest.raises(UserError, match="drop --steps and --cfg"):
        sampler(["a red circle moving right"], guidance=4.0)


FAMILIES = {
    "wan": {"model.preset": "wan-tiny", "text.dim": 32},
    "mmdit": {"model.preset": "mmdit-tiny", "model.hidden_size": 64, "model.patch_size": "[1,2,2]", "text.dim": 32,
              "diffusion.shift_rule": "opensora2", "diffusion.sigma_min": 1e-5, "diffusion.prediction": "velocity",
              "diffusion.loss_space": "velocity"},
    # LTX-2's video stream: its objective's noising is rectified flow's at first_frame_p 0 (text-to-video)
    "ltx2": {"model.preset": "ltx2-tiny", "model.patch_size": "[1,1,1]", "text.dim": 32, "data.height": 8,
             "data.width": 8, "diffusion.prediction": "velocity", "diffusion.loss_space": "velocity"},
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_dmd2_distils_every_flow_matching_family(toy_dir, tmp_path, family):
    """Wan (its negative-prompt branch), Open-Sora 2.0's MMDiT and LTX-2, as STDiT above: both roles move."""
    teacher = random_model_folder(tiny_overrides(toy_dir, **FAMILIES[family]), tmp_path / "teacher")
    run = tmp_path / "run"
    Trainer(load_config("tiny", dmd2_overrides(toy_dir, teacher, **FAMILIES[family], **{
        "distill.generator_every": 1, "train.max_steps": 1})), run).fit()
    start, ckpt = weights(teacher), run / "checkpoints" / "step-0000001"
    assert not same(start, weights(ckpt)) and not same(start, weights(ckpt, "critic"))


@pytest.mark.parametrize("extra, words", [
    ({"distill.teacher": "null"}, "set distill.teacher"),
    ({"parallel.pp": 2}, "set parallel.pp=1"),
    ({"lora.rank": 4, "model.init_from": "/elsewhere"}, "is not distill.teacher"),
    ({"distill.score_t_range": "[0.9,0.1]"}, "low < high"),
    ({"distill.trajectories": "/trajectories"}, "does not read them"),
    ({"model.preset": "ltx2-tiny", "diffusion.first_frame_p": 0.5}, "given frames"),
])
def test_what_dmd2_refuses_is_named_in_one_line(toy_dir, dmd2_teacher, tmp_path, capsys, extra, words):
    run = tmp_path / "run"
    assert main(["train", "--out", str(run), *dmd2_overrides(toy_dir, dmd2_teacher, **extra)]) != 0
    assert words in capsys.readouterr().err
    assert not (run / "checkpoints").exists()


def test_trajectory_distillation_regresses_the_guided_teachers_ode_endpoint(toy_dir, dmd2_teacher, tmp_path):
    overrides = dmd2_overrides(toy_dir, dmd2_teacher, **{"distill.method": "trajectory", "distill.teacher_substeps": 3,
                                                        "train.max_steps": 2})
    trainer = Trainer(load_config("tiny", overrides), tmp_path / "run")
    objective = trainer.distill
    _, cond, generator = objective._conditions(next(trainer.batches()))
    noise = torch.randn(4, 3, 4, 16, 16, generator=generator)
    at_exit, end = objective.trajectory(noise, cond, 1)

    def euler(x, levels):   # guided Euler by hand: 3 steps from sigma 1 to 5/6, 3 more on to 0
        for s, s_next in zip(levels[:-1], levels[1:]):
            t = torch.full((x.shape[0],), s)
            x = x + (s_next - s) * (x - objective._teacher_x0(x, t, cond)) / s
        return x

    levels = torch.linspace(1.0, 5 / 6, 4).tolist() + torch.linspace(5 / 6, 0.0, 4).tolist()[1:]
    with torch.no_grad():
        assert torch.allclose(at_exit, euler(noise, levels[:4]), atol=1e-6)
        assert torch.allclose(end, euler(noise, levels), atol=1e-6)
    trainer.fit()   # two steps: the student moves off the teacher, its regression loss is logged
    assert not same(weights(dmd2_teacher), weights(tmp_path / "run" / "checkpoints" / "step-0000002"))
    assert "trajectory_loss" in (tmp_path / "run" / "metrics.jsonl").read_text()


def test_two_experts_are_distilled_each_on_its_own_side_of_the_boundary(toy_dir, tmp_path):
    """Wan 2.2 A14B's layout (``model.expert=both``, boundary 0.75): the student's steps sit on both
    sides (sigmas 1 and 0.625); each step trains the expert its exit step belongs to, and teacher
    and critic score at timesteps on that side, pinned to it: only that expert's critic moves."""
    from test_wan_experts import BOTH

    teacher_run = tmp_path / "teacher"
    Trainer(load_config("tiny", tiny_overrides(toy_dir, **{**BOTH, "train.max_steps": 1})), teacher_run).fit()
    run = tmp_path / "run"
    trainer = Trainer(load_config("tiny", dmd2_overrides(toy_dir, teacher_run / "checkpoints" / "step-0000001", **{
        **BOTH, "distill.steps": "[1000,250]", "distill.generator_every": 1, "train.max_steps": 6,
        "checkpoint.every_steps": 1, "train.ema_decay": 0})), run)
    trainer.fit()
    sides = []
    for step in range(6):
        expert = trainer.distill._expert_of(trainer.distill.sigmas[trainer.distill._exit_index(step)])
        before = run / "checkpoints" / f"step-{step:07d}" if step else None
        after = run / "checkpoints" / f"step-{step + 1:07d}"
        for stem in ("model", "critic"):
            old = weights(before, stem) if before else None
            new = weights(after, stem)
            if old is not None:
                moved = {k.split(".")[0] for k in new if not torch.equal(new[k], old[k])}
                assert moved == {f"{expert}_noise_model"}, (step, stem, moved)
        sides.append(expert)
    assert set(sides) == {"high", "low"}


@pytest.mark.parametrize("within", [(0.75, 1.0), (0.0, 0.75)])
def test_score_timesteps_on_one_side_are_the_draw_conditioned_on_it(within):
    full = score_timesteps(200_000, (0.02, 0.98), 5.0, torch.Generator().manual_seed(0)).double()
    side = score_timesteps(20_000, (0.02, 0.98), 5.0, torch.Generator().manual_seed(1), within).double()
    assert bool(((side >= within[0]) & (side < within[1])).all())
    inside = full[(full >= within[0]) & (full < within[1])]
    for q in (0.1, 0.5, 0.9):   # the same distribution as the full draw's part on that side
        assert abs(torch.quantile(side, q) - torch.quantile(inside, q)) < 0.01
