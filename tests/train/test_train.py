"""End-to-end training on a tiny model: outputs, resume, and the CLI's error paths."""

import json

import pytest
from safetensors.torch import load_file

from conftest import tiny_overrides
from videodit.cli import main
from videodit.config import load_config
from videodit.train.trainer import Trainer


def losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_train_writes_the_run_folder(toy_dir, tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--out", str(run), *tiny_overrides(toy_dir)]) == 0
    assert (run / "config.yaml").is_file() and (run / "run_info.json").is_file()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert {"step", "epoch", "loss", "lr", "grad_norm", "samples_per_s", "data_wait"} <= records[0].keys()
    assert all(0 <= r["data_wait"] <= 1 for r in records)   # share of the time the loop waited for a batch
    assert records[0]["data_wait"] > 0                      # step 1 waited for the first batch to be decoded
    assert any((run / "tensorboard").iterdir())
    ckpt = run / "checkpoints" / "step-0000004"
    assert set(load_file(str(ckpt / "model.safetensors"))) == set(load_file(str(ckpt / "ema.safetensors")))
    assert list((run / "samples" / "step-0000004").glob("*.mp4"))
    # Sampling from the run folder picks the newest checkpoint.
    out = tmp_path / "clip.gif"
    assert main(["sample", "--ckpt", str(run), "--prompt", "a blue square moving up", "--steps", "2",
                 "--out", str(out)]) == 0
    assert out.stat().st_size > 0


def test_resumed_run_continues_with_the_same_losses(toy_dir, tmp_path):
    common = tiny_overrides(toy_dir, **{"train.max_steps": 6, "train.batch_size": 8,
                                        "train.deterministic": True})
    straight = tmp_path / "straight"
    Trainer(load_config("tiny", common), straight).fit()

    # 3 steps, stop, then resume from that checkpoint for the remaining 3. The epoch has
    # 6 batches of 8 among 54 clips, so the resume lands mid-epoch.
    split = tmp_path / "split"
    Trainer(load_config("tiny", common + ["train.max_steps=3"]), split).fit()
    Trainer(load_config("tiny", common + ["resume=auto"]), split).fit()

    assert losses(split) == losses(straight)          # bitwise: same data, noise and updates
    a = load_file(str(straight / "checkpoints/step-0000006/model.safetensors"))
    b = load_file(str(split / "checkpoints/step-0000006/model.safetensors"))
    assert all((a[k] == b[k]).all() for k in a)
    ema_a = load_file(str(straight / "checkpoints/step-0000006/ema.safetensors"))
    ema_b = load_file(str(split / "checkpoints/step-0000006/ema.safetensors"))
    assert all((ema_a[k] == ema_b[k]).all() for k in ema_a)


def test_gradient_accumulation_and_checkpointing_run(toy_dir, tmp_path):
    run = tmp_path / "run"
    overrides = tiny_overrides(toy_dir, **{"train.grad_accum": 2, "memory.checkpointing": "full",
                                           "train.max_steps": 2, "train.sample_every": 1})
    assert main(["train", "--out", str(run), *overrides]) == 0
    assert len(losses(run)) == 2
    assert (run / "samples" / "step-0000001").is_dir()


# Every family, two blocks (MMDiT: a double and a single one); LTX-2 on 8x8 clips at patch 1.
CHECKPOINT_FAMILIES = {"stdit": {}, "wan": {"model.preset": "wan-tiny", "model.depth": 2},
                       "mmdit": {"model.preset": "mmdit-tiny", "model.hidden_size": 64, "model.patch_size": "[1,2,2]",
                                 "text.dim": 32, "model.depth": 1, "model.depth_single": 1},
                       "ltx2": {"model.preset": "ltx2-tiny", "model.depth": 2, "model.patch_size": "[1,1,1]",
                                "text.dim": 32, "data.height": 8, "data.width": 8,
                                "diffusion.prediction": "velocity", "diffusion.loss_space": "velocity"}}


@pytest.mark.parametrize("family", list(CHECKPOINT_FAMILIES))
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_gives_the_same_gradients(toy_dir, tmp_path, mode, family):
    """Checkpointing (full, or selective: matmul and attention outputs kept, the rest recomputed)
    gives the loss and every gradient of no checkpointing bit for bit, in every family."""
    import torch

    def grads(ac):
        cfg = load_config("tiny", tiny_overrides(toy_dir, **{"memory.checkpointing": mode if ac else "none",
                                                            "train.seed": 1, **CHECKPOINT_FAMILIES[family]}))
        trainer = Trainer(cfg, tmp_path / f"ac{ac}")
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():   # no zero-initialised layer (output projections, gates): every gradient flows
            for param in trainer.model.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)
        batch = next(trainer.batches())
        loss = trainer.loss(batch)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}

    (plain_loss, plain), (checkpointed_loss, checkpointed) = grads(False), grads(True)
    assert torch.equal(plain_loss, checkpointed_loss)
    assert plain.keys() == checkpointed.keys() and len(plain) > 0
    assert all(torch.equal(plain[n], checkpointed[n]) for n in plain), \
        [n for n in plain if not torch.equal(plain[n], checkpointed[n])]


def test_existing_run_is_not_overwritten(toy_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--out", str(run), *tiny_overrides(toy_dir, **{"train.max_steps": 1})]) == 0
    before = (run / "metrics.jsonl").read_text()
    assert main(["train", "--out", str(run), *tiny_overrides(toy_dir, **{"train.max_steps": 1})]) == 2
    assert "already holds checkpoints; pass resume=auto" in capsys.readouterr().err
    assert (run / "metrics.jsonl").read_text() == before


@pytest.mark.parametrize("args, message", [
    (["train", "train.max_steps=-1"], "train.max_steps=-1 is too small"),
    (["train", "modle.depth=2"], "unknown config key modle"),
    (["train", "data.csv=/nonexistent/meta.csv"], "does not exist; set data.csv"),
    (["sample", "--ckpt", "{tmp}", "--prompt", "x"], "is neither a checkpoint"),
    (["sample", "--ckpt", "{tmp}", "--prompts", "{tmp}/none.txt"], "prompt file"),
    (["toy", "eval", "--ckpt", "{tmp}"], "is neither a checkpoint"),
])
def test_cli_errors_are_one_line(args, message, tmp_path, capsys):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
    assert not (tmp_path / "runs").exists()


def test_csv_missing_columns_is_a_clear_error(tmp_path, capsys):
    csv = tmp_path / "meta.csv"
    csv.write_text("path,text,height\nclip.mp4,a red circle moving left,32\n")
    assert main(["train", "--out", str(tmp_path / "run"), f"data.csv={csv}"]) == 2
    err = capsys.readouterr().err
    assert "missing column(s) num_frames, width, aspect_ratio, fps" in err
    assert not (tmp_path / "run").exists()


def test_resume_after_a_config_change_says_what_changed(toy_dir, tmp_path, capsys):
    run = tmp_path / "run"
    base = tiny_overrides(toy_dir, **{"train.max_steps": 2})
    assert main(["train", "--out", str(run), *base]) == 0
    changed = base + ["train.lr=0.01", "train.max_steps=3", "resume=auto"]
    assert main(["train", "--out", str(run), *changed]) == 2
    err = capsys.readouterr().err
    assert "train.lr: 0.001 -> 0.01" in err and "checkpoint.on_config_change=continue" in err
    assert not (run / "checkpoints" / "step-0000003").exists()
    assert main(["train", "--out", str(run), *changed, "checkpoint.on_config_change=continue"]) == 0
    assert "config changed since the checkpoint: train.lr" in capsys.readouterr().out
    assert (run / "checkpoints" / "step-0000003").is_dir()


def test_validation_loss_is_fixed_and_ranks_checkpoints(toy_dir, tmp_path):
    import torch

    overrides = tiny_overrides(toy_dir, **{"validation.csv": str(toy_dir / "val.csv"), "train.max_steps": 4,
                                           "checkpoint.every_steps": 2, "checkpoint.keep_best": 1,
                                           "checkpoint.save_total_limit": 1})
    trainer = Trainer(load_config("tiny", overrides), tmp_path / "run")
    first = trainer.validator.evaluate(trainer.model, trainer.vae, trainer.text, trainer.flow, trainer.parallel.autocast)
    again = trainer.validator.evaluate(trainer.model, trainer.vae, trainer.text, trainer.flow, trainer.parallel.autocast)
    assert first == again and "val_loss" in first and any(k.startswith("val_loss/4x16x16") for k in first)
    assert torch.is_grad_enabled()
    trainer.fit()
    lines = [json.loads(line) for line in (tmp_path / "run" / "checkpoints.jsonl").read_text().splitlines()]
    saves = [line for line in lines if line["event"] == "save"]
    assert [s["step"] for s in saves] == [2, 4] and all("val_loss" in s["metrics"] for s in saves)


def test_every_logged_step_reports_tflops_and_mfu_where_a_peak_is_known(toy_dir, tmp_path):
    from videodit.models.flops import train_step_flops
    from videodit.train.metrics import peak_tflops

    plain, with_peak = tmp_path / "plain", tmp_path / "peak"
    assert main(["train", "--out", str(plain), *tiny_overrides(toy_dir)]) == 0
    assert main(["train", "--out", str(with_peak), *tiny_overrides(toy_dir, **{"train.peak_tflops": 0.5})]) == 0
    records = [json.loads(line) for line in (plain / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(r["tflops"] > 0 and "mfu" not in r for r in records)   # CPU: no peak
    records = [json.loads(line) for line in (with_peak / "metrics.jsonl").read_text().splitlines()]
    assert all(r["mfu"] == pytest.approx(r["tflops"] / 0.5, abs=1e-3) for r in records)
    # TensorBoard shows both, at every logged step.
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    steps = {}
    for events in (with_peak / "tensorboard").iterdir():
        for event in EventFileLoader(str(events)).Load():
            for value in event.summary.value:
                steps.setdefault(value.tag, []).append(event.step)
    assert steps["train/tflops"] == steps["train/mfu"] == [1, 2, 3, 4]

    # The rate is the FLOP model's count of the samples seen over the time they took.
    cfg = load_config("tiny", tiny_overrides(toy_dir))
    trainer = Trainer(cfg, tmp_path / "count")
    batch = next(trainer.batches())
    frames, height, width = batch.video.shape[-3:]
    expected = train_step_flops(trainer.model.geometry, len(batch), frames, height, width, cfg.text.max_length)
    assert trainer.model_flops(batch) == expected.model
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0 and peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA GeForce RTX 4090") == 165.2 and peak_tflops(None) is None
