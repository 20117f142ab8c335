import os
import subprocess
import sys

import pytest
import torch

from videodit.toy.encoder import ToyTextEncoder

# Tests run offline and small: two threads (or OMP_NUM_THREADS where it is set: the suite must
# pass with one thread as well), no hub access.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 2))


@pytest.fixture(autouse=True)
def _decoder_of_the_process_restored():
    """Training makes its resolved ``data.decoder`` the process's (``use_decoder``): one test's
    choice (torchcodec where it loads) must not decide how later tests read videos."""
    from videodit.data import decoder_choice
    before = decoder_choice.current_decoder()
    yield
    decoder_choice.use_decoder(before)


@pytest.fixture(scope="module")
def no_network():
    """HF offline mode plus a socket guard: any network attempt fails the test loudly."""
    import socket

    def refuse(*args, **kwargs):
        raise RuntimeError("network access attempted during an offline test")

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        mp.setattr(socket.socket, "connect", refuse)
        mp.setattr(socket, "create_connection", refuse)
        yield


@pytest.fixture(scope="session")
def toy_dir(tmp_path_factory):
    """A small toy dataset: one 8-frame 16x16 clip per seen combination."""
    from videodit.toy.make import make_toy_dataset

    out = tmp_path_factory.mktemp("toy")
    make_toy_dataset(out, clips_per_combination=1, num_frames=8, height=16, width=16, seed=0)
    return out


@pytest.fixture(scope="session")
def mixed_toy(tmp_path_factory):
    """Clips of two sizes (16x16, 24x24) plus still images: bucketed batches change shape."""
    from videodit.toy.make import make_toy_dataset

    out = tmp_path_factory.mktemp("mixed")
    make_toy_dataset(out, clips_per_combination=1, num_frames=8, sizes=[(16, 16), (24, 24)],
                     image_fraction=0.3, seed=1)
    return out


def tiny_overrides(toy_dir, **extra) -> list[str]:
    """Overrides for a model and run small enough for a unit test."""
    values = {
        "data.csv": str(toy_dir / "train.csv"), "data.num_frames": 4, "data.height": 16, "data.width": 16,
        "data.make_toy_if_missing": False, "data.frame_interval": 1,
        "model.depth": 1, "model.hidden_size": 32, "model.num_heads": 2, "model.patch_size": "[1,4,4]",
        "train.batch_size": 4, "train.max_steps": 4, "train.log_every": 1, "train.warmup_steps": 2,
        "train.threads": 0, "checkpoint.every_steps": 0, "sample.steps": 2,
        "sample.prompts": "['a red circle moving right']",
        "diffusion.shift_base_pixels": 256, "diffusion.shift_base_frames": 4, "validation.csv": "null",
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


@pytest.fixture(scope="session")
def dmd2_teacher(toy_dir, tmp_path_factory):
    """A tiny model to distil, as a model folder (``model.safetensors``)."""
    return random_model_folder(tiny_overrides(toy_dir), tmp_path_factory.mktemp("teacher"))


def random_model(overrides: list[str]):
    """(config, spec, geometry, model) of ``overrides`` with random weights, nothing zero (a fresh
    DiT's zero output layer would make every sample the same grey)."""
    import torch

    from videodit.components import model_geometry
    from videodit.config import load_config
    from videodit.models.families import get_spec

    cfg = load_config("tiny", overrides)
    spec = get_spec(cfg.model.family)
    torch.manual_seed(0)
    geometry = model_geometry(cfg, 3, cfg.text.dim)
    model = spec.build(geometry)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return cfg, spec, geometry, model


def random_model_folder(overrides: list[str], folder):
    """:func:`random_model` as a model folder ``model.init_from`` reads."""
    import json

    from videodit.checkpoint.tools import write_model_folder

    _, spec, geometry, model = random_model(overrides)
    return write_model_folder(folder, model.state_dict(), {"config.json": json.dumps(spec.geometry_config(geometry))})


def dmd2_overrides(toy_dir, teacher, **extra) -> list[str]:
    """A tiny DMD2 run of ``teacher``: two student steps, the student on every 2nd step."""
    values = {"distill.method": "dmd2", "distill.teacher": str(teacher), "distill.generator_every": 2,
              "distill.steps": "[1000,500]", "train.lr": 1e-3, "train.deterministic": True,
              "train.warmup_steps": 1, **extra}
    return tiny_overrides(toy_dir, **values)


class TwoStreamText(ToyTextEncoder):
    """Stand-in for Gemma's two streams: the toy text encoder with an audio stream's text (its
    first 16 features), as LTX-2's ``encode_streams`` gives it; ``calls`` counts those calls."""
    calls = 0

    def encode_streams(self, captions):
        TwoStreamText.calls += 1
        y, mask = self.encode(captions)
        return y, y[..., :16], mask


def two_stream_encoders(build_encoders):
    """``build_encoders`` (the trainer's) with :class:`TwoStreamText` for the text encoder: an LTX-2
    run of ``model.train_audio`` on the toy text (``tests/train/test_ltx2_audio_train.py``). Set in
    place of ``videodit.train.trainer.build_encoders`` by a monkeypatch, or by a subprocess's own
    launcher (``tests/parallel/workers/ltx2_audio_train_worker.py``)."""
    def build(cfg, device):
        vae, _ = build_encoders(cfg, device)
        return vae, TwoStreamText(dim=cfg.text.dim, max_length=cfg.text.max_length)
    return build


def torchrun(nproc: int, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone`` with ``nproc`` CPU processes (gloo), one
    thread each; stdout and stderr captured."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def damage_shard(folder, how: str, shard: int = 0) -> None:
    """Damage a feature-cache shard in place: ``flipped`` flips a data byte; ``header`` edits its
    safetensors header to other valid shapes (the same bytes, so only the index can tell)."""
    import re
    from pathlib import Path

    path = Path(folder) / "shards" / f"shard-{shard:05d}.safetensors"
    data = bytearray(path.read_bytes())
    if how == "flipped":
        data[-100] ^= 0xFF
    else:
        n = int.from_bytes(data[:8], "little")
        header = data[8 : 8 + n].decode()
        m = re.search(r'"shape":\[(\d+),(\d+),(\d+),(\d+)\]', header)
        assert m.group(1) != m.group(4)   # reversed, the shape really changes
        header = header[: m.start()] + '"shape":[' + ",".join(reversed(m.groups())) + "]" + header[m.end():]
        data[8 : 8 + n] = header.encode()
    path.write_bytes(data)
