"""A run folder written before the package restructuring (commit 66be50c) still resumes.

The fixture ``tests/fixtures/legacy_run_66be50c`` was written by the old code with
``scripts/make_legacy_run.py`` (its README.md has the exact command): a tiny model trained for
4 steps, with its step-4 checkpoint. Its ``data.csv`` is the relative ``videodit-toy/train.csv``
with ``data.make_toy_if_missing``, so running from an empty working directory regenerates the
same toy clips (and the same data fingerprint) with the current code.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

FIXTURE = Path(__file__).parents[1] / "fixtures" / "legacy_run_66be50c"
OLD_STEP = 4
NEW_STEP = 6


def _events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "checkpoints.jsonl").read_text().splitlines() if line.strip()]


def _assert_same(loaded: dict, saved: dict, what: str) -> None:
    assert loaded.keys() == saved.keys(), f"{what}: names differ: {sorted(loaded.keys() ^ saved.keys())}"
    for name, tensor in saved.items():
        assert torch.equal(loaded[name].detach().cpu(), tensor), f"{what}: {name} differs"


def test_legacy_run_resumes(tmp_path, monkeypatch, capsys):
    from videodit.checkpoint import LoadedCheckpoint
    from videodit.cli import main

    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    monkeypatch.chdir(tmp_path)   # data.csv (videodit-toy/train.csv) is generated here
    old_ckpt = run / "checkpoints" / f"step-{OLD_STEP:07d}"
    old_model = load_file(old_ckpt / "model.safetensors")
    old_ema = load_file(old_ckpt / "ema.safetensors")
    old_optimizer = torch.load(old_ckpt / "optimizer.pt", map_location="cpu", weights_only=True)

    # The current checkpoint reader sees the old files as written.
    _assert_same(LoadedCheckpoint(old_ckpt).tensors("model"), old_model, "LoadedCheckpoint model")
    _assert_same(LoadedCheckpoint(old_ckpt).tensors("ema"), old_ema, "LoadedCheckpoint ema")

    # What the trainer holds right after loading: the parameters and AdamW state at the first
    # optimizer step after the resume (torch's global optimizer hooks, so that this test does
    # not depend on where the Trainer lives or how it names its parts), and after each step.
    before, after = [], []

    def snapshot(optimizer):
        group = optimizer.param_groups[0]
        return {"params": [p.detach().clone() for p in group["params"]], "lr": group["lr"],
                "state": [{k: v.detach().clone() if torch.is_tensor(v) else v
                           for k, v in optimizer.state[p].items()} for p in group["params"]]}

    # torch's set_optimizer_state_dict initialises empty AdamW state with one step at lr 0;
    # training steps are those that find the state already there.
    training_step = []

    def pre_step(optimizer, args, kwargs):
        training_step[:] = [all(optimizer.state[p] for p in optimizer.param_groups[0]["params"])]
        if training_step[0]:
            before.append(snapshot(optimizer))

    def post_step(optimizer, args, kwargs):
        if training_step[0]:
            after.append(snapshot(optimizer))

    hooks = [register_optimizer_step_pre_hook(pre_step), register_optimizer_step_post_hook(post_step)]
    try:
        code = main(["train", str(run / "config.yaml"), "resume=auto", f"train.max_steps={NEW_STEP}",
                     "--out", str(run)])
    finally:
        for hook in hooks:
            hook.remove()
    out, err = capsys.readouterr()
    assert code == 0, f"train exited {code}\nstdout:\n{out}\nstderr:\n{err}"

    # Resumed from the old run's newest checkpoint, at its step, with no config change.
    assert "resumed from " in out and f"step-{OLD_STEP:07d} at step {OLD_STEP}" in out, out
    assert "config changed since the checkpoint" not in out, out
    events = _events(run)
    resumes = [e for e in events if e["event"] == "resume"]
    assert [(e["step"], e["path"]) for e in resumes] == [(OLD_STEP, f"checkpoints/step-{OLD_STEP:07d}")]
    assert len(before) == len(after) == NEW_STEP - OLD_STEP, "the resumed run did not take 2 steps"

    # The old weights and AdamW moments are what the new code loaded (the optimizer's
    # parameter order is the name order that optimizer.pt records).
    names = old_optimizer["param_groups"][0]["params"]
    assert sorted(names) == sorted(old_model), "optimizer.pt does not name every model tensor"
    first = before[0]
    assert len(first["params"]) == len(names)
    for name, param, state in zip(names, first["params"], first["state"]):
        assert torch.equal(param, old_model[name]), f"trainer parameter {name} differs from model.safetensors"
        saved = old_optimizer["state"][name]
        assert float(state["step"]) == float(saved["step"]) == OLD_STEP
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], saved[key]), f"AdamW {key} of {name} differs from optimizer.pt"
    old_state = json.loads((old_ckpt / "state.json").read_text())
    assert old_state["step"] == OLD_STEP
    assert first["lr"] == pytest.approx(old_state["scheduler"]["_last_lr"][0])

    # Finished at NEW_STEP, and the new checkpoint loads.
    assert f"done: step {NEW_STEP}" in out, out
    saves = [e["step"] for e in events if e["event"] == "save"]
    assert saves[-1] == NEW_STEP and events.index(resumes[0]) < len(events) - 1
    new_ckpt = run / "checkpoints" / f"step-{NEW_STEP:07d}"
    ckpt = LoadedCheckpoint(new_ckpt)
    assert ckpt.json_state()["step"] == NEW_STEP
    new_model = ckpt.tensors("model")
    assert new_model.keys() == old_model.keys()
    assert any(not torch.equal(new_model[k], old_model[k]) for k in old_model), "two more steps changed nothing"
    for name, param in zip(names, after[-1]["params"]):
        assert torch.equal(new_model[name], param), f"saved {name} is not the weight after step {NEW_STEP}"
    assert ckpt.torch_state("optimizer")["state"].keys() == old_optimizer["state"].keys()
    # The EMA went on from the old run's EMA: ema_6 = lerp(lerp(ema_4, w_5), w_6).
    decay = yaml.safe_load((run / "config.yaml").read_text())["train"]["ema_decay"]
    new_ema = ckpt.tensors("ema")
    for i, name in enumerate(names):
        expected = old_ema[name].clone()
        for snap in after:
            expected.lerp_(snap["params"][i].float(), 1.0 - decay)
        assert torch.allclose(new_ema[name], expected, rtol=0, atol=1e-6), f"EMA {name} did not continue"
    assert old_ckpt.is_dir(), "the checkpoint resumed from must survive save_total_limit=1"

    from videodit.sample import Pipeline

    pipeline = Pipeline(new_ckpt, device="cpu")
    assert pipeline.weights == "ema"
    clips = pipeline(["a red circle moving right"], steps=2)
    assert clips.shape == (1, 4, 16, 16, 3)

    # Through the model-family seam: the old run (its config.yaml has no model.family) is STDiT's,
    # and its checkpoint exports as a model folder that load_pretrained rebuilds bit for bit.
    from videodit.checkpoint import export
    from videodit.models import load_pretrained
    from videodit.models.families import spec_of

    assert pipeline.cfg.model.family == "stdit" and spec_of(pipeline.model).family == "stdit"
    exported = load_pretrained(export(old_ckpt, tmp_path / "exported"))
    _assert_same(exported.state_dict(), old_model, "an export of the old checkpoint")
