"""The trajectory cache (``videodit distill trajectories``, ``distill.trajectories``): what it
stores, that a cached step is the online step bit for bit, exact resume of a run reading it,
checksums, a killed build resumed, a cache for another config refused, and a 2-rank build equal to
one process. Six clips of the toy set keep every build to about a second."""

import dataclasses
import shutil

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from conftest import damage_shard, dmd2_overrides, torchrun
from videodit.cli import main
from videodit.config import load_config
from videodit.distill.trajectory_cache import item_noise, read_manifest
from videodit.errors import UserError
from videodit.train import trajectory_build
from videodit.train.trainer import Trainer

CLIPS, SHARD = 6, 2   # 3 shards


@pytest.fixture(autouse=True)
def _threads_restored():
    """A build applies ``train.threads`` (1 here, as under torchrun) to the process, as the trainer does."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def clips(toy_dir, tmp_path_factory):
    """The first clips of the toy set, their paths made absolute."""
    lines = (toy_dir / "train.csv").read_text().splitlines()
    csv = tmp_path_factory.mktemp("clips") / "train.csv"
    csv.write_text("\n".join([lines[0]] + [f"{toy_dir}/{line}" for line in lines[1 : CLIPS + 1]]) + "\n")
    return csv


def overrides(toy_dir, clips, teacher, **extra) -> list[str]:
    return dmd2_overrides(toy_dir, teacher, **{"distill.method": "trajectory", "distill.teacher_substeps": 2,
                                               "data.csv": str(clips), "train.threads": 1, **extra})


def build(args: list[str], out) -> int:
    return main(["distill", "trajectories", "tiny", *args, "--out", str(out), "--shard-size", str(SHARD)])


def files(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def built(toy_dir, clips, dmd2_teacher, tmp_path_factory):
    out = tmp_path_factory.mktemp("trajectories") / "t"
    assert build(overrides(toy_dir, clips, dmd2_teacher), out) == 0
    return out


def test_every_item_holds_its_seeded_noise_its_states_and_its_caption(built):
    manifest = read_manifest(built)
    assert manifest["items"] == CLIPS and manifest["shards"] == 3 and len(manifest["depends"]["sigmas"]) == 2
    index = pq.read_table(built / "index.parquet").to_pylist()
    first = load_file(str(built / "shards" / "shard-00000.safetensors"))
    assert sorted(first) == ["0.state0", "0.state1", "0.text", "0.x0", "1.state0", "1.state1", "1.text", "1.x0"]
    assert torch.equal(first["0.state0"], item_noise([3, 4, 16, 16], index[0]["noise_seed"])[0])   # state 0: the noise
    assert first["0.text"].shape == (index[0]["text_len"], 64) and index[0]["caption"] == "a red circle moving right"


def test_a_cached_step_is_the_online_step_for_the_same_item(toy_dir, clips, dmd2_teacher, built, tmp_path):
    """One item per step (the teacher ran it alone in the build): the same noise, captions and
    conditions give the same loss and gradient norm bit for bit, in fp32."""
    args = overrides(toy_dir, clips, dmd2_teacher, **{"train.batch_size": 1})
    cached = Trainer(load_config("tiny", args + [f"distill.trajectories={built}"]), tmp_path / "cached")
    online = Trainer(load_config("tiny", args), tmp_path / "online")
    batch = next(cached.batches())
    (item,) = cached.distill.items_of(batch)
    row = pq.read_table(built / "index.parquet").to_pylist()[item]
    # The online step on a batch of that clip, whose noise seed is the item's: it draws the item's noise.
    same = dataclasses.replace(next(online.batches()), text=[row["caption"]], noise_seed=row["noise_seed"],
                               fps=torch.tensor([row["fps"]], dtype=torch.float32))
    assert cached.distill.teacher is None   # the cached run never calls it
    assert cached.train_step([batch]) == online.train_step([same])


def test_a_resumed_run_draws_what_the_first_would(toy_dir, clips, dmd2_teacher, built, tmp_path):
    args = overrides(toy_dir, clips, dmd2_teacher, **{"distill.trajectories": str(built), "train.batch_size": 2})
    Trainer(load_config("tiny", args + ["train.max_steps=2"]), tmp_path / "straight").fit()
    Trainer(load_config("tiny", args + ["train.max_steps=1"]), tmp_path / "split").fit()
    Trainer(load_config("tiny", args + ["train.max_steps=2", "resume=auto"]), tmp_path / "split").fit()
    a, b = (load_file(str(tmp_path / run / "checkpoints" / "step-0000002" / "model.safetensors"))
            for run in ("straight", "split"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_flipped_byte_is_refused_in_one_line_and_the_build_repairs_it(toy_dir, clips, dmd2_teacher, built,
                                                                      tmp_path, capsys):
    damaged = tmp_path / "damaged"
    shutil.copytree(built, damaged)
    for shard in range(3):   # whichever the first step draws
        damage_shard(damaged, "flipped", shard)
    args = overrides(toy_dir, clips, dmd2_teacher)
    assert main(["train", "--out", str(tmp_path / "run"), *args, f"distill.trajectories={damaged}"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: trajectory cache shard") and "is damaged (its SHA-256" in last
    assert build(args, damaged) == 0   # every shard checked, the damaged ones computed again
    assert "3 damaged shard(s) removed" in capsys.readouterr().out
    assert files(damaged) == files(built)


def test_a_killed_build_redoes_only_the_missing_shards(toy_dir, clips, dmd2_teacher, built, tmp_path, monkeypatch):
    real, written = trajectory_build.write_shard, []

    def killed_on_the_second(folder, shard, tensors, rows):
        if written:   # the kill lands while the second shard's tensors are being written
            (folder / "shards" / f".shard-{shard:05d}.safetensors.tmp-1234").write_bytes(b"partial")
            raise KeyboardInterrupt
        real(folder, shard, tensors, rows)
        written.append(shard)

    args, out = overrides(toy_dir, clips, dmd2_teacher), tmp_path / "t"
    monkeypatch.setattr(trajectory_build, "write_shard", killed_on_the_second)
    assert build(args, out) == 130   # the command's status when interrupted
    assert written == [0] and not (out / "index.parquet").exists()
    with pytest.raises(UserError, match="is not complete .1 of 3 shards"):
        Trainer(load_config("tiny", args + [f"distill.trajectories={out}"]), tmp_path / "run")
    redone = []
    monkeypatch.setattr(trajectory_build, "write_shard", lambda *a: (redone.append(a[1]), real(*a)))
    assert build(args, out) == 0
    assert redone == [1, 2]
    assert files(out) == files(built)   # byte for byte, the leftover gone


@pytest.fixture(scope="module")
def other_teacher(dmd2_teacher, tmp_path_factory):
    """The teacher with one weight changed: the same architecture, other trajectories."""
    from videodit.checkpoint.tools import write_model_folder

    weights = load_file(str(dmd2_teacher / "model.safetensors"))
    name = sorted(weights)[0]
    weights[name] = weights[name] + 1e-3
    out = tmp_path_factory.mktemp("other") / "teacher"
    return write_model_folder(out, weights, {"config.json": (dmd2_teacher / "config.json").read_text()})


@pytest.mark.parametrize("extra, words", [
    ({"distill.teacher_cfg": 2.0}, "teacher guidance (distill.teacher_cfg)"),
    ({"distill.teacher_substeps": 3}, "teacher substeps"),
    ({"distill.steps": "[1000,250]"}, "student sigmas (distill.steps, distill.shift)"),
    ({"sample.negative_prompt": "blurry"}, "negative prompt"),
    ({"vae.scaling_factor": 0.5}, "VAE (latent space) (vae.*)"),
    ({"diffusion.prediction": "velocity"}, "model output (diffusion.prediction)"),
    ({"teacher": True}, "teacher (distill.teacher"),
])
def test_a_cache_for_another_config_is_refused_in_one_line(toy_dir, clips, dmd2_teacher, other_teacher, built,
                                                           tmp_path, capsys, extra, words):
    teacher = other_teacher if extra.pop("teacher", False) else dmd2_teacher
    args = overrides(toy_dir, clips, teacher, **extra)
    with pytest.raises(UserError, match="computed with another") as refused:
        Trainer(load_config("tiny", args + [f"distill.trajectories={built}"]), tmp_path / "run")
    message = str(refused.value)
    assert words in message and "\n" not in message and "videodit distill trajectories" in message
    # Building into that folder with this config is refused too, and changes nothing there.
    before = files(built)
    assert build(args, built) == 2
    assert "holds trajectories of another build" in capsys.readouterr().err
    assert files(built) == before


def test_only_a_trajectory_run_has_trajectories_to_compute(toy_dir, clips, dmd2_teacher, tmp_path, capsys):
    args = overrides(toy_dir, clips, dmd2_teacher, **{"distill.method": "dmd2"})
    assert build(args, tmp_path / "t") == 2
    assert "set distill.method=trajectory" in capsys.readouterr().err and not (tmp_path / "t").exists()


def test_a_two_rank_build_equals_one_process(toy_dir, clips, dmd2_teacher, built, tmp_path):
    args = overrides(toy_dir, clips, dmd2_teacher)
    done = torchrun(2, "-m", "videodit", "distill", "trajectories", "tiny", *args, "--out", str(tmp_path / "two"),
                    "--shard-size", str(SHARD))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 1: computed 2 trajectories" in done.stdout + done.stderr   # shard 1 of 0, 1, 2
    assert files(tmp_path / "two") == files(built)
