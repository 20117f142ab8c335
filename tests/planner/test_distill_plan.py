"""The planner's DMD2 run (``distill.method=dmd2``, ``planner/distill.py``): its estimate is the
sum of its roles' lines, it exceeds a plain run's by exactly the critic's and teacher's terms, it
refuses the layouts DMD2 refuses, and on CPU it is within 5% of a real DMD2 step measured with
``LiveMemory`` (plus the tensors each role holds before the step)."""

import pytest

from conftest import tiny_overrides
from videodit.cli import main
from videodit.config import load_config
from videodit.errors import UserError
from videodit.planner.distill import role_terms
from videodit.planner.measure import measure_distill_step, synthetic_batch
from videodit.planner.plan import planner_from_config
from videodit.train.trainer import Trainer

# Small but not trivial: the model state (student, critic, teacher: ~10 MiB) and the graded pass's
# activations (~130 MiB) both well above the step's fixed costs (captions, latents, noise).
WAN = {"model.preset": "wan-tiny", "model.depth": 4, "model.hidden_size": 64, "model.num_heads": 4,
       "model.ffn_dim": 256, "model.patch_size": "[1,2,2]", "text.max_length": 16, "train.precision": "fp32"}
SHAPE = (2, 8, 32, 32)   # batch, frames, height, width: 4,096 tokens
# Activations only ~1.6x the state: the plain step's convention shows (gradients, activations and
# backward's transients added, as if all were whole at once; the student's backward frees its
# activations as it makes its gradients, and the step's peak is the no-grad scoring): an upper bound.
STATE_HEAVY = (2, 4, 16, 16)
DMD2 = {"distill.method": "dmd2", "distill.generator_every": 1, "distill.steps": "[1000,500]"}


def planner(toy_dir, world_size=None, **extra):
    cfg = load_config("tiny", tiny_overrides(toy_dir, **{**WAN, **extra}))
    return planner_from_config(cfg, gpu_bytes=80 * 2**30, world_size=world_size)


@pytest.mark.parametrize("extra, world", [
    ({}, 1),
    ({"train.precision": "bf16", "memory.checkpointing": "full"}, 1),
    ({"train.optimizer": "adamw8bit", "train.ema_decay": 0.0}, 1),
    ({"parallel.dp_shard": 1, "parallel.dp_replicate": 2}, 2),   # DDP: each role's gradient buckets
])
def test_the_estimate_is_its_roles_and_a_plain_run_plus_critic_and_teacher(toy_dir, extra, world):
    plain = planner(toy_dir, world, **extra).estimate(*SHAPE)
    dmd2 = planner(toy_dir, world, **DMD2, **{"distill.teacher": "t"}, **extra).estimate(*SHAPE)
    lines = dict(dmd2.lines())
    assert sum(lines.values()) == dmd2.peak
    assert {"student weights", "student grads", "student optimizer", "student EMA", "critic weights",
            "critic optimizer", "teacher weights (frozen)"} <= set(lines)
    assert dmd2.peak - plain.peak == role_terms(dmd2) > 0
    # Every student line, the graded pass and the encoders are the plain run's.
    for name in ("params", "grads", "optimizer", "ema", "ddp_buckets", "activations", "temporaries", "encoders"):
        assert getattr(dmd2, name) == getattr(plain, name), name
    n = dmd2.detail["num_params"]
    assert dmd2.critic_params == dmd2.teacher == plain.params == 4 * n   # fp32 storage, also under bf16
    assert dmd2.critic_optimizer == plain.optimizer and dmd2.critic_grads == 0 and dmd2.passes == 0
    assert dmd2.critic_ddp_buckets == plain.ddp_buckets == (plain.grads if world > 1 else 0)


def test_a_shared_base_lora_run_holds_one_base_and_two_adapters(toy_dir):
    plain = planner(toy_dir, **{"lora.rank": 8}).estimate(*SHAPE)
    dmd2 = planner(toy_dir, **DMD2, **{"distill.teacher": "t", "lora.rank": 8}).estimate(*SHAPE)
    lines = dict(dmd2.lines())
    assert sum(lines.values()) == dmd2.peak and dmd2.peak - plain.peak == role_terms(dmd2)
    assert dmd2.teacher == 0 and dmd2.params == plain.params   # the base (and the student's adapter) once
    assert dmd2.critic_params == plain.grads == 4 * plain.detail["adapter_params"]   # one more fp32 adapter
    assert dmd2.critic_optimizer == plain.optimizer
    assert dmd2.detail["num_params_held"] == dmd2.detail["num_params"]


def test_a_trajectory_run_holds_its_teacher_unless_it_reads_its_trajectories(toy_dir):
    plain = planner(toy_dir).estimate(*SHAPE)
    online, cached = (planner(toy_dir, **{"distill.method": "trajectory", "distill.teacher": "t", **extra}).estimate(*SHAPE)
                      for extra in ({}, {"distill.trajectories": "/trajectories"}))
    assert online.peak - plain.peak == online.teacher == plain.params   # the fp32 teacher beside the student
    assert cached.peak == plain.peak and cached.teacher == 0


def test_plan_prints_each_role_on_its_own_line(toy_dir, capsys):
    overrides = tiny_overrides(toy_dir, **WAN, **DMD2, **{"distill.teacher": "t"})
    assert main(["plan", "tiny", *overrides, "--gpu-mem", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "DMD2: student + critic trained, teacher frozen" in out and "critic teacher" in out
    block = out[out.index("by role"):].splitlines()[1:14]
    labels = [line.rsplit(None, 1)[0].strip() for line in block]
    assert labels[0] == "student weights" and labels[-1] == "peak (the sum)" and len(labels) == 13
    assert {"critic weights", "critic optimizer", "teacher weights (frozen)"} <= set(labels)

@pytest.mark.parametrize("extra", [{"parallel.tp": 2}, {"parallel.pp": 2}])
def test_plan_refuses_the_layouts_dmd2_refuses(toy_dir, extra):
    with pytest.raises(UserError, match="set parallel.tp=1 parallel.pp=1"):
        planner(toy_dir, 2, **DMD2, **{"distill.teacher": "t"}, **extra)


def test_under_fsdp2_each_role_is_sharded_like_the_student(toy_dir):
    one, two = (planner(toy_dir, world, **DMD2, **{"distill.teacher": "t"}).estimate(*SHAPE) for world in (1, 2))
    assert two.critic_params == two.teacher == 4 * two.detail["params_per_gpu"] < one.teacher
    assert two.critic_optimizer == two.optimizer < one.optimizer


@pytest.fixture(scope="module")
def teacher(toy_dir, tmp_path_factory):
    """The model to distil: one step of ordinary training of the WAN geometry."""
    run = tmp_path_factory.mktemp("teacher") / "run"
    Trainer(load_config("tiny", tiny_overrides(toy_dir, **WAN, **{"train.max_steps": 1})), run).fit()
    return run / "checkpoints" / "step-0000001"


@pytest.mark.parametrize("lora", [0, 32], ids=["full", "shared-base-lora"])
def test_the_estimate_matches_a_measured_dmd2_step(toy_dir, teacher, tmp_path, lora):
    overrides = tiny_overrides(toy_dir, **WAN, **DMD2, **{"distill.teacher": str(teacher),
                                                          "train.deterministic": True, "lora.rank": lora})
    trainer = Trainer(load_config("tiny", overrides), tmp_path / "run")
    planned = planner_from_config(load_config("tiny", overrides), gpu_bytes=1)
    for shape, low, high in ((SHAPE, 0.95, 1.05), (STATE_HEAVY, 1.0, 1.10)):
        measured = measure_distill_step(trainer, synthetic_batch(*shape))
        predicted = planned.estimate(*shape)
        lines = dict(predicted.lines())
        # What each role holds: exact but for the models' buffers, which the planner does not count.
        for role, bytes_ in measured.roles.items():
            key = next(line for line in lines if line.startswith(role))   # "teacher": its weights, or the base
            assert abs(lines[key] - bytes_) <= 0.01 * bytes_ + 4096, role
        assert abs(predicted.activations / measured.activations - 1) <= 0.05
        # The whole step: the roles' tensors plus the step's own peak (gradients, activations, transients).
        ratio = predicted.peak / measured.peak
        assert low <= ratio <= high, f"{shape}: predicted / measured = {ratio:.3f}"
