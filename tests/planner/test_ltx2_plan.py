"""The planner's activation profile of LTX-2 (``models/ltx2/activations.py``) against
``LiveMemory`` over one step of the model (noise, x_t, target, forward, the loss, read once
autocast has exited as it has when training's backward runs), fp32 and bf16 autocast on CPU,
LTX-2.0 and 2.3 at test size (4 heads x 32, 2 blocks, 256 video tokens and 32 caption tokens per
sample, time per token as training's model inputs give it), the video stream alone and with its
audio stream (``model.train_audio``: 24 audio tokens a sample on 4 heads x 8, its own noise,
target and loss; the outputs not held past the loss, as ``parallelize``'s loss).

Without checkpointing the planner is within 5% (measured: 1.00 fp32, 1.006-1.018 bf16; the block
table's autocast units were fitted with the bf16 weight copies the blocks save, at this size; with
audio 1.000 fp32, 0.985-0.993 bf16, the audio weights' copies measured, not predicted).
Under checkpointing (selective, full) a block keeps none of those copies, and the comparison leaves
out the ones the layers outside the blocks save (``estimate`` counts autocast's weight copies as
temporaries): the checkpointed blocks hold their inputs, the per-token modulation [B, T, rows D]
and time embedding among them (``ActivationProfile.checkpoint_inputs``, once), and under bf16 the
residual stream they keep is bf16 (``residual_low``). Measured 1.000-1.010 (audio: 0.997-1.002).
What the audio stream adds on its own (with audio less without, weight copies left out) is
predicted to 0.97-0.995 of the measured: the per-sample tensors (modulations, gates) are not
counted.

The planner's parameter state follows ``LTX2Spec.configure`` (the audio stream frozen without
``model.train_audio``), its FLOPs count the audio stream with it, and training on the fly counts
the frozen audio VAE's weights."""

import dataclasses
import functools
import gc
import json

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from videodit.config import MemoryConfig, load_config
from videodit.errors import UserError
from videodit.models.families import spec_of
from videodit.models.ltx2.geometry import LTX2_0, LTX2_3
from videodit.models.ltx2.model import LTX2Model
from videodit.models.spec import AudioInputs, Conditions
from videodit.planner.estimate import Parallel, Precision, Shape, activation_bytes
from videodit.parallel.activation_checkpoint import apply_activation_checkpointing
from videodit.planner.estimate import block_activation_bytes
from videodit.planner.measure import LiveMemory
from videodit.planner.plan import LatentGeometry, frozen_encoder_bytes, plan_buckets, planner_from_config
from videodit.planner.report import plan_json

GRID, TEXT, BATCH, AUDIO = (4, 8, 8), 32, 2, 24
MODES = ["none", "selective", "full"]
AUDIO_ON_OFF = pytest.mark.parametrize("audio", [0, AUDIO], ids=["video", "audio"])


def geometry(version: str):
    base = LTX2_3 if version == "2.3" else LTX2_0
    return dataclasses.replace(base, num_layers=2, num_heads=4, head_dim=32, audio_head_dim=8, in_channels=16,
                               audio_in_channels=8, caption_channels=None if version == "2.3" else 48)


class _Tracker(LiveMemory):
    """LiveMemory that also notes the storages of parameters' autocast copies."""

    def __init__(self):
        super().__init__()
        self.copies = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.nn.Parameter):
            self.copies.add(StorageWeakRef(out.untyped_storage()))
        return out

    @property
    def weight_copies(self) -> int:
        self.live   # drops the expired storages
        return sum(n for ref, n in self._storages.items() if ref in self.copies)


@functools.lru_cache(maxsize=None)   # the match tests and the audio-increment test share runs
def measured_activations(version: str, bf16: bool, mode: str = "none", weight_copies: bool = True,
                         audio: int = 0) -> int:
    """Bytes live after one forward and loss; ``weight_copies=False``: less the parameters'
    autocast copies still held; ``audio``: audio tokens a sample (0: the video stream alone)."""
    g = geometry(version)
    torch.manual_seed(0)
    model = LTX2Model(g)
    apply_activation_checkpointing(model, MemoryConfig(checkpointing=mode))
    spec = spec_of(model)
    x0 = torch.randn(BATCH, g.in_channels, *GRID)
    cond = Conditions(y=torch.randn(BATCH, TEXT, g.caption_channels or g.dim), y_mask=None,
                      fps=torch.full((BATCH,), 24.0))
    a0 = torch.randn(BATCH, audio, g.audio_in_channels)
    audio_text = torch.randn(BATCH, TEXT, g.caption_channels or g.audio_dim)
    t, audio_t = torch.rand(BATCH), torch.rand(BATCH)
    with _Tracker() as tracker:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            noise = torch.randn_like(x0)
            s = t.view(-1, 1, 1, 1, 1)
            x_t = (1 - s) * x0 + s * noise
            target = noise - x0
            if audio:
                audio_noise = torch.randn_like(a0)
                audio_target = audio_noise - a0
                cond.audio = AudioInputs((1 - audio_t.view(-1, 1, 1)) * a0 + audio_t.view(-1, 1, 1) * audio_noise,
                                         audio_t, audio_text)
            loss = step_loss(model(*spec.model_inputs(x_t, t, cond)), target, audio_target if audio else None)
        # Out of autocast, as training's backward runs: its cache of bf16 weight copies is gone
        # (those a block saved for backward stay; a checkpointed block saved none).
        gc.collect()
        live = tracker.live - (0 if weight_copies else tracker.weight_copies)
    del loss
    return live


def step_loss(out, target, audio_target=None):
    """Each stream's MSE; the model's outputs are not held past it (as parallelize's loss)."""
    if audio_target is None:
        return ((out.float() - target) ** 2).mean()
    return ((out[0].float() - target) ** 2).mean() + ((out[1].float() - audio_target) ** 2).mean()


def predicted_activations(version: str, bf16: bool, mode: str = "none", audio: int = 0) -> tuple[int, dict]:
    g = geometry(version)
    return activation_bytes(g, Shape(BATCH, *GRID, g.in_channels, TEXT, audio), Parallel(), Precision(bf16),
                            MemoryConfig(checkpointing=mode), g.num_layers)


@AUDIO_ON_OFF
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("version", ["2.0", "2.3"])
def test_ltx2_activations_match_live_memory(version, precision, audio):
    bf16 = precision == "bf16"
    measured = measured_activations(version, bf16, audio=audio)
    predicted, detail = predicted_activations(version, bf16, audio=audio)
    assert detail["audio_tokens"] == audio
    assert abs(predicted / measured - 1) <= 0.05, f"LTX-{version} {precision} audio {audio}: {predicted / measured:.3f}"


@AUDIO_ON_OFF
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["selective", "full"])
@pytest.mark.parametrize("version", ["2.0", "2.3"])
def test_ltx2_checkpointed_activations_match_live_memory(version, mode, precision, audio):
    bf16 = precision == "bf16"
    measured = measured_activations(version, bf16, mode, weight_copies=False, audio=audio)
    predicted, detail = predicted_activations(version, bf16, mode, audio)
    assert detail["checkpointed_blocks"] == geometry(version).num_layers
    assert abs(predicted / measured - 1) <= 0.05, \
        f"LTX-{version} {mode} {precision} audio {audio}: {predicted / measured:.3f}"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("version", ["2.0", "2.3"])
def test_ltx2_audio_stream_adds_what_it_keeps(version, mode, precision):
    """The audio stream's and cross-modal attentions' own share, held alone: what a step with
    audio keeps beyond the video-only step, predicted within 5% (weight copies left out: the
    planner counts them as temporaries)."""
    bf16 = precision == "bf16"
    measured = [measured_activations(version, bf16, mode, weight_copies=False, audio=audio) for audio in (0, AUDIO)]
    predicted = [predicted_activations(version, bf16, mode, audio)[0] for audio in (0, AUDIO)]
    ratio = (predicted[1] - predicted[0]) / (measured[1] - measured[0])
    assert abs(ratio - 1) <= 0.05, f"LTX-{version} {mode} {precision}: the audio stream's share {ratio:.3f}"


@AUDIO_ON_OFF
def test_ltx2_checkpointed_blocks_keep_a_bf16_residual_and_the_modulation_once(audio):
    """A fully checkpointed block keeps its inputs: the video tokens and, with audio, the audio
    stream's (A wide), in the residual's dtype; the shared inputs once (with audio the video's
    per-token cross-modal modulation too, 4 D)."""
    g = geometry("2.3")
    shape = Shape(BATCH, *GRID, g.in_channels, TEXT, audio)
    tokens, audio_tokens = BATCH * 256, BATCH * audio
    args = (g, tokens, BATCH, TEXT, Parallel())
    for precision, width in ((Precision(True), 2), (Precision(False), 4)):
        assert block_activation_bytes(*args, precision, mode="full", audio_tokens=audio_tokens) == \
            (tokens * g.dim + audio_tokens * g.audio_dim) * width
    # the shared inputs (9 rows of modulation, the time embedding: 10 D fp32) once, not per block
    full = MemoryConfig(checkpointing="full")
    one, detail = activation_bytes(g, shape, Parallel(), Precision(False), full, 1)
    two, _ = activation_bytes(g, shape, Parallel(), Precision(False), full, 2)
    assert two - one == detail["per_block_full"] == (tokens * g.dim + audio_tokens * g.audio_dim) * 4
    plain, plain_detail = activation_bytes(g, shape, Parallel(), Precision(False), MemoryConfig(), 1)
    outside = plain - plain_detail["per_block_plain"]
    shared = 10 + (4 if audio else 0)
    assert one - detail["per_block_full"] - outside == pytest.approx(shared * tokens * g.dim * 4, abs=1)


@AUDIO_ON_OFF
def test_ltx2_profile_splits_heads_under_tensor_parallelism(audio):
    """TP=2 halves the per-head tensors (q, k, v, attention outputs, the FFN hidden) but not the
    residual stream or the modulation sums."""
    g = geometry("2.3")
    shape = Shape(BATCH, *GRID, g.in_channels, TEXT, audio)
    one, _ = activation_bytes(g, shape, Parallel(), Precision(False), MemoryConfig(), 2)
    two, _ = activation_bytes(g, shape, Parallel(tp=2), Precision(False), MemoryConfig(), 2)
    assert 0.5 * one < two < 0.8 * one


# ----------------------------------------------------------------------------- a whole plan

GIB = 2**30
LATENT, CAPTION = LatentGeometry.ltx2(), (4096, 1024)
AUDIO_RUN = ["model.train_audio=true", "audio.kind=ltx2"]


def planner(recipe: str, overrides: list[str], world: int = 8, **kwargs):
    return planner_from_config(load_config(recipe, overrides), 80 * GIB, world_size=world, latent=LATENT,
                               caption=CAPTION, **{"encoder_bytes": 0, **kwargs})


def trained_by_configure(p) -> int:
    """What training trains of the planner's model: the parameters ``configure`` leaves trainable."""
    spec = spec_of(p.geometry)
    with torch.device("meta"):
        model = spec.configure(spec.build(p.geometry), p.config.model)
    return sum(param.numel() for param in model.parameters() if param.requires_grad)


@AUDIO_ON_OFF
def test_ltx2_planner_trains_what_configure_trains(audio):
    """Gradients, optimizer states and DDP buckets are the trained parameters' (the audio stream
    and the cross-modal attentions frozen without model.train_audio, every weight with it); the
    weights and the EMA (which shadows frozen weights too) are every parameter's."""
    overrides = (AUDIO_RUN if audio else []) + ["train.ema_decay=0.99", "parallel.dp_shard=1",
                                                "parallel.dp_replicate=8"]
    p = planner("ltx2.3-22b-finetune", overrides)
    trained = trained_by_configure(p)
    assert sum(p.counts.trained) == trained and (trained == p.counts.num_params) == bool(audio)
    e = p.estimate(1, 49, 544, 960)
    assert (e.grads, e.optimizer, e.ddp_buckets) == (trained * 4, trained * 8, trained * 4)
    assert e.params == e.ema == p.counts.num_params * 4


def test_ltx2_audio_run_plans_its_audio_tokens_and_flops():
    """With model.train_audio the planner's clips carry their soundtracks' tokens (sample.fps and
    data.frame_interval size them) and a sample's step FLOPs count the audio stream."""
    video, both = (planner("ltx2.3-22b-lora", overrides, 1) for overrides in ([], AUDIO_RUN))
    tokens = spec_of(both.geometry).audio_tokens(49, both.config.sample.fps, both.config.data.frame_interval)
    assert both.shape(1, 49, 544, 960).audio_tokens == tokens > 0 == video.shape(1, 49, 544, 960).audio_tokens
    flops = [p.flops_per_sample(49, 544, 960) for p in (video, both)]
    assert flops[1].model > flops[0].model and flops[1].hardware > flops[0].hardware
    assert both.estimate(1, 49, 544, 960).activations > video.estimate(1, 49, 544, 960).activations
    plans = json.loads(plan_json(both, plan_buckets(both, [("544x960", 49, "0.57", 544, 960, 1)]), 80 * GIB))
    assert plans["buckets"][0]["audio_tokens"] == tokens and plans["model"]["audio_fps"] == 24


def test_ltx2_train_audio_is_refused_as_training_refuses_it():
    with pytest.raises(UserError, match="audio.kind"):
        planner("ltx2.3-22b-finetune", ["model.train_audio=true"])
    with pytest.raises(UserError, match="no audio stream"):
        planner_from_config(load_config("tiny", ["model.train_audio=true"]), 80 * GIB)


def _safetensors(path, tensors: dict[str, list[int]]) -> None:
    """A safetensors file of these shapes (the planner reads its header only: zero-filled data)."""
    header, offset = {}, 0
    for name, shape in tensors.items():
        size = 4 * int(torch.tensor(shape).prod())
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + bytes(offset))


def test_ltx2_audio_vae_weights_count_on_the_fly_not_with_a_cache(tmp_path):
    """The frozen audio VAE training builds: the release file's audio_vae.* tensors (not its DiT
    or vocoder), or a diffusers folder's audio_vae/ (not vocoder/), at audio.dtype; nothing with
    data.cache (its latents are cached) or without model.train_audio."""
    release = tmp_path / "ltx-2.3-22b-dev.safetensors"
    _safetensors(release, {"audio_vae.encoder.w": [10, 10], "audio_vae.decoder.w": [5], "vocoder.w": [7],
                           "model.diffusion_model.w": [100]})
    folder = tmp_path / "diffusers"
    for part, shape in (("audio_vae", [10, 10]), ("vocoder", [7]), ("transformer", [100])):
        (folder / part).mkdir(parents=True)
        (folder / part / "config.json").write_text("{}")
        _safetensors(folder / part / "diffusion_pytorch_model.safetensors", {"w": shape})
    for path, elements in ((release, 105), (folder, 100)):
        for dtype, width in (("fp32", 4), ("bf16", 2)):
            cfg = load_config("ltx2.3-22b-lora", AUDIO_RUN + [f"audio.path={path}", f"audio.dtype={dtype}",
                                                             "vae.path=null", "text.path=null"])
            assert frozen_encoder_bytes(cfg) == elements * width
    cfg = load_config("ltx2.3-22b-lora", AUDIO_RUN + [f"audio.path={release}", "vae.path=null", "text.path=null"])
    assert frozen_encoder_bytes(load_config("ltx2.3-22b-lora", ["vae.path=null", "text.path=null",
                                                                f"audio.path={release}"])) == 0
    assert planner_from_config(cfg, 80 * GIB, latent=LATENT, caption=CAPTION).encoder_bytes == 105 * 4
    cached = planner("ltx2.3-22b-lora", AUDIO_RUN + [f"audio.path={release}", f"data.cache={tmp_path / 'cache'}"], 1,
                     encoder_bytes=None)
    assert cached.encoder_bytes == 0
