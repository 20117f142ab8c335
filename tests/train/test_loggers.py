"""train.loggers: the scalars and sample videos of a run in TensorBoard and in Weights & Biases
(offline, into the run folder), read back from their files; the W&B run holds the resolved config
and goes on after resume=auto; each sample prompt starts from its own fixed noise; bad logger
settings are one line before anything is built; a clip with a soundtrack has it in TensorBoard too."""

from __future__ import annotations

import io
import json
import socket
import struct
import sys
import wave
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image, ImageSequence

from conftest import tiny_overrides
from videodit.cli import main
from videodit.config import load_config
from videodit.data.video import read_video
from videodit.sample import generate, slug

PROMPTS = ["a red circle moving right", "a blue square moving up"]
TAGS = [f"samples/{i:02d}-{slug(prompt)}" for i, prompt in enumerate(PROMPTS)]
LOGGED = {"train.loggers": "[tensorboard,jsonl,wandb]", "train.sample_every": 2, "checkpoint.every_steps": 2,
          "sample.prompts": json.dumps(PROMPTS)}


@pytest.fixture(scope="module")
def offline_wandb(tmp_path_factory):
    """W&B offline with its own folders in a temporary one; this process may not reach the
    internet (W&B's local service socket is allowed)."""
    import wandb   # in the test extra: pip install -e ".[test]"

    home = tmp_path_factory.mktemp("wandb-home")
    connect = socket.socket.connect

    def local_only(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            raise RuntimeError(f"network access attempted during an offline test: {address}")
        return connect(sock, address)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
            mp.setenv(name, str(home / name.lower()))
        for name in ("WANDB_DIR", "WANDB_RUN_ID", "WANDB_PROJECT", "WANDB_RESUME"):
            mp.delenv(name, raising=False)
        mp.setattr(socket.socket, "connect", local_only)
        yield
        wandb.teardown()   # stop W&B's service process


@pytest.fixture(scope="module")
def logged_run(offline_wandb, toy_dir, tmp_path_factory):
    """4 steps with samples every 2, then resume=auto to step 6: samples at steps 2, 4 and 6."""
    run = tmp_path_factory.mktemp("logged") / "run"
    common = tiny_overrides(toy_dir, **LOGGED)
    assert main(["train", "--out", str(run), *common]) == 0
    assert main(["train", "--out", str(run), *common, "train.max_steps=6", "resume=auto"]) == 0
    return run


# ------------------------------------------------------------------ reading the logs back

@dataclass
class Logged:
    scalars: dict = field(default_factory=dict)    # tag -> {step: value}
    videos: dict = field(default_factory=dict)     # tag -> [(step, uint8 frames [T, H, W, 3])], in logged order
    captions: dict = field(default_factory=dict)   # tag -> prompt
    audios: dict = field(default_factory=dict)     # tag -> [(step, rate, int16 samples [channels, N])] (TensorBoard)


def tensorboard_log(run: Path) -> Logged:
    from tensorboard.backend.event_processing import event_accumulator as ea

    events = ea.EventAccumulator(str(run / "tensorboard"), size_guidance={ea.SCALARS: 0, ea.IMAGES: 0, ea.TENSORS: 0,
                                                                          ea.AUDIO: 0})
    events.Reload()
    tags = events.Tags()
    logged = Logged(scalars={tag: {e.step: e.value for e in events.Scalars(tag)} for tag in tags["scalars"]},
                    videos={tag: [(e.step, gif_frames(e.encoded_image_string)) for e in events.Images(tag)]
                            for tag in tags["images"]},
                    audios={tag: [(e.step, *wav_samples(e.encoded_audio_string)) for e in events.Audio(tag)]
                            for tag in tags["audio"]})
    for event in events.Tensors("samples/prompts/text_summary"):   # "`00-name`: prompt" per line
        for line in event.tensor_proto.string_val[0].decode().split("\n\n"):
            stem, prompt = line.split(": ", 1)
            logged.captions[f"samples/{stem.strip('`')}"] = prompt
    return logged


def gif_frames(data: bytes) -> np.ndarray:
    frames = ImageSequence.Iterator(Image.open(io.BytesIO(data)))
    return np.stack([np.asarray(frame.convert("RGB")) for frame in frames])


def wav_samples(data: bytes) -> tuple[int, np.ndarray]:
    """(sample rate, int16 samples [channels, N]) of a WAV file's bytes."""
    with wave.open(io.BytesIO(data)) as wav:
        rate, channels, pcm = wav.getframerate(), wav.getnchannels(), wav.readframes(wav.getnframes())
    return rate, np.frombuffer(pcm, "<i2").reshape(-1, channels).T


def wandb_log(run: Path) -> Logged:
    logged = Logged()
    for folder, record in wandb_records(run):
        if record.WhichOneof("record_type") != "history":
            continue
        step, row = record.history.step.num, {}
        for item in record.history.item:   # nested_key: [key] for a number, [key, field] for a video's fields
            key, *inner = [item.key] if item.key else list(item.nested_key)
            value = json.loads(item.value_json)
            if inner:
                row.setdefault(key, {})[inner[0]] = value
            else:
                row[key] = value
        for key, value in row.items():
            if key.startswith("train/"):
                logged.scalars.setdefault(key, {})[step] = value
            elif key.startswith("samples/") and value.get("_type") == "video-file":
                frames, _ = read_video(folder / "files" / value["path"])
                logged.videos.setdefault(key, []).append((step, frames))
                logged.captions[key] = value["caption"]
    return logged


def wandb_records(run: Path) -> list:
    """(offline run folder, record) of every record W&B wrote for ``run``, oldest first."""
    from wandb.proto import wandb_internal_pb2

    found = []
    for folder in sorted(run.glob("wandb/offline-run-*")):
        for data in transaction_log(next(folder.glob("run-*.wandb")).read_bytes()):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            found.append((folder, record))
    return found


def transaction_log(data: bytes):
    """The records of a ``.wandb`` file, which ``wandb sync`` uploads: a 7-byte header (":W&B",
    magic, version), then LevelDB's log format: 32 KiB blocks of chunks, each with a 7-byte header
    (crc32, length, type: 1 full, 2 first, 3 middle, 4 last). Read here because newer wandb
    releases no longer ship a Python reader (``wandb.sdk.internal.datastore``)."""
    assert data[:4] == b":W&B"
    block, position, pending = 32768, 7, b""
    while position + 7 <= len(data):
        left = block - position % block
        _, length, kind = struct.unpack_from("<IHB", data, position) if left >= 7 else (0, 0, 0)
        if kind == 0:   # a block's zero padding
            position += left
            continue
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            yield pending
            pending = b""


# ------------------------------------------------------------------ the tests

@pytest.mark.parametrize("read", [tensorboard_log, wandb_log], ids=["tensorboard", "wandb"])
def test_scalars_and_sample_videos_are_logged_at_their_steps(logged_run, read):
    logged = read(logged_run)
    records = [json.loads(line) for line in (logged_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for record in records:   # the numbers of metrics.jsonl, as train/<name>
        for key, value in record.items():
            if key not in ("step", "epoch", "time"):
                assert logged.scalars[f"train/{key}"][record["step"]] == pytest.approx(value, rel=1e-6)
    assert sorted(logged.videos) == TAGS and [logged.captions[tag] for tag in TAGS] == PROMPTS
    for tag in TAGS:
        assert [step for step, _ in logged.videos[tag]] == [2, 4, 6]   # once each, at the step they were made
        for step, frames in logged.videos[tag]:
            written, _ = read_video(logged_run / "samples" / f"step-{step:07d}" / f"{tag.split('/')[1]}.mp4")
            assert frames.shape == written.shape == (4, 16, 16, 3)
            assert np.abs(frames.astype(int) - written.astype(int)).mean() < 12   # mp4 is lossy, the GIF is not


def test_a_clip_with_sound_has_its_soundtrack_in_tensorboard(tmp_path):
    """A GIF has no sound: the soundtrack goes beside it as a 16-bit WAV audio summary, both
    channels of a stereo one; a silent clip gets none."""
    from videodit.data.video_write import write_video
    from videodit.train.loggers import SampleVideo, TensorBoardLogger

    frames = np.zeros((4, 16, 16, 3), np.uint8)
    rate, time = 16000, np.arange(8000) / 16000
    stereo = np.stack([0.5 * np.sin(2 * np.pi * 440 * time), -0.25 * np.sin(2 * np.pi * 220 * time)]).astype(np.float32)
    stereo[0, :3] = [1.5, -2.0, 0.0]   # beyond [-1, 1]: clipped, as in the mp4
    paths = [tmp_path / "samples" / f"{stem}.mp4" for stem in ("00-a", "01-b")]
    paths[0].parent.mkdir()
    for path in paths:
        write_video(path, frames, 8.0)
    logger = TensorBoardLogger(tmp_path)
    logger.log_videos(3, [SampleVideo("a", frames, paths[0], 8.0, (stereo, rate)),
                          SampleVideo("b", frames, paths[1], 8.0)])
    logger.close()
    logged = tensorboard_log(tmp_path)
    assert sorted(logged.videos) == ["samples/00-a", "samples/01-b"] and list(logged.audios) == ["samples/00-a/audio"]
    [(step, got_rate, samples)] = logged.audios["samples/00-a/audio"]
    assert (step, got_rate, samples.shape) == (3, rate, (2, 8000))
    assert np.abs(samples / 32767 - np.clip(stereo, -1, 1)).max() <= 1 / 32767


def test_wandb_holds_the_resolved_config_and_the_git_commit(logged_run):
    runs = [record.run for _, record in wandb_records(logged_run) if record.WhichOneof("record_type") == "run"]
    config = {update.key: json.loads(update.value_json) for update in runs[-1].config.update}
    resolved = yaml.safe_load((logged_run / "config.yaml").read_text())
    assert {key: config[key] for key in resolved} == resolved
    assert config["git_commit"] == json.loads((logged_run / "run_info.json").read_text())["git_commit"]


def test_resume_continues_the_same_wandb_run(logged_run):
    run_id = (logged_run / "wandb" / "run_id").read_text().strip()
    segments = sorted(logged_run.glob("wandb/offline-run-*"))   # one per process, each to be synced
    runs = [(folder, record.run) for folder, record in wandb_records(logged_run)
            if record.WhichOneof("record_type") == "run"]
    assert len(segments) == 2 and [folder for folder, _ in runs] == segments
    assert [run.run_id for _, run in runs] == [run_id, run_id]


def test_each_prompt_starts_from_noise_of_its_own(toy_dir, tmp_path):
    """Clip k depends on (seed, k) only: not on the other prompts or the batch size, so sample k
    of successive training steps starts from the same noise. The clips' latents hold 900 values,
    not a multiple of 16: torch's CPU randn then draws other numbers for one clip than for two, so
    one generator for a batch would fail this."""
    from videodit.train.trainer import Trainer

    trainer = Trainer(load_config("tiny", tiny_overrides(toy_dir, **{"model.patch_size": "[1,2,2]"})), tmp_path / "r")
    torch.manual_seed(0)
    torch.nn.init.normal_(trainer.model.final_layer.proj.weight, std=0.02)   # a new model's clips are all grey

    def clips(prompts, **kwargs):
        return generate(trainer.model, trainer.vae, trainer.text, trainer.flow, prompts, num_frames=3, height=10,
                        width=10, steps=2, guidance=4.0, fps=8, seed=0, device=trainer.device, **kwargs).astype(int)

    both = clips(PROMPTS)
    same_prompt = clips([PROMPTS[1], PROMPTS[1]])
    assert np.abs(same_prompt[1] - both[1]).max() <= 1                 # the other prompt changed
    assert np.abs(clips(PROMPTS, batch_size=1) - both).max() <= 1      # the batch size changed
    assert np.abs(same_prompt[0] - same_prompt[1]).mean() > 4          # another index, other noise


def hide_wandb(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)   # `import wandb` raises ImportError


@pytest.mark.parametrize("loggers, setup, message", [
    ("[tensorboard,mlflow]", None, "train.loggers='mlflow' is not allowed; choose one of: tensorboard, jsonl, wandb"),
    ("[jsonl,wandb]", hide_wandb, "pip install videodit[wandb]"),
], ids=["unknown", "wandb-missing"])
def test_bad_loggers_are_one_line_before_anything_is_built(toy_dir, tmp_path, monkeypatch, capsys, loggers, setup,
                                                           message):
    if setup is not None:
        setup(monkeypatch)

    def never(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr("videodit.train.trainer.build_model", never)
    run = tmp_path / "run"
    assert main(["train", "--out", str(run), *tiny_overrides(toy_dir, **{"train.loggers": loggers})]) == 2
    errors = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("error")]
    assert len(errors) == 1 and message in errors[0]
    assert not run.exists()
