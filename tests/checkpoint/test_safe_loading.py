"""Loading a checkpoint someone handed us: nothing in it runs code (DCP shards included), every
read is checked against the manifest (size, SHA-256, regular file), and damaged or malformed
checkpoints end in one line from every reader, list and inspect included."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from videodit.checkpoint import (CheckpointManager, LoadedCheckpoint, export, format_inspect, format_list, inspect,
                                 list_run, verify_checkpoint)
from videodit.errors import UserError
from videodit.parallel.state import load_shards, save_shards, sharded_state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Evil:
    """Unpickling it creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def small_model(seed: int = 0, lr: float = 1e-3):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model(torch.randn(2, 8)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    ema = {name: p.detach().clone() + 1 for name, p in model.named_parameters()}
    return model, optimizer, ema


def sharded_checkpoint(run: Path, state=None) -> Path:
    """A real checkpoint of a sharded run on one process: DCP shards written by ``dcp.save``
    (or ``state``, a state dict written as it is) inside a CheckpointManager save."""
    model, optimizer, ema = small_model()

    def write_shards(staging: Path) -> None:
        if state is None:
            save_shards(staging, model, optimizer, ema)
        else:
            dcp.save(state, checkpoint_id=str(staging / "dcp"), no_dist=True)

    return CheckpointManager(run).save(1, tensors={"model": model.state_dict()}, torch_states={},
                                       json_state={"step": 1}, config_yaml="model: {}\n", write_shards=write_shards)


def replace_file(ckpt: Path, name: str, data: bytes) -> None:
    """Put ``data`` at ``name`` and make the manifest agree (size and SHA-256): only the
    content can give it away."""
    (ckpt / name).write_bytes(data)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def flip_last_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[-1] ^= 0xFF   # same size: only the checksum can tell
    file.write_bytes(bytes(data))


def fresh_target(seed: int = 1):
    model, optimizer, ema = small_model(seed, lr=5.0)
    return model, optimizer, {k: torch.zeros_like(v) for k, v in ema.items()}


# ---------------------------------------------------------------------------- DCP shards


def test_dcp_shards_round_trip(tmp_path):
    model, optimizer, ema = small_model()
    ckpt = sharded_checkpoint(tmp_path / "run")
    assert verify_checkpoint(ckpt) is None and LoadedCheckpoint(ckpt).has_shards
    target, target_opt, target_ema = fresh_target()
    load_shards(ckpt, target, target_opt, target_ema)
    for name, tensor in model.state_dict().items():
        assert torch.equal(target.state_dict()[name], tensor), name
    assert all(torch.equal(target_ema[k], v) for k, v in ema.items())
    assert target_opt.param_groups[0]["lr"] == 1e-3 and target_opt.param_groups[0]["betas"] == (0.9, 0.999)
    for saved, loaded in zip(optimizer.param_groups[0]["params"], target_opt.param_groups[0]["params"]):
        assert torch.equal(target_opt.state[loaded]["exp_avg_sq"], optimizer.state[saved]["exp_avg_sq"])


def test_a_malicious_dcp_metadata_is_refused_without_running_it(tmp_path):
    ckpt = sharded_checkpoint(tmp_path / "run")
    marker = tmp_path / "pwned"
    evil = pickle.dumps(Evil(marker))
    replace_file(ckpt, "dcp/.metadata", evil)
    assert verify_checkpoint(ckpt) is None   # sizes and hashes agree: the manifest cannot tell
    with pytest.raises(UserError, match=r"dcp/\.metadata holds objects other than checkpoint metadata \(io\.open\), "
                                        r"which videodit refuses to unpickle; use a checkpoint written by videodit"):
        load_shards(ckpt, *fresh_target())
    assert not marker.exists()
    pickle.loads(evil)   # the control: unpickled for real, it does run
    assert marker.exists()


def test_a_malicious_dcp_value_is_refused_without_running_it(tmp_path):
    """DCP stores non-tensor values (the learning rate, ...) as pickles in the shard files and
    unpickles them with weights_only=False; a crafted one never runs here."""
    marker = tmp_path / "pwned"
    model, optimizer, ema = small_model()
    state = sharded_state(model, optimizer, ema)
    state["optimizer"]["param_groups"][0]["lr"] = Evil(marker)
    ckpt = sharded_checkpoint(tmp_path / "run", state=state)
    assert not marker.exists() and verify_checkpoint(ckpt) is None
    with pytest.raises(UserError, match="refuses to unpickle"):
        load_shards(ckpt, *fresh_target())
    assert not marker.exists()
    # The control: DCP's own reader runs it.
    target, target_opt, target_ema = fresh_target()
    dcp.load(sharded_state(target, target_opt, target_ema), checkpoint_id=str(ckpt / "dcp"), no_dist=True)
    assert marker.exists()


def test_dcp_metadata_pointing_outside_its_shards_is_refused(tmp_path):
    ckpt = sharded_checkpoint(tmp_path / "run")
    metadata = pickle.loads((ckpt / "dcp" / ".metadata").read_bytes())   # our own file: trusted here
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"x" * 4096)
    for where in metadata.storage_data.values():
        where.relative_path = "../../../../secret.bin"
    replace_file(ckpt, "dcp/.metadata", pickle.dumps(metadata))
    with pytest.raises(UserError, match="not a shard file in the manifest"):
        load_shards(ckpt, *fresh_target())


def test_damaged_or_odd_shard_files_are_refused(tmp_path):
    ckpt = sharded_checkpoint(tmp_path / "run")
    shard = ckpt / "dcp" / "__0_0.distcp"
    flip_last_byte(shard)
    assert verify_checkpoint(ckpt) == "dcp/__0_0.distcp does not match its SHA-256 in the manifest"
    with pytest.raises(UserError, match=r"dcp/__0_0\.distcp does not match its SHA-256"):
        load_shards(ckpt, *fresh_target())
    shard.unlink()
    shard.symlink_to("/dev/zero")
    with pytest.raises(UserError, match=r"dcp/__0_0\.distcp is not a regular file"):
        load_shards(ckpt, *fresh_target())
    (ckpt / "manifest.json").write_text(json.dumps({"files": {"dcp/.metadata": {"bytes": 1}}}))
    with pytest.raises(UserError, match="malformed entry 'dcp/.metadata'"):
        load_shards(ckpt, *fresh_target())


def test_train_resume_from_a_checkpoint_with_malicious_shards_refuses(toy_dir, tmp_path, capsys):
    from conftest import tiny_overrides
    from videodit.cli import main

    run = tmp_path / "run"
    assert main(["train", "--out", str(run), *tiny_overrides(toy_dir, **{"train.max_steps": 1,
                                                                         "checkpoint.every_steps": 1})]) == 0
    ckpt = run / "checkpoints" / "step-0000001"
    marker = tmp_path / "pwned"
    (ckpt / "dcp").mkdir()
    replace_file(ckpt, "dcp/.metadata", pickle.dumps(Evil(marker)))
    capsys.readouterr()
    code = main(["train", "--out", str(tmp_path / "other"), *tiny_overrides(toy_dir, **{"train.max_steps": 2}),
                 f"resume={ckpt}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error")] == [
        f"error: checkpoint {ckpt}: dcp/.metadata holds objects other than checkpoint metadata (io.open), which "
        "videodit refuses to unpickle; use a checkpoint written by videodit"]
    assert not marker.exists()


# ---------------------------------------------------------------------------- checked reads


def saved(tmp_path: Path, step: int = 1) -> Path:
    from test_checkpoint import fake_state

    return CheckpointManager(tmp_path / "run").save(step, **fake_state(step))


def test_every_read_checks_the_sha256(tmp_path):
    """resume=PATH, sampling and export read through LoadedCheckpoint: a bit flip that keeps
    the size is caught when that file is read, and only that file is refused."""
    ckpt = saved(tmp_path)
    flip_last_byte(ckpt / "model.safetensors")
    loaded = LoadedCheckpoint(ckpt)   # opening reads only the manifest
    with pytest.raises(UserError, match=r"is damaged: model\.safetensors does not match its SHA-256"):
        loaded.tensors("model")
    assert loaded.tensors("ema") and loaded.json_state()["step"] == 1   # the rest is still usable
    with pytest.raises(UserError, match="model.safetensors does not match its SHA-256"):
        export(ckpt, tmp_path / "export")
    assert not (tmp_path / "export").exists()
    for name, check in (("optimizer.pt", lambda: loaded.torch_state("optimizer")),
                        ("state.json", loaded.json_state), ("config.yaml", loaded.config_yaml)):
        flip_last_byte(ckpt / name)
        with pytest.raises(UserError, match=f"{name} does not match its SHA-256"):
            check()


def run_with_deadline(fn, seconds: float = 20.0):
    """Run ``fn`` in a thread; fail instead of hanging the test run if it does not return."""
    outcome = {}

    def target():
        try:
            outcome["value"] = fn()
        except BaseException as exc:
            outcome["error"] = exc
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn} hung"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "folder", "larger"])
def test_odd_files_are_refused_without_hanging(tmp_path, kind):
    ckpt = saved(tmp_path)
    model = ckpt / "model.safetensors"
    size = model.stat().st_size
    model.unlink()
    if kind == "dev-zero":
        model.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(model)
    elif kind == "folder":
        model.mkdir()
    else:
        model.write_bytes(b"\0" * (size + 1))
    expected = f"model.safetensors has {size + 1} bytes, the manifest says {size}" if kind == "larger" else \
        "model.safetensors is not a regular file"
    loaded = LoadedCheckpoint(ckpt)
    with pytest.raises(UserError, match=expected):
        run_with_deadline(lambda: loaded.tensors("model"))
    assert expected in run_with_deadline(lambda: verify_checkpoint(ckpt))
    row = run_with_deadline(lambda: list_run(tmp_path / "run"))[0]
    assert "damaged" in row["marks"] and row["damaged"] == {"model.safetensors": expected}
    info = run_with_deadline(lambda: inspect(ckpt))
    assert info["damaged"] == {"model.safetensors": expected} and "error" in info["tensors"]["model"]
    assert f"DAMAGED: {expected}" in format_inspect(info)


def test_list_and_inspect_show_a_bit_flip(tmp_path):
    run = tmp_path / "run"
    manager = CheckpointManager(run)
    from test_checkpoint import fake_state
    for step in (1, 2):
        manager.save(step, **fake_state(step))
    flip_last_byte(run / "checkpoints" / "step-0000002" / "ema.safetensors")
    rows = list_run(run)
    assert [r["marks"] for r in rows] == [[], ["damaged"]]
    assert rows[1]["damaged"] == {"ema.safetensors": "ema.safetensors does not match its SHA-256 in the manifest"}
    assert "step 2 is damaged: ema.safetensors does not match its SHA-256" in format_list(rows)
    info = inspect(run / "checkpoints" / "step-0000002")
    assert list(info["damaged"]) == ["ema.safetensors"] and info["tensors"]["model"]["count"] == 3
    text = format_inspect(info)
    assert "DAMAGED: 1 file(s)" in text and "ema.safetensors" in text
    assert inspect(run / "checkpoints" / "step-0000001")["damaged"] == {}


MALFORMED = {
    "not-json": ("{not json", "manifest.json is not JSON"),
    "not-an-object": ("[1, 2]", "manifest.json is not a JSON object"),
    "files-not-a-mapping": ('{"files": ["model.safetensors"]}', "manifest.json has no 'files' mapping"),
    "no-sha256": ('{"files": {"model.safetensors": {"bytes": 3}}}',
                  "manifest.json: the entry of model.safetensors lacks a byte count or a SHA-256"),
    "bool-bytes": ('{"files": {"state.json": {"bytes": true, "sha256": "' + "0" * 64 + '"}}}',
                   "manifest.json: the entry of state.json lacks a byte count or a SHA-256"),
    "outside": ('{"files": {"../secret": {"bytes": 3, "sha256": "' + "0" * 64 + '"}}}',
                "manifest.json lists '../secret', which is not a file inside the checkpoint"),
    "deep": ("[" * 100_000, "manifest.json is not JSON"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_manifest_is_one_line_everywhere(tmp_path, capsys, case):
    from videodit.cli import main

    text, problem = MALFORMED[case]
    ckpt = saved(tmp_path)
    (ckpt / "manifest.json").write_text(text)
    with pytest.raises(UserError) as caught:
        LoadedCheckpoint(ckpt)
    assert str(caught.value) == f"checkpoint {ckpt} is damaged: {problem}; use an earlier checkpoint"
    with pytest.raises(UserError, match="is damaged: manifest.json"):
        inspect(ckpt)
    row = list_run(tmp_path / "run")[0]
    assert row["marks"] == ["damaged"] and row["damaged"] == {"manifest.json": problem} and row["bytes"] is None
    assert verify_checkpoint(ckpt) == problem
    capsys.readouterr()
    assert main(["ckpt", "inspect", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"error: checkpoint {ckpt} is damaged: {problem}; use an earlier checkpoint"
    assert main(["ckpt", "list", str(tmp_path / "run")]) == 0
    out = capsys.readouterr()
    assert f"step 1 is damaged: {problem}" in out.out and "Traceback" not in out.err


# ---------------------------------------------------------------------------- the readers themselves


def test_safetensors_reader_matches_the_library(tmp_path):
    tensors = {"f32": torch.randn(5, 7), "bf16": torch.randn(3, 4).to(torch.bfloat16), "i64": torch.arange(9),
               "bool": torch.tensor([True, False, True]), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3),
               "u8": torch.arange(11, dtype=torch.uint8), "f16": torch.randn(6).half()}
    run = tmp_path / "run"
    ckpt = CheckpointManager(run).save(3, tensors={"model": tensors}, torch_states={}, json_state={},
                                       config_yaml="")
    ours, theirs = LoadedCheckpoint(ckpt).tensors("model"), load_file(ckpt / "model.safetensors")
    assert ours.keys() == theirs.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor)
        assert torch.equal(theirs[name], tensor)
    # Each tensor owns its memory, as with load_file: safetensors can save them again.
    save_file(ours, str(tmp_path / "again.safetensors"))


def test_a_malformed_safetensors_file_with_a_matching_hash_is_one_line(tmp_path):
    ckpt = saved(tmp_path)
    header = json.dumps({"w": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}).encode()
    replace_file(ckpt, "model.safetensors", len(header).to_bytes(8, "little") + header + b"\0" * 16)
    with pytest.raises(UserError, match=r"model\.safetensors cannot be read \(tensor 'w' has offsets that do not "
                                        r"fit its shape or the file\)"):
        LoadedCheckpoint(ckpt).tensors("model")


def test_torch_states_round_trip_with_large_pickles_and_views(tmp_path):
    """torch.save's pickle record (large here) is copied before it is hashed on a helper
    thread; tensors and views are hashed in place. The manifest matches the bytes on disk."""
    base = torch.randn(300, 300)
    state = {"state": {i: {"step": torch.tensor(float(i)), "exp_avg": torch.randn(4)} for i in range(1000)},
             "param_groups": [{"lr": 0.1, "params": list(range(1000))}], "view": base[10:20], "base": base}
    ckpt = CheckpointManager(tmp_path / "run").save(1, tensors={}, torch_states={"optimizer": state},
                                                    json_state={}, config_yaml="")
    entry = json.loads((ckpt / "manifest.json").read_text())["files"]["optimizer.pt"]
    assert entry["sha256"] == hashlib.sha256((ckpt / "optimizer.pt").read_bytes()).hexdigest()
    loaded = LoadedCheckpoint(ckpt).torch_state("optimizer")
    assert torch.equal(loaded["view"], base[10:20]) and torch.equal(loaded["state"][999]["exp_avg"],
                                                                      state["state"][999]["exp_avg"])
    assert torch.serialization.get_crc32_options() is True   # the global option is restored
    assert torch.load(io.BytesIO((ckpt / "optimizer.pt").read_bytes()), weights_only=True)["param_groups"]


def test_tensor_shapes_come_from_the_header_and_never_hang(tmp_path):
    ckpt = saved(tmp_path)
    loaded = LoadedCheckpoint(ckpt)
    assert loaded.tensor_shapes("model") == {"blocks.0.weight": (64, 64), "blocks.0.bias": (64,), "pos": (64,)}
    (ckpt / "model.safetensors").unlink()
    os.mkfifo(ckpt / "model.safetensors")
    with pytest.raises(UserError, match="model.safetensors is not a regular file"):
        run_with_deadline(lambda: loaded.tensor_shapes("model"))
