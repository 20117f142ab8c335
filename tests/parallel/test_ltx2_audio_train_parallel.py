"""LTX-2 training both streams (``model.train_audio``) through the trainer under torchrun (gloo, 2 CPU
processes, fp32) against one process on the same global batch, two steps each, the layouts in one
launch (``workers/ltx2_audio_train_worker.py``; the run of tests/train/test_ltx2_audio_train.py: the
tiny LTX-2, its tiny random audio VAE and the toy text encoder given an audio stream's text):

- ``fsdp``: FSDP2 over the 2 ranks (``parallel.dp_shard=2``), each rank one micro-batch of the
  reference's ``train.grad_accum=2``;
- ``ulysses``: Ulysses SP=2 (``parallel.sp=2``, ``dp_shard=1``: the SP ranks' gradients averaged by
  DDP): the video tokens split, the audio stream whole on every rank; the reference: the same batch;
- ``lora_fsdp_ulysses``: LoRA (``lora.rank=4`` on a random base, adapters on the video, audio and
  cross-modal attentions) under FSDP2 + Ulysses SP (``parallel.sp=2``, ``dp_shard=-1``: FSDP2 shards
  over the SP ranks).

Each step's global ``loss``, ``grad_norm`` (before clipping: a gradient counted twice, or missed on
a rank, shows there even where AdamW's first update would hide it) and ``audio_loss`` (the audio
stream's part, as the trainer logs it: averaged over the micro-batches and the ranks) within 1e-5 of
the reference's, relative (``tests/tolerance.py``); the second step's also checks the first update.
Measured (x86, torch 2.14, 2 CPU processes): FSDP2 <= 1.0e-7 (its grad norms equal), Ulysses <= 3.0e-7,
LoRA under FSDP2 + SP <= 8.3e-8 (its losses and grad norms equal): fp32 reduction order, a factor
30 below the bound. LoRA also trains the adapters alone (the audio stream's among them) and leaves
the base bitwise as loaded.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from conftest import random_model_folder, torchrun
from tolerance import assert_close
from train.test_ltx2_audio_train import audio_toy, audio_vae, overrides, two_streams  # noqa: F401
from videodit.config import load_config
from videodit.models.lora import is_adapter_name
from videodit.train.trainer import Trainer

WORKER = Path(__file__).parent / "workers" / "ltx2_audio_train_worker.py"
TOLERANCE = 1e-5
STEPS = 2
ATTENTIONS = ("attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")
TARGETS = "[" + ", ".join(f"{a}.{p}" for a in ATTENTIONS for p in ("to_q", "to_v", "to_out.0")) + "]"


def reference(cfg_overrides: list[str], run: Path) -> dict:
    """One process: each step's global loss, grad norm and audio_loss, as the worker records them."""
    trainer = Trainer(load_config("tiny", cfg_overrides), run)
    batches = trainer.batches()
    accum = trainer.cfg.train.grad_accum
    losses, grad_norms, audio_losses = [], [], []
    for _ in range(STEPS):
        loss, grad_norm = trainer.train_step([next(batches) for _ in range(accum)])
        losses.append(loss)
        grad_norms.append(grad_norm)
        audio_losses.append(trainer.audio.metrics(trainer.ctx)["audio_loss"])
    return {"losses": losses, "grad_norms": grad_norms, "audio_losses": audio_losses,
            "names": set(trainer.model.state_dict())}


def test_av_training_under_fsdp_ulysses_and_lora_matches_one_process(audio_toy, audio_vae, two_streams,  # noqa: F811
                                                                       tmp_path):
    av = overrides(audio_toy, audio_vae, **{"train.lr": 1e-3, "train.warmup_steps": 1})
    base = random_model_folder(av, tmp_path / "base")   # the whole A/V model, nothing zero
    lora = av + ["lora.rank=4", f"model.init_from={base}", f"lora.targets={TARGETS}"]
    runs = {"fsdp": (av + ["parallel.dp_shard=2"], av + ["train.grad_accum=2"], "dp_shard=2 (fsdp)"),
            "ulysses": (av + ["parallel.sp=2", "parallel.dp_shard=1"], av, "sp=2 (ddp)"),
            "lora_fsdp_ulysses": (lora + ["parallel.sp=2"], lora, "sp=2 (fsdp)")}
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"out": str(tmp_path), "runs": [{"name": name, "overrides": layout, "steps": STEPS}
                                                               for name, (layout, _, _) in runs.items()]}))
    result = torchrun(2, str(WORKER), str(spec))
    assert result.returncode == 0, result.stderr[-3000:]
    for name, (_, one, layout) in runs.items():
        got, want = torch.load(tmp_path / f"{name}.pt"), reference(one, tmp_path / f"ref-{name}")
        assert got["layout"] == f"world 2: {layout}", got["layout"]
        for key in ("losses", "grad_norms", "audio_losses"):
            assert_close(torch.tensor(got[key]), torch.tensor(want[key]), TOLERANCE, f"{name} {key}")
        assert all(0 < a < loss for a, loss in zip(got["audio_losses"], got["losses"])), name
        assert got["weights"].keys() == want["names"]
    # LoRA: the adapters alone trained, the audio stream's among them; the base as it was loaded.
    got = torch.load(tmp_path / "lora_fsdp_ulysses.pt")
    trained = got["trained"]
    assert trained and all(is_adapter_name(n) for n in trained)
    assert any(".audio_attn1." in n for n in trained) and any(".video_to_audio_attn." in n for n in trained)
    base_weights = load_file(base / "model.safetensors")
    frozen = [k for k in got["weights"] if not is_adapter_name(k)]
    assert frozen and all(torch.equal(got["weights"][k], base_weights[k.replace(".base_layer.", ".")])
                          for k in frozen)
    assert all(got["weights"][k].abs().max() > 0 for k in got["weights"] if "lora_B" in k)   # B starts at zero
