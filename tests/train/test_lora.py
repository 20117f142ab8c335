"""LoRA (lora.rank > 0) on one process: what trains, what a checkpoint holds, exact resume,
sampling the adapters on their base, the merged export, bf16 with checkpointing, and sizes."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_overrides
from videodit.checkpoint import LoadedCheckpoint, export
from videodit.checkpoint.lora import init_weights
from videodit.cli import main
from videodit.components import model_geometry
from videodit.config import load_config
from videodit.models import load_pretrained
from videodit.models.lora import is_adapter_name
from videodit.models.stdit.model import STDiT
from videodit.sample import Pipeline
from videodit.train.trainer import Trainer


def make_base(overrides: list[str], folder, seed: int = 0):
    """A base model folder for ``overrides``' geometry: random weights, nothing left at zero (a
    fresh STDiT zeroes its output layer, which would give the adapters no gradient)."""
    cfg = load_config("tiny", overrides)
    torch.manual_seed(seed)
    model = STDiT(model_geometry(cfg, 3, cfg.text.dim))   # identity VAE: 3 channels; toy captions
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model.save_pretrained(folder)


def lora_overrides(toy_dir, base, **extra):
    return tiny_overrides(toy_dir, **{"lora.rank": 4, "model.init_from": str(base), "train.lr": 1e-2, **extra})


def losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_only_the_adapters_train_and_checkpoints_hold_only_them(toy_dir, tmp_path):
    base = make_base(tiny_overrides(toy_dir), tmp_path / "base")
    trainer = Trainer(load_config("tiny", lora_overrides(toy_dir, base)), tmp_path / "run")
    named = dict(trainer.model.named_parameters())
    trained = {name for name, p in named.items() if p.requires_grad}
    assert trained and all(is_adapter_name(name) for name in trained)
    assert {"spatial_blocks.0.attn.q.lora_A.default.weight",
            "temporal_blocks.0.mlp.fc2.lora_B.default.weight"} <= trained
    assert not any("cross_attn" in name for name in trained)          # default targets: self-attention and MLP
    before = {name: p.detach().clone() for name, p in named.items()}
    trainer.fit()
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(named[name]) for name in trained}
    assert all(named[name].grad is None for name in named if name not in trained)
    assert all(torch.equal(before[name], named[name]) for name in named if name not in trained)   # frozen
    assert any(not torch.equal(before[name], named[name]) for name in trained)                    # trained

    ckpt = tmp_path / "run" / "checkpoints" / "step-0000004"
    for stem in ("model", "ema"):
        assert set(load_file(ckpt / f"{stem}.safetensors")) == trained
    state = json.loads((ckpt / "state.json").read_text())
    assert state["lora_base"]["path"] == str(base.resolve())
    assert set(state["lora_base"]["fingerprint"]) == {"model.safetensors"}
    assert f"init_from: {base.resolve()}" in (ckpt / "config.yaml").read_text()   # recorded absolute


def test_interrupted_lora_run_resumes_exactly(toy_dir, tmp_path):
    base = make_base(tiny_overrides(toy_dir), tmp_path / "base")
    common = lora_overrides(toy_dir, base, **{"train.max_steps": 6, "train.batch_size": 8,
                                              "train.deterministic": True})
    straight, split = tmp_path / "straight", tmp_path / "split"
    Trainer(load_config("tiny", common), straight).fit()
    Trainer(load_config("tiny", common + ["train.max_steps=3"]), split).fit()
    Trainer(load_config("tiny", common + ["resume=auto"]), split).fit()
    assert losses(split) == losses(straight)   # bitwise
    for stem in ("model", "ema"):
        a = load_file(straight / f"checkpoints/step-0000006/{stem}.safetensors")
        b = load_file(split / f"checkpoints/step-0000006/{stem}.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sampling_applies_the_adapters_to_their_base_and_the_merged_export_matches(toy_dir, tmp_path):
    base = make_base(tiny_overrides(toy_dir), tmp_path / "base")
    run = tmp_path / "run"
    assert main(["train", "--out", str(run), *lora_overrides(toy_dir, base)]) == 0
    adapted = Pipeline(run)                      # the run folder: its newest checkpoint, EMA adapters
    assert adapted.weights == "ema"
    layer = adapted.model.spatial_blocks[0].attn.q
    assert hasattr(layer, "lora_A") and layer.lora_B["default"].weight.abs().sum() > 0
    plain = load_pretrained(base)
    with torch.no_grad():
        assert not torch.equal(layer(torch.ones(1, 32)), plain.spatial_blocks[0].attn.q(torch.ones(1, 32)))
        torch.testing.assert_close(layer.base_layer.weight, plain.spatial_blocks[0].attn.q.weight)

    out = tmp_path / "merged"
    assert main(["ckpt", "export", str(run), str(out), "--merge-lora", "--ema"]) == 0
    record = json.loads((out / "export.json").read_text())
    assert record["merged_lora"]["base"] == str(base.resolve()) and record["merged_lora"]["rank"] == 4
    merged = Pipeline(out)
    assert merged.cfg.lora.rank == 0 and not any(is_adapter_name(n) for n in merged.model.state_dict())
    x = torch.randn(2, 3, 4, 16, 16)
    inputs = (x, torch.tensor([0.3, 0.8]), torch.randn(2, 8, 64), torch.ones(2, 8, dtype=torch.bool))
    with torch.no_grad():
        torch.testing.assert_close(merged.model(*inputs), adapted.model(*inputs), rtol=1e-5, atol=1e-5)
    weights, taken = init_weights(run)            # model.init_from=RUN: the merged weights
    assert "adapters of" in taken and "merged into their base" in taken
    exported = load_file(out / "model.safetensors")
    assert weights.keys() == exported.keys() and all(torch.equal(weights[k], exported[k]) for k in weights)
    prompts = ["a red circle moving right", "a blue square moving up"]
    clips_a = adapted(prompts, steps=4, seed=3)
    clips_m = merged(prompts, steps=4, seed=3)
    assert clips_a.shape == clips_m.shape
    assert (clips_a.astype(int) - clips_m.astype(int)).__abs__().max() <= 1   # float rounding at most


def test_lora_needs_a_base_and_real_targets(toy_dir, tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path / "a"), *tiny_overrides(toy_dir, **{"lora.rank": 4})]) == 2
    assert "lora.rank=4 trains adapters on frozen base weights: set model.init_from" in capsys.readouterr().err
    base = make_base(tiny_overrides(toy_dir), tmp_path / "base")
    assert main(["train", "--out", str(tmp_path / "b"),
                 *lora_overrides(toy_dir, base, **{"lora.targets": "[attn.qkv]"})]) == 2
    err = capsys.readouterr().err.strip()
    assert "lora.targets: 'attn.qkv' is not a Linear layer" in err and "attn.q" in err and "\n" not in err
    run = tmp_path / "c"
    assert main(["train", "--out", str(run), *lora_overrides(toy_dir, base, **{"train.max_steps": 1})]) == 0
    assert main(["ckpt", "export", str(run), str(tmp_path / "x")]) == 2
    assert "is a LoRA checkpoint (adapters only): pass --merge-lora" in capsys.readouterr().err
    make_base(tiny_overrides(toy_dir), tmp_path / "base", seed=1)          # the base changed since
    with pytest.raises(Exception, match="is not the one the adapters were trained on"):
        Pipeline(run)


RANK_33 = ("lora.rank=33 is more than spatial_blocks.0.attn.q can take (in 32, out 32 features; the narrowest adapted "
           "layer): give lora.rank <= 32, or leave that layer out of lora.targets")
ALPHA_0 = ("lora.alpha=0.0 is too small; it must be > 0.0 (adapter outputs are scaled by alpha/rank: 0 trains adapters "
           "that change nothing; leave it unset for alpha = rank)")   # refused by the config, before any model


@pytest.mark.parametrize("setting, error", [({"lora.rank": 33}, RANK_33), ({"lora.alpha": 0}, ALPHA_0)],
                         ids=["rank-above-the-layers", "alpha-0"])
@pytest.mark.parametrize("command", ["train", "plan"])
def test_lora_settings_the_model_cannot_take_are_one_line_before_anything_is_written(toy_dir, tmp_path, capsys,
                                                                                      command, setting, error):
    base = make_base(tiny_overrides(toy_dir), tmp_path / "base")   # hidden 32: every adapted layer is >= 32 wide
    overrides = lora_overrides(toy_dir, base, **setting)
    argv = {"train": ["train", "--out", str(tmp_path / "run"), *overrides],
            "plan": ["plan", "tiny", "--gpu-mem", "80GiB", *overrides]}[command]
    capsys.readouterr()
    assert main(argv) == 2
    assert capsys.readouterr().err == f"error: {error}\n"
    assert not (tmp_path / "run").exists()


def test_bf16_lora_with_checkpointing_keeps_the_base_in_bf16(toy_dir, tmp_path):
    base = make_base(tiny_overrides(toy_dir), tmp_path / "base")
    overrides = lora_overrides(toy_dir, base, **{"train.precision": "bf16", "memory.checkpointing": "full",
                                                  "lora.targets": "[attn.q, attn.v, cross_attn.q, mlp.fc1]",
                                                  "lora.dropout": 0.1, "lora.alpha": 8})
    trainer = Trainer(load_config("tiny", overrides), tmp_path / "run")
    batches = trainer.batches()
    for _ in range(2):
        loss, grad_norm = trainer.train_step([next(batches)])
        assert loss == loss and grad_norm > 0
    trainer.parallel.forward_backward(*trainer.prepare(next(batches)), scale=1.0, sync=True)
    for name, p in trainer.model.named_parameters():
        assert p.dtype == (torch.float32 if is_adapter_name(name) else torch.bfloat16), name
        assert (p.grad is not None) == is_adapter_name(name), name
    states = [v for state in trainer.optimizer.state.values() for v in state.values() if v.dim() > 0]
    assert states and all(v.dtype == torch.float32 for v in states)
    assert sum(v.numel() for v in states) == 2 * sum(p.numel() for p in trainer.optimizer.param_groups[0]["params"])
    assert trainer.model.spatial_blocks[0].cross_attn.q.scaling["default"] == 2.0   # alpha / rank


def checkpoint_bytes(run) -> int:
    ckpt = LoadedCheckpoint(run)
    return sum(info["bytes"] for info in ckpt.manifest["files"].values())


def test_lora_checkpoint_is_under_a_tenth_of_a_full_one_for_the_tiny_preset(toy_dir, tmp_path):
    preset = [o for o in tiny_overrides(toy_dir, **{"train.max_steps": 1, "train.batch_size": 2})
              if not o.startswith(("model.depth", "model.hidden_size", "model.num_heads", "model.patch_size"))]
    full = tmp_path / "full"
    assert main(["train", "--out", str(full), *preset]) == 0
    lora = tmp_path / "lora"
    assert main(["train", "--out", str(lora), *preset, "lora.rank=8", f"model.init_from={full}"]) == 0
    ratio = checkpoint_bytes(lora) / checkpoint_bytes(full)
    assert ratio <= 0.10, ratio
    merged = export(lora, tmp_path / "merged", merge_lora=True)
    assert load_file(merged / "model.safetensors").keys() == load_file(full / "checkpoints/step-0000001/"
                                                                             "model.safetensors").keys()


# ---------------------------------------------------------------- the base's whole-content fingerprint

import os                                  # noqa: E402

import videodit.checkpoint.lora as lora_module   # noqa: E402
import videodit.train.trainer as trainer_module  # noqa: E402

GEOMETRY = ("model.depth", "model.hidden_size", "model.num_heads", "model.patch_size")


def preset_overrides(toy_dir, **extra):
    """The tiny preset's own model: its weights (~9.6 MB) are longer than the 4 MiB at each end that
    the old sampled fingerprint read."""
    return [o for o in tiny_overrides(toy_dir, **{"train.max_steps": 1, "train.batch_size": 2, **extra})
            if not o.startswith(GEOMETRY)]


def change_the_middle(file):
    """Flip one bit in the middle of ``file``: same size, mtime set back (ctime moves on)."""
    st = file.stat()
    with open(file, "r+b") as handle:
        handle.seek(st.st_size // 2)
        byte = handle.read(1)[0]
        handle.seek(st.st_size // 2)
        handle.write(bytes([byte ^ 1]))
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert file.stat().st_size == st.st_size and file.stat().st_mtime_ns == st.st_mtime_ns


@pytest.fixture
def preset_lora_run(toy_dir, tmp_path):
    """A LoRA run (one step) on an exported model folder of the tiny preset's size."""
    preset = preset_overrides(toy_dir)
    base = make_base(preset, tmp_path / "base")
    overrides = [*preset, "lora.rank=4", f"model.init_from={base}"]
    run = tmp_path / "run"
    assert main(["train", "--out", str(run), *overrides]) == 0
    return base, run, overrides


def test_unchanged_exported_base_resumes_and_its_whole_sha256_is_recorded(preset_lora_run):
    base, run, overrides = preset_lora_run
    assert main(["train", "--out", str(run), *overrides, "train.max_steps=2", "resume=auto"]) == 0
    record = json.loads((run / "checkpoints/step-0000002/state.json").read_text())["lora_base"]
    assert record["fingerprint"] == {"model.safetensors": lora_module._sha256_file(base / "model.safetensors")}


@pytest.mark.parametrize("command", ["resume", "sample", "export"])
def test_a_base_changed_in_the_middle_is_refused(preset_lora_run, tmp_path, capsys, command):
    base, run, overrides = preset_lora_run
    weights = base / "model.safetensors"
    sampled = lora_module._sampled(weights)
    assert weights.stat().st_size > 2 * lora_module._SAMPLE
    change_the_middle(weights)
    assert lora_module._sampled(weights) == sampled            # the old fingerprint would not see it
    capsys.readouterr()
    argv = {"resume": ["train", "--out", str(run), *overrides, "train.max_steps=2", "resume=auto"],
            "sample": ["sample", "--ckpt", str(run), "--prompt", "x", "--steps", "2", "--out", str(tmp_path / "c.gif")],
            "export": ["ckpt", "export", str(run), str(tmp_path / "merged"), "--merge-lora"]}[command]
    before = folder_state(run)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "is not the one the adapters were trained on" in err and "\n" not in err, err
    assert folder_state(run) == before   # a refused resume writes nothing: no .lock, no config.yaml, no samples
    assert not (tmp_path / "merged").exists() and not (tmp_path / "c.gif").exists()


def test_a_resume_refused_after_the_folder_was_taken_writes_nothing(toy_dir, tmp_path, capsys):
    """The data position is checked when the checkpoint is loaded, after the run folder's lock was
    taken: a refusal there gives the lock back (it used to stay behind as OUT/.lock)."""
    toy = shutil.copytree(toy_dir, tmp_path / "toy")
    base = make_base(tiny_overrides(toy_dir), tmp_path / "base")
    overrides = lora_overrides(toy, base, **{"train.max_steps": 1})
    run = tmp_path / "run"
    assert main(["train", "--out", str(run), *overrides]) == 0
    rows = (toy / "train.csv").read_text().splitlines(keepends=True)
    (toy / "train.csv").write_text("".join(rows[:-1]))                      # one clip fewer
    before = folder_state(run)
    capsys.readouterr()
    assert main(["train", "--out", str(run), *overrides, "train.max_steps=2", "resume=auto"]) == 2
    assert capsys.readouterr().err.startswith("error: the dataset or bucket config changed since the checkpoint")
    assert folder_state(run) == before


def folder_state(folder) -> dict:
    """Every file and folder under ``folder`` (hidden ones too) with its SHA-256 (None: a folder)."""
    return {str(p.relative_to(folder)): None if p.is_dir() else lora_module._sha256_file(p)
            for p in sorted(folder.rglob("*"))}


def test_an_unchanged_base_is_not_read_again_by_its_stat_key(toy_dir, tmp_path, monkeypatch):
    base = make_base(tiny_overrides(toy_dir), tmp_path / "base")
    weights = base / "model.safetensors"
    monkeypatch.setattr(lora_module, "_RACY_NS", -10**18)   # the file was just written: trust its key at once
    record = lora_module.base_record(base)
    assert set(record["stat"]) == {"model.safetensors"}
    reads = []
    real = lora_module._sha256_file
    monkeypatch.setattr(lora_module, "_sha256_file", lambda file: reads.append(file) or real(file))
    monkeypatch.setattr(lora_module, "_HASHED", {})          # a new process
    assert lora_module.check_base(record) == str(base.resolve()) and reads == []
    change_the_middle(weights)                               # ctime moved: read in full, and refused
    with pytest.raises(Exception, match="is not the one the adapters were trained on"):
        lora_module.check_base(record)
    assert reads == [weights.resolve()]
    monkeypatch.setattr(lora_module, "_RACY_NS", 3 * 10**9)
    monkeypatch.setattr(lora_module, "_HASHED", {})
    assert "stat" not in lora_module.base_record(base)        # just written (racy): its key is never trusted


def test_a_run_recorded_with_the_old_sampled_fingerprint_still_resumes(toy_dir, tmp_path, monkeypatch, capsys):
    base = make_base(tiny_overrides(toy_dir), tmp_path / "base")

    def old_run_base(cfg):                                   # what videodit wrote before whole-file hashes
        path = base.resolve()
        weights = path / "model.safetensors"
        return {"path": str(path), "fingerprint": {"model.safetensors": lora_module._sampled(weights)}}

    overrides = lora_overrides(toy_dir, base, **{"train.max_steps": 1})
    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(trainer_module, "run_base", old_run_base)
        assert main(["train", "--out", str(run), *overrides]) == 0
    old = json.loads((run / "checkpoints/step-0000001/state.json").read_text())["lora_base"]["fingerprint"]
    assert lora_module._SAMPLED_KIND.fullmatch(old["model.safetensors"])
    capsys.readouterr()
    assert main(["train", "--out", str(run), *overrides, "train.max_steps=2", "resume=auto"]) == 0
    assert "checked that way" in capsys.readouterr().err      # compared the old way, with a warning
    new = json.loads((run / "checkpoints/step-0000002/state.json").read_text())["lora_base"]["fingerprint"]
    assert new == {"model.safetensors": lora_module._sha256_file(base / "model.safetensors")}   # re-recorded
    make_base(tiny_overrides(toy_dir), base, seed=1)          # the old kind still refuses what it can see
    with pytest.raises(Exception, match="is not the one the adapters were trained on"):
        lora_module.check_base({"path": str(base.resolve()), "fingerprint": old})
