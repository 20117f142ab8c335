"""LTX-2 training both streams (``model.train_audio``) through pipeline parallelism, trainer to
trainer: torchrun (gloo, 2 CPU processes) at parallel.pp=2 (1F1B, two micro-batches of one sample)
against one process, on a tiny LTX-2 (``ltx2-tiny``, two blocks: one per stage) with the stand-in
audio VAE and the toy set's soundtracks, as tests/train/test_ltx2_audio_train.py configures it.

The pipeline carries the audio stream through its stages and the audio target and mask, cut per
micro-batch, to the last stage's loss: two steps' losses and audio losses match one process within
1e-5 relative (the micro-batches' means against the batch's; measured on x86, torch 2.14: below
1e-6). Also, without torchrun: the targets packed for the schedule come back exactly.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_overrides, torchrun
from videodit.config import load_config
from videodit.models.ltx2.audio_stand_ins import save_ltx2_audio_vae
from videodit.parallel.pipeline import pack_samples, unpack_samples

WORKER = Path(__file__).parent / "workers" / "ltx2_audio_worker.py"
sys.path.insert(0, str(WORKER.parent))
from ltx2_audio_worker import two_stream_encoders  # noqa: E402

STEPS = 2
AUDIO_VIDEO = {"model.preset": "ltx2-tiny", "model.depth": 2, "model.patch_size": "[1,1,1]", "text.dim": 32,
               "data.height": 8, "data.width": 8, "diffusion.prediction": "velocity",
               "diffusion.loss_space": "velocity", "diffusion.first_frame_p": 0.5, "train.deterministic": True,
               "train.batch_size": 2, "train.sample_every": 0, "train.max_steps": STEPS,
               "model.train_audio": True, "audio.kind": "ltx2", "model.audio_channels": 16}


@pytest.fixture(scope="module")
def audio_run(tmp_path_factory):
    """Overrides of a tiny A/V run: the toy set with soundtracks, the stand-in audio VAE."""
    from videodit.toy.make import make_toy_dataset

    toy = tmp_path_factory.mktemp("toy_audio")
    make_toy_dataset(toy, clips_per_combination=1, num_frames=8, height=16, width=16, seed=0, audio=True)
    vae = save_ltx2_audio_vae(tmp_path_factory.mktemp("audio_vae"), base_channels=16, latent_channels=1, mel_bins=64)
    return tiny_overrides(toy, **{**AUDIO_VIDEO, "audio.path": str(vae)})


def one_process(overrides, run: Path, monkeypatch) -> dict:
    import videodit.train.trainer as trainer_module
    monkeypatch.setattr(trainer_module, "build_encoders", two_stream_encoders(trainer_module))
    trainer = trainer_module.Trainer(load_config("tiny", overrides), run)
    batches = trainer.batches()
    losses, audio_losses = [], []
    for _ in range(STEPS):
        losses.append(trainer.train_step([next(batches)])[0])
        audio_losses.append(trainer.audio.metrics(trainer.ctx)["audio_loss"])
    return {"losses": losses, "audio_losses": audio_losses}


def test_two_pipeline_stages_train_both_streams_as_one_process(audio_run, tmp_path, monkeypatch):
    spec = tmp_path / "spec.json"
    overrides = audio_run + ["parallel.pp=2", "parallel.pp_microbatches=2"]
    spec.write_text(json.dumps({"out": str(tmp_path / "pp.json"), "run": str(tmp_path / "pp"),
                                "overrides": overrides, "steps": STEPS}))
    result = torchrun(2, str(WORKER), str(spec))
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads((tmp_path / "pp.json").read_text())
    want = one_process(audio_run, tmp_path / "one", monkeypatch)
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-5)
    assert got["audio_losses"] == pytest.approx(want["audio_losses"], rel=1e-5)
    assert all(0 < audio < loss for audio, loss in zip(got["audio_losses"], got["losses"]))


def test_targets_packed_for_the_schedule_come_back_exactly():
    gen = torch.Generator().manual_seed(0)
    tensors = {"target": torch.randn(4, 3, 2, 5, generator=gen),
               "audio_target": torch.randn(4, 7, 6, generator=gen).to(torch.bfloat16),
               "audio_mask": torch.rand(4, 7, generator=gen) > 0.5,
               "wide": torch.randn(4, 2, generator=gen, dtype=torch.float64)}
    packed, layout = pack_samples(tensors)
    assert packed.shape == (4, 30 + 42 + 7 + 2) and packed.dtype == torch.float64
    for i, piece in enumerate(packed.tensor_split(2)):   # as the schedule cuts it
        got = unpack_samples(piece, layout)
        for name, tensor in tensors.items():
            want = tensor[2 * i:2 * i + 2]
            assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
