"""Crash-safe checkpoints: atomic saves, retention, the event log, failures, loading safely,
export, async saves. Small fake states; no trainer."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from videodit.checkpoint import (CheckpointManager, LoadedCheckpoint, export, format_inspect, format_list, inspect,
                                 list_checkpoints, list_run, resolve_checkpoint, save_checkpoint, verify_checkpoint,
                                 write_checkpoint, write_safetensors)
from videodit.cli import main
from videodit.errors import UserError


def fake_state(seed: int = 0, n: int = 64):
    g = torch.Generator().manual_seed(seed)
    model = {"blocks.0.weight": torch.randn(n, n, generator=g), "blocks.0.bias": torch.randn(n, generator=g),
             "pos": torch.arange(n)}
    optimizer = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(n, n, generator=g)},
                           1: {"step": torch.tensor(3.0), "exp_avg": torch.randn(n, generator=g)}},
                 "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.99), "params": [0, 1]}]}
    return {"tensors": {"model": model, "ema": {k: v.clone() for k, v in model.items()},
                        "rng": {"torch_cpu": torch.get_rng_state()}},
            "torch_states": {"optimizer": optimizer},
            "json_state": {"step": seed, "epoch": 0, "data": {"epoch": 0, "offset": seed}},
            "config_yaml": "model:\n  preset: tiny\n"}


def events(run: Path, kind: str | None = None) -> list[dict]:
    lines = [json.loads(line) for line in (run / "checkpoints.jsonl").read_text().splitlines()] \
        if (run / "checkpoints.jsonl").exists() else []
    return [e for e in lines if kind is None or e["event"] == kind]


def steps(run: Path) -> list[int]:
    return [int(p.name.split("-")[1]) for p in list_checkpoints(run / "checkpoints")]


def leftovers(run: Path) -> list[str]:
    return [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]


def snapshot_files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


# ---------------------------------------------------------------------------- saving


def test_save_is_complete_verified_and_loadable(tmp_path):
    run = tmp_path / "run"
    manager = CheckpointManager(run)
    state = fake_state(7)
    path = manager.save(7, **state, metrics={"val_loss": torch.tensor(0.5), "bad": float("nan")})
    assert path == run / "checkpoints" / "step-0000007" and path.is_dir()
    assert leftovers(run) == []
    manifest = json.loads((path / "manifest.json").read_text())
    assert set(manifest["files"]) == {"model.safetensors", "ema.safetensors", "rng.safetensors", "optimizer.pt",
                                      "state.json", "config.yaml"}
    assert manifest["metrics"] == {"val_loss": 0.5, "bad": None}
    assert verify_checkpoint(path) is None and manager.latest() == path
    # Our streaming writer produces exactly what safetensors' own save_file does.
    save_file(state["tensors"]["model"], str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    assert (path / "model.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    loaded = LoadedCheckpoint(run)
    assert loaded.step == 7 and loaded.metrics["val_loss"] == 0.5 and loaded.has("ema")
    assert all(torch.equal(loaded.tensors("model")[k], v) for k, v in state["tensors"]["model"].items())
    opt = loaded.torch_state("optimizer")
    assert torch.equal(opt["state"][0]["exp_avg"], state["torch_states"]["optimizer"]["state"][0]["exp_avg"])
    assert opt["param_groups"][0]["betas"] == (0.9, 0.99)
    assert loaded.json_state() == state["json_state"] and loaded.config_yaml() == state["config_yaml"]


def test_an_interrupted_save_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    run = tmp_path / "run"
    manager = CheckpointManager(run)
    manager.save(1, **fake_state(1))

    def crash(state, file, *args, **kwargs):
        file.write(b"\x80" * 1000)
        raise KeyboardInterrupt   # the process dies in the middle of the optimizer file
    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        manager.save(2, **fake_state(2))
    assert steps(run) == [1] and leftovers(run) == [] and events(run, "save")[-1]["step"] == 1
    # A staging folder left by a killed process is invisible to resume.
    (run / "checkpoints" / ".staging-step-0000003-999999").mkdir()
    (run / "checkpoints" / ".staging-step-0000003-999999" / "manifest.json").write_text("{}")
    assert resolve_checkpoint(run).name == "step-0000001" and manager.latest().name == "step-0000001"


def test_resaving_a_step_replaces_it_whole(tmp_path):
    run = tmp_path / "run"
    manager = CheckpointManager(run)
    manager.save(5, **fake_state(1))
    manager.save(5, **fake_state(2))
    assert steps(run) == [5] and leftovers(run) == []
    assert LoadedCheckpoint(run).json_state()["data"]["offset"] == 2


def test_save_checkpoint_function_keeps_working(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    path = save_checkpoint(root, 3, **fake_state(3))
    assert path == root / "step-0000003" and verify_checkpoint(path) is None
    assert LoadedCheckpoint(path).json_state()["step"] == 3


# ---------------------------------------------------------------------------- housekeeping


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_cleanup_staging_removes_only_dead_or_own_leftovers(tmp_path):
    run = tmp_path / "run"
    root = run / "checkpoints"
    manager = CheckpointManager(run)
    manager.save(1, **fake_state(1))
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        dead = dead_pid()
        names = {"dead": f".staging-step-0000002-{dead}", "ours": f".staging-step-0000003-{os.getpid()}",
                 "deleting": f".deleting-step-0000000-{dead}", "live": f".staging-step-0000004-{live.pid}"}
        for name in names.values():
            (root / name).mkdir()
            (root / name / "model.safetensors").write_bytes(b"partial")
        removed = manager.cleanup_staging()
        assert sorted(p.name for p in removed) == sorted([names["dead"], names["ours"], names["deleting"]])
        assert leftovers(run) == [names["live"]] and steps(run) == [1]
        logged = events(run, "cleanup")
        assert sorted(Path(e["path"]).name for e in logged) == sorted(p.name for p in removed)
        assert any("interrupted save" in e["reason"] for e in logged)
        assert any("interrupted delete" in e["reason"] for e in logged)
    finally:
        live.kill()
        live.wait()
    assert [p.name for p in manager.cleanup_staging()] == [names["live"]]   # once its process is gone


def test_should_save_every_steps_and_every_minutes(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    by_steps = CheckpointManager(tmp_path / "a", every_steps=5)
    assert [s for s in range(1, 16) if by_steps.should_save(s)] == [5, 10, 15]
    by_time = CheckpointManager(tmp_path / "b", every_minutes=2)
    assert not by_time.should_save(1)
    clock[0] += 121
    assert by_time.should_save(2)
    by_time.save(2, **fake_state(2))
    assert not by_time.should_save(2) and not by_time.should_save(3)
    clock[0] += 119
    assert not by_time.should_save(4)
    clock[0] += 2
    assert by_time.should_save(5)
    assert not CheckpointManager(tmp_path / "c").should_save(100)
    with pytest.raises(UserError, match="checkpoint.mode='best' is not min or max"):
        CheckpointManager(tmp_path / "d", mode="best")


# ---------------------------------------------------------------------------- retention


def test_save_total_limit_keeps_the_last_k_and_logs_deletions(tmp_path):
    run = tmp_path / "run"
    manager = CheckpointManager(run, save_total_limit=2)
    for step in range(1, 6):
        manager.save(step, **fake_state(step), metrics={"loss": 1.0 / step})
    assert steps(run) == [4, 5] and leftovers(run) == []
    saves, deletes = events(run, "save"), events(run, "delete")
    assert [e["step"] for e in saves] == [1, 2, 3, 4, 5]
    assert [e["step"] for e in deletes] == [1, 2, 3]
    assert all(e["reason"] == "save_total_limit=2" for e in deletes)
    first = saves[0]
    assert {"event", "step", "path", "metrics", "bytes", "seconds", "time"} <= first.keys()
    assert first["path"] == "checkpoints/step-0000001" and first["metrics"] == {"loss": 1.0}
    final = run / "checkpoints" / "step-0000005"
    assert saves[-1]["bytes"] == sum(p.stat().st_size for p in final.iterdir())


@pytest.mark.parametrize("mode,best", [("min", 2), ("max", 3)])
def test_keep_best_by_metric(tmp_path, mode, best):
    run = tmp_path / "run"
    manager = CheckpointManager(run, save_total_limit=2, keep_best=1, metric="val_loss", mode=mode)
    values = {1: 3.0, 2: 1.0, 3: 9.0, 4: 4.0, 5: None, 6: 5.0, 7: 6.0}
    for step, value in values.items():
        manager.save(step, **fake_state(step), metrics=None if value is None else {"val_loss": value})
    assert steps(run) == sorted({best, 6, 7})
    assert "not among the 1 best by val_loss" in events(run, "delete")[0]["reason"]
    rows = list_run(run)
    assert [r["step"] for r in rows if "best" in r["marks"]] == [best]


def test_keep_best_two_and_no_deletion_without_a_limit(tmp_path):
    run = tmp_path / "run"
    manager = CheckpointManager(run, save_total_limit=1, keep_best=2, metric="acc", mode="max")
    for step, acc in enumerate([0.5, 0.9, 0.1, 0.8, 0.2], start=1):
        manager.save(step, **fake_state(step), metrics={"acc": acc})
    assert steps(run) == [2, 4, 5]
    unlimited = CheckpointManager(tmp_path / "u", keep_best=1)
    for step in range(1, 4):
        unlimited.save(step, **fake_state(step), metrics={"val_loss": step})
    assert steps(tmp_path / "u") == [1, 2, 3]


def test_the_checkpoint_a_run_resumed_from_is_kept(tmp_path):
    run = tmp_path / "run"
    first = CheckpointManager(run)
    for step in (1, 2, 3):
        first.save(step, **fake_state(step))
    resumed = CheckpointManager(run, save_total_limit=1)
    resumed.record_resume(run / "checkpoints" / "step-0000002")
    for step in (3, 4, 5):
        resumed.save(step, **fake_state(step))
    assert steps(run) == [2, 5]
    assert events(run, "resume") [0]["path"] == "checkpoints/step-0000002"
    rows = {r["step"]: r for r in list_run(run)}
    assert rows[2]["marks"] == ["resumed"] and rows[5]["marks"] == []
    # The constructor argument protects too.
    other = CheckpointManager(run, save_total_limit=1, resumed_from=run / "checkpoints" / "step-0000005")
    other.save(6, **fake_state(6))
    assert steps(run) == [5, 6]


# ---------------------------------------------------------------------------- failures


def staging_write_fails(monkeypatch, code: int, after_bytes: int):
    """os.write raises ``code`` once ``after_bytes`` were written into a staging folder."""
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc to tell writes into the staging folder apart")
    real_write, written = os.write, [0]

    def write(fd, data):
        if ".staging-" in os.readlink(f"/proc/self/fd/{fd}"):
            if written[0] + len(data) > after_bytes:
                raise OSError(code, os.strerror(code))
            written[0] += len(data)
        return real_write(fd, data)
    monkeypatch.setattr(os, "write", write)


@pytest.mark.parametrize("after_bytes", [100, 40_000], ids=["in-safetensors", "in-torch-save"])
def test_disk_full_raises_a_user_error_and_keeps_earlier_checkpoints(tmp_path, monkeypatch, after_bytes):
    run = tmp_path / "run"
    manager = CheckpointManager(run, save_total_limit=1)
    manager.save(1, **fake_state(1))
    before = snapshot_files(run / "checkpoints" / "step-0000001")
    staging_write_fails(monkeypatch, errno.ENOSPC, after_bytes)
    with pytest.raises(UserError) as info:
        manager.save(2, **fake_state(2))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("checkpoint save failed at step 2: No space left on device")
    assert f"free space in {run / 'checkpoints'}" in message and "earlier checkpoints are intact" in message
    monkeypatch.undo()
    assert steps(run) == [1] and leftovers(run) == []
    assert snapshot_files(run / "checkpoints" / "step-0000001") == before
    assert [e["step"] for e in events(run, "save")] == [1] and events(run, "delete") == []
    assert events(run, "save_failed")[0]["step"] == 2
    manager.save(3, **fake_state(3))   # and the run can go on once there is space again
    assert steps(run) == [3]


def test_permission_denied_raises_a_user_error(tmp_path, monkeypatch):
    run = tmp_path / "run"
    manager = CheckpointManager(run)
    manager.save(1, **fake_state(1))
    real_mkdir = os.mkdir

    def mkdir(path, *args, **kwargs):
        if ".staging-" in str(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_mkdir(path, *args, **kwargs)
    monkeypatch.setattr(os, "mkdir", mkdir)
    with pytest.raises(UserError, match=r"at step 2: Permission denied \(.*\.staging-step-0000002-\d+\); "
                                        r"make .* writable"):
        manager.save(2, **fake_state(2))
    monkeypatch.undo()
    assert steps(run) == [1] and leftovers(run) == [] and len(events(run, "save")) == 1
    staging_write_fails(monkeypatch, errno.EACCES, 0)
    with pytest.raises(UserError, match="Permission denied"):
        save_checkpoint(run / "checkpoints", 4, **fake_state(4))
    monkeypatch.undo()
    assert steps(run) == [1] and leftovers(run) == []


def test_a_failed_fsync_is_a_user_error(tmp_path, monkeypatch):
    run = tmp_path / "run"
    manager = CheckpointManager(run)

    def fsync(fd):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(UserError, match="at step 1: Input/output error .*; fix the problem with"):
        manager.save(1, **fake_state(1))
    monkeypatch.undo()
    assert steps(run) == [] and leftovers(run) == []


def test_latest_skips_damaged_checkpoints(tmp_path, capsys):
    run = tmp_path / "run"
    manager = CheckpointManager(run)
    for step in (1, 2, 3):
        manager.save(step, **fake_state(step))
    model = run / "checkpoints" / "step-0000003" / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[-1] ^= 0xFF   # same size, one bit pattern off: only the checksum can tell
    model.write_bytes(bytes(data))
    (run / "checkpoints" / "step-0000002" / "manifest.json").write_text("{not json")
    assert manager.latest() == run / "checkpoints" / "step-0000001"
    err = capsys.readouterr().err
    assert "skipping damaged checkpoint" in err and "step-0000003" in err and "SHA-256" in err
    assert "step-0000002" in err and "manifest.json" in err
    assert "damaged" in {r["step"]: r for r in list_run(run)}[2]["marks"]


class Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("zip_format", [True, False], ids=["torch-save", "raw-pickle"])
def test_a_malicious_pickle_is_refused_without_running_it(tmp_path, zip_format):
    run = tmp_path / "run"
    path = CheckpointManager(run).save(1, **fake_state(1))
    marker = tmp_path / "pwned"
    evil_file = path / "optimizer.pt"
    evil_file.unlink()
    if zip_format:
        torch.save({"state": Evil(marker)}, evil_file)
    else:
        evil_file.write_bytes(pickle.dumps({"state": Evil(marker)}))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["optimizer.pt"] = {"bytes": evil_file.stat().st_size,   # a consistent manifest:
                                         "sha256": hashlib.sha256(evil_file.read_bytes()).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(manifest))
    loaded = LoadedCheckpoint(path)
    with pytest.raises(UserError, match="refuses to unpickle"):
        loaded.torch_state("optimizer")
    assert not marker.exists()
    inspect(path)   # inspect never opens the optimizer state
    assert not marker.exists()
    # The control: unpickling it for real does run the payload.
    torch.load(evil_file, weights_only=False) if zip_format else pickle.loads(evil_file.read_bytes())
    assert marker.exists()


# ---------------------------------------------------------------------------- async


def test_async_save_writes_the_same_bytes_as_a_sync_save(tmp_path):
    state = fake_state(4)
    sync_path = CheckpointManager(tmp_path / "sync").save(4, **state)
    manager = CheckpointManager(tmp_path / "async")
    live = fake_state(4)
    async_path = manager.save(4, **live, blocking=False)
    for flat in live["tensors"].values():   # training goes on and changes the weights in place
        for tensor in flat.values():
            tensor.add_(1) if tensor.is_floating_point() else tensor.zero_()
    live["torch_states"]["optimizer"]["state"][0]["exp_avg"].mul_(0)
    manager.wait()
    a, b = snapshot_files(sync_path), snapshot_files(async_path)
    a.pop("manifest.json"), b.pop("manifest.json")
    assert a == b
    files = lambda p: json.loads((p / "manifest.json").read_text())["files"]  # noqa: E731
    assert files(sync_path) == files(async_path)
    assert events(tmp_path / "async", "save")[0]["async"] is True


def test_async_saves_reuse_their_cpu_buffers(tmp_path):
    manager = CheckpointManager(tmp_path / "run")
    state = fake_state(1)
    manager.save(1, **state, blocking=False)
    manager.wait()
    pointers = {key: buffer.data_ptr() for key, buffer in manager.snapshot_buffers.items()}
    assert len(pointers) == 3 + 3 + 1 + 4
    weight = state["tensors"]["model"]["blocks.0.weight"]
    weight.add_(1)
    manager.save(2, **state, blocking=False)
    manager.wait()
    assert {key: buffer.data_ptr() for key, buffer in manager.snapshot_buffers.items()} == pointers
    assert torch.equal(LoadedCheckpoint(tmp_path / "run").tensors("model")["blocks.0.weight"], weight)
    del state["tensors"]["ema"]
    manager.save(3, **state, blocking=False)
    manager.release_buffers()
    assert manager.snapshot_buffers == {} and not LoadedCheckpoint(tmp_path / "run").has("ema")


def test_at_most_one_async_save_in_flight(tmp_path):
    active, peak, lock = [0], [0], threading.Lock()

    def slow(*args, **kwargs):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.3)
        try:
            return write_checkpoint(*args, **kwargs)
        finally:
            with lock:
                active[0] -= 1
    run = tmp_path / "run"
    manager = CheckpointManager(run, save_total_limit=2, writer=slow)
    started = time.perf_counter()
    manager.save(1, **fake_state(1), blocking=False)
    assert time.perf_counter() - started < 0.25 and manager.in_flight   # returned before the write
    for step in (2, 3):
        manager.save(step, **fake_state(step), blocking=False)
    manager.wait()
    assert peak[0] == 1 and not manager.in_flight
    assert steps(run) == [2, 3]   # retention ran after the last write completed
    assert [e["step"] for e in events(run, "save")] == [1, 2, 3]


def test_a_background_failure_surfaces_on_the_next_call(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    manager = CheckpointManager(run)
    manager.save(1, **fake_state(1))
    staging_write_fails(monkeypatch, errno.ENOSPC, 100)
    manager.save(2, **fake_state(2), blocking=False)
    with pytest.raises(UserError, match="at step 2: No space left on device"):
        manager.wait()
    manager.wait()   # reported once
    assert "warning: checkpoint save failed at step 2" in capsys.readouterr().err
    manager.save(3, **fake_state(3), blocking=False)
    with pytest.raises(UserError, match="at step 3: No space left"):
        manager.save(4, **fake_state(4))   # the next save reports it (and does not save)
    monkeypatch.undo()
    assert steps(run) == [1] and leftovers(run) == []
    assert [e["step"] for e in events(run, "save")] == [1]
    manager.save(5, **fake_state(5), blocking=False)
    manager.wait()
    assert steps(run) == [1, 5]


def test_a_process_that_exits_without_wait_still_completes_its_async_save(tmp_path):
    script = f"""
import sys, time
sys.path.insert(0, {str(Path(__file__).parent)!r})
from videodit.checkpoint import CheckpointManager, write_checkpoint
from test_checkpoint import fake_state
def slow(*args, **kwargs):
    time.sleep(0.3)   # still writing when the main thread returns
    return write_checkpoint(*args, **kwargs)
CheckpointManager({str(tmp_path / "run")!r}, writer=slow).save(1, **fake_state(1), blocking=False)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "warning" not in done.stderr
    assert steps(tmp_path / "run") == [1]
    assert verify_checkpoint(tmp_path / "run" / "checkpoints" / "step-0000001") is None


# ---------------------------------------------------------------------------- tools and export


def test_list_and_inspect(tmp_path):
    run = tmp_path / "run"
    manager = CheckpointManager(run, keep_best=1)
    for step, loss in ((10, 0.5), (20, 0.25), (30, 0.4)):
        manager.save(step, **fake_state(step), metrics={"val_loss": loss})
    rows = list_run(run)
    assert [r["step"] for r in rows] == [10, 20, 30]
    assert rows[1]["marks"] == ["best"] and rows[0]["bytes"] > 0 and rows[0]["time"]
    table = format_list(rows)
    assert "val_loss=0.25" in table and "best" in table and len(table.splitlines()) == 4
    info = inspect(run)
    assert info["step"] == 30 and info["kind"] == "checkpoint" and info["total_params"] == 64 * 64 + 64 + 64
    assert info["tensors"]["model"]["dtypes"] == {"F32": 2, "I64": 1}
    assert info["state"]["data_offset"] == 30
    text = format_inspect(info)
    assert "blocks.0.weight" in text and "step: 30" in text
    with pytest.raises(UserError, match="has no checkpoints/ folder"):
        list_run(tmp_path / "nothing")


def tiny_config_yaml() -> str:
    from videodit.config import load_config, to_yaml
    return to_yaml(load_config("tiny", ["model.depth=1", "model.hidden_size=32", "model.num_heads=2",
                                        "model.patch_size=[1,4,4]", "data.num_frames=4", "data.height=16",
                                        "data.width=16", "sample.steps=2"]))


def test_export_and_sample_from_the_export(tmp_path):
    import yaml

    from videodit.components import build_encoders, build_model
    from videodit.config import from_dict
    from videodit.models import load_pretrained
    from videodit.models.stdit.model import geometry_config
    from videodit.sample import Pipeline

    config_yaml = tiny_config_yaml()
    cfg = from_dict(yaml.safe_load(config_yaml))
    vae, text = build_encoders(cfg, torch.device("cpu"))
    torch.manual_seed(0)
    model = build_model(cfg, vae, text)
    ema = {k: v.detach() + 0.01 for k, v in model.state_dict().items()}
    run = tmp_path / "run"
    CheckpointManager(run).save(12, tensors={"model": model.state_dict(), "ema": ema}, torch_states={},
                                json_state={"step": 12, "epoch": 0}, config_yaml=config_yaml)

    out = export(run, tmp_path / "export", use_ema=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "export.json", "model.safetensors",
                                                     "run_config.yaml"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".staging")]
    assert json.loads((out / "export.json").read_text()) == {"step": 12, "weights": "ema", "dtype": "fp32",
                                                             "source": str(run / "checkpoints" / "step-0000012")}
    # config.json holds the model's arguments only, and load_pretrained rebuilds the model from it.
    assert json.loads((out / "config.json").read_text()) == json.loads(json.dumps(geometry_config(model.geometry)))
    assert all(torch.equal(load_pretrained(out).state_dict()[k], ema[k]) for k in ema)
    weights = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(weights[k], ema[k]) for k in ema)

    assert resolve_checkpoint(out) == out
    loaded = LoadedCheckpoint(out)
    assert loaded.is_export and loaded.step == 12 and not loaded.has("ema") and loaded.has("model")
    assert yaml.safe_load(loaded.config_yaml()) == yaml.safe_load(config_yaml)
    with pytest.raises(UserError, match="is an exported model"):
        loaded.torch_state("optimizer")
    from_ckpt = Pipeline(run, device="cpu", use_ema=True)
    from_export = Pipeline(out, device="cpu")
    assert from_export.weights == "model"
    kwargs = dict(num_frames=4, height=16, width=16, steps=2, seed=0)
    assert (from_ckpt(["a red circle moving right"], **kwargs) ==
            from_export(["a red circle moving right"], **kwargs)).all()
    assert inspect(out)["kind"] == "export"

    half = export(run, tmp_path / "half", dtype="bf16")
    assert {v.dtype for v in load_file(str(half / "model.safetensors")).values()} == {torch.bfloat16}
    assert json.loads((half / "export.json").read_text())["weights"] == "model"
    Pipeline(half, device="cpu")   # bf16 weights load into the fp32 model
    with pytest.raises(UserError, match="already exists and is not empty"):
        export(run, out)
    with pytest.raises(UserError, match="not an export dtype"):
        export(run, tmp_path / "x", dtype="int8")


def test_an_export_written_before_model_folders_still_samples(tmp_path):
    """Exports used to be config.json = the run's config + a ``videodit_export`` record."""
    import yaml

    from videodit.components import build_encoders, build_model
    from videodit.config import from_dict
    from videodit.sample import Pipeline

    config_yaml = tiny_config_yaml()
    cfg = from_dict(yaml.safe_load(config_yaml))
    torch.manual_seed(0)
    model = build_model(cfg, *build_encoders(cfg, torch.device("cpu")))
    old = tmp_path / "old-export"
    old.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(old / "model.safetensors"))
    record = {"step": 7, "weights": "ema", "dtype": "fp32", "source": "somewhere"}
    (old / "config.json").write_text(json.dumps({**yaml.safe_load(config_yaml), "videodit_export": record}))
    loaded = LoadedCheckpoint(old)
    assert loaded.is_export and not loaded.is_model_folder and loaded.step == 7
    assert yaml.safe_load(loaded.config_yaml()) == yaml.safe_load(config_yaml)
    assert inspect(old)["export"] == record
    pipeline = Pipeline(old, device="cpu")
    assert all(torch.equal(pipeline.model.state_dict()[k], v) for k, v in model.state_dict().items())


def odd_tensors():
    return {"bf16": torch.randn(3, 5).to(torch.bfloat16), "bool": torch.tensor([True, False]),
            "empty": torch.zeros(0, 4), "scalar": torch.tensor(2.5), "strided": torch.randn(4, 6).t(),
            "int8": torch.arange(-3, 3, dtype=torch.int8)}


def test_write_safetensors_round_trips_odd_tensors(tmp_path):
    tensors = odd_tensors()
    record = write_safetensors(tmp_path / "x.safetensors", tensors)
    assert record["bytes"] == (tmp_path / "x.safetensors").stat().st_size
    back = load_file(str(tmp_path / "x.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in tensors.items())


def test_async_save_of_odd_tensors(tmp_path):
    tensors = odd_tensors()
    state = {"tensors": {"model": tensors}, "torch_states": {"optimizer": {"state": dict(tensors)}},
             "json_state": {}, "config_yaml": ""}
    manager = CheckpointManager(tmp_path / "run")
    for step in (1, 2):   # the second re-uses the buffers of the first
        manager.save(step, **state, blocking=False)
        manager.wait()
        loaded = LoadedCheckpoint(tmp_path / "run")
        assert all(torch.equal(loaded.tensors("model")[k], v) for k, v in tensors.items())
        assert all(torch.equal(loaded.torch_state("optimizer")["state"][k], v) for k, v in tensors.items())
        for tensor in tensors.values():
            tensor.add_(1) if tensor.dtype != torch.bool else tensor.logical_not_()


# ---------------------------------------------------------------------------- exports that do not finish


def tiny_run(tmp_path) -> Path:
    """A run folder with one checkpoint (step 3) of a tiny model."""
    import yaml

    from videodit.components import build_encoders, build_model
    from videodit.config import from_dict

    config_yaml = tiny_config_yaml()
    cfg = from_dict(yaml.safe_load(config_yaml))
    model = build_model(cfg, *build_encoders(cfg, torch.device("cpu")))
    run = tmp_path / "run"
    CheckpointManager(run).save(3, tensors={"model": model.state_dict()}, torch_states={},
                                json_state={"step": 3, "epoch": 0}, config_yaml=config_yaml)
    return run


def staging_folders(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".staging-"))


KILLED_EXPORT = """
import os, signal, sys
import videodit.checkpoint.tools as tools
real = tools.write_safetensors
def write_then_die(*args, **kwargs):
    real(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)   # as kill -9 or the OOM killer would, before the rename
tools.write_safetensors = write_then_die
from videodit.cli import main
main(["ckpt", "export", sys.argv[1], sys.argv[2]])
"""


@pytest.mark.parametrize("next_out", ["export", "other"], ids=["same-command-again", "another-export-beside-it"])
def test_a_killed_export_leaves_a_staging_folder_that_the_next_export_removes(tmp_path, capsys, next_out):
    run = tiny_run(tmp_path)
    killed = subprocess.Popen([sys.executable, "-c", KILLED_EXPORT, str(run), str(tmp_path / "export")],
                              cwd=tmp_path, stderr=subprocess.DEVNULL)
    assert killed.wait(timeout=120) == -9
    assert staging_folders(tmp_path) == [f".staging-export-{killed.pid}"] and not (tmp_path / "export").exists()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:   # what stays: an export still running here, and one of a process on another host (a shared folder)
        for name, host in ((f".staging-running-{live.pid}", socket.gethostname()),
                           (f".staging-remote-{dead_pid()}", "another-host")):
            (tmp_path / name).mkdir()
            (tmp_path / name / ".videodit-staging.json").write_text(json.dumps({"pid": int(name.rsplit("-", 1)[1]),
                                                                                 "host": host}))
        assert main(["ckpt", "export", str(run), str(tmp_path / next_out)]) == 0
        assert f"removed {tmp_path / f'.staging-export-{killed.pid}'}, left by an export" in capsys.readouterr().err
        assert [name.rsplit("-", 1)[0] for name in staging_folders(tmp_path)] == [".staging-remote", ".staging-running"]
    finally:
        live.kill()
        live.wait()
    assert sorted(p.name for p in (tmp_path / next_out).iterdir()) == ["config.json", "export.json",
                                                                       "model.safetensors", "run_config.yaml"]


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"), RuntimeError("a bug"),
                                   KeyboardInterrupt()], ids=["disk-full", "exception", "ctrl-c"])
def test_an_export_that_fails_removes_its_staging_folder(tmp_path, monkeypatch, error):
    import videodit.checkpoint.tools as tools

    run = tiny_run(tmp_path)
    real = tools.write_safetensors

    def write_then_fail(*args, **kwargs):
        real(*args, **kwargs)
        raise error
    monkeypatch.setattr(tools, "write_safetensors", write_then_fail)
    with pytest.raises(UserError if isinstance(error, OSError) else type(error)) as info:
        export(run, tmp_path / "export")
    if isinstance(error, OSError):
        assert str(info.value).startswith("export failed: No space left on device") and "\n" not in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]   # no staging folder, no output
