"""Shared-base LoRA DMD2 (train/shared_base.py): student and critic are two adapters of the
teacher's one frozen model; the base stays bit-identical, each role saves its own adapter, and
activation checkpointing recomputes a forward with the adapter it ran with."""

import torch
from safetensors.torch import load_file

from conftest import dmd2_overrides
from videodit.config import load_config
from videodit.models.lora import adapter_state, base_name, lora_layers, using_adapter
from videodit.train.trainer import Trainer


def adapters(folder, stem):
    return load_file(str(folder / f"{stem}.safetensors"))


def changed(a, b) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a)


def test_student_and_critic_train_as_adapters_of_the_teachers_untouched_base(toy_dir, dmd2_teacher, tmp_path):
    run = tmp_path / "run"
    trainer = Trainer(load_config("tiny", dmd2_overrides(toy_dir, dmd2_teacher, **{
        "lora.rank": 4, "checkpoint.every_steps": 1})), run)
    trainer.fit()
    teacher = load_file(str(dmd2_teacher / "model.safetensors"))
    base = {base_name(n): p for n, p in trainer.model.named_parameters() if ".lora_" not in n}
    assert base.keys() == teacher.keys() and all(torch.equal(base[k], teacher[k]) for k in teacher)
    ckpts = [run / "checkpoints" / f"step-{s:07d}" for s in range(1, 5)]
    students, critics = [adapters(c, "model") for c in ckpts], [adapters(c, "critic") for c in ckpts]
    assert all(".lora_A.default." in k or ".lora_B.default." in k for k in students[0])
    assert all(".lora_A.critic." in k or ".lora_B.critic." in k for k in critics[0])
    # The student moves on steps 0 and 2 (checkpoints 1 and 3), so 1 -> 2 and 3 -> 4 keep it.
    assert [changed(students[i], students[i + 1]) for i in range(3)] == [False, True, False]
    assert all(changed(critics[i], critics[i + 1]) for i in range(3))


def test_one_step_is_the_same_with_activation_checkpointing_on_and_off(toy_dir, dmd2_teacher, tmp_path):
    """A generator turn: the student's forward, then critic and teacher forwards (other adapters),
    then the student's backward, which recomputes its checkpointed blocks."""
    got = {}
    for mode in ("none", "full", "selective"):
        run = tmp_path / mode
        Trainer(load_config("tiny", dmd2_overrides(toy_dir, dmd2_teacher, **{
            "lora.rank": 4, "train.max_steps": 1, "memory.checkpointing": mode, "train.ema_decay": 0})), run).fit()
        ckpt = run / "checkpoints" / "step-0000001"
        got[mode] = {**adapters(ckpt, "model"), **adapters(ckpt, "critic")}
    for mode in ("full", "selective"):
        assert all(torch.equal(got[mode][k], got["none"][k]) for k in got["none"]), mode


def nonzero_adapters(model) -> None:
    """Both adapters nonzero and different (B starts at zero, which would hide a wrong adapter)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)


def test_checkpointing_recomputes_with_the_adapter_of_the_forward(toy_dir, dmd2_teacher, tmp_path):
    """The trap: backward run while another adapter is active. Without the recorded adapter the
    recomputed blocks would use the critic's weights and give the student other gradients."""
    grads = []
    for mode in ("none", "full"):
        trainer = Trainer(load_config("tiny", dmd2_overrides(toy_dir, dmd2_teacher, **{
            "lora.rank": 4, "memory.checkpointing": mode})), tmp_path / mode)
        nonzero_adapters(trainer.model)
        dmd = trainer.distill
        x0_data, cond, generator = dmd._conditions(next(trainer.batches()))
        x = torch.randn(x0_data.shape, generator=generator)
        x0 = dmd._x0(trainer.parallel.module, trainer.parallel.autocast, x, torch.full((x.shape[0],), 0.5), cond)
        with using_adapter(lora_layers(trainer.model), "critic"):
            x0.square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and all(".lora_" in k and ".default." in k for k in grads[0])
    assert all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])


def test_the_teacher_is_the_base_with_adapters_off(toy_dir, dmd2_teacher, tmp_path):
    trainer = Trainer(load_config("tiny", dmd2_overrides(toy_dir, dmd2_teacher, **{"lora.rank": 4})), tmp_path / "r")
    dmd, layers = trainer.distill, lora_layers(trainer.model)
    nonzero_adapters(trainer.model)
    x0_data, cond, generator = dmd._conditions(next(trainer.batches()))
    x = torch.randn(x0_data.shape, generator=generator)
    t = torch.full((x.shape[0],), 0.5)
    autocast = trainer.parallel.autocast
    teacher = dmd._x0(dmd.teacher, autocast, x, t, cond)
    student = dmd._x0(trainer.parallel.module, autocast, x, t, cond)
    critic = dmd._x0(dmd.critic.module, autocast, x, t, cond)
    assert adapter_state(layers) == "default"   # every switch is put back
    with using_adapter(layers, None):
        assert torch.equal(teacher, dmd._x0(trainer.parallel.module, autocast, x, t, cond))
    assert not torch.equal(teacher, student) and not torch.equal(student, critic)


def test_the_students_adapter_exports_with_its_sampler(toy_dir, dmd2_teacher, tmp_path):
    from videodit.cli import main

    run = tmp_path / "run"
    Trainer(load_config("tiny", dmd2_overrides(toy_dir, dmd2_teacher, **{"lora.rank": 4, "train.max_steps": 1})),
            run).fit()
    out = tmp_path / "out"
    assert main(["ckpt", "export", str(run), str(out), "--lora-format", "peft"]) == 0
    exported = load_file(str(out / "adapter_model.safetensors"))
    assert exported and not any("critic" in k for k in exported)   # the student's adapter alone
    assert "2 steps" in (out / "SAMPLING.md").read_text() and "cfg 1" in (out / "SAMPLING.md").read_text()
