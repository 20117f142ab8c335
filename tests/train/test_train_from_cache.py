"""Training from a feature cache (data.cache) gives the losses of on-the-fly encoding: the toy
(identity VAE, toy text), bucketed data with images and several views, bf16 storage, and a
tiny diffusers AutoencoderKL with a tiny T5 (STDiT) or a tiny Wan 2.1 VAE with a tiny umT5 (Wan);
mid-epoch resume; and no encoder is built."""

import json
from pathlib import Path

import pytest
import torch

from conftest import damage_shard, tiny_overrides
from videodit.cache import build_cache
from videodit.config import load_config
from videodit.train.trainer import Trainer

REL = 1e-5


def quiet(*args, **kwargs):
    pass


def metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def losses(run, key="loss"):
    return [r[key] for r in metrics(run) if key in r]


def assert_close(a, b, rel=REL):
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert abs(x - y) <= rel * abs(y), (a, b)


def train(overrides, run, patch=None):
    trainer = Trainer(load_config("tiny", overrides), run)
    if patch:
        patch(trainer)
    trainer.fit()
    return trainer


def test_toy_from_the_cache_gives_the_on_the_fly_losses(toy_dir, tmp_path, capsys):
    common = tiny_overrides(toy_dir, **{"train.max_steps": 4, "validation.csv": str(toy_dir / "val.csv"),
                                        "validation.max_samples": 12, "train.deterministic": True})
    build_cache(load_config("tiny", common), tmp_path / "cache", dtype="fp32", shard_size=16, log=quiet)
    train(common, tmp_path / "fly")
    capsys.readouterr()
    trainer = train(common + [f"data.cache={tmp_path / 'cache'}"], tmp_path / "cached")
    out = capsys.readouterr().out
    assert "no VAE or text encoder is built" in out and "no sample videos" in out
    assert type(trainer.vae).__name__ == "CachedVAE" and not isinstance(trainer.vae, torch.nn.Module)
    assert_close(losses(tmp_path / "cached"), losses(tmp_path / "fly"))
    assert_close(losses(tmp_path / "cached", "val_loss"), losses(tmp_path / "fly", "val_loss"))   # cached val set


def test_buckets_images_and_views_follow_the_epochs(mixed_toy, tmp_path):
    """Two views replay epochs 0 and 1 exactly; bucket batches change shape (16px, 24px, images)."""
    buckets = "{'24px': {1: [1.0, 4], 4: [1.0, 4]}, '16px': {1: [1.0, 4], 4: [1.0, 4]}}"
    common = tiny_overrides(mixed_toy, **{"data.bucket_config": buckets, "train.batch_size": 4,
                                          "train.deterministic": True, "train.max_steps": 1})
    cfg = load_config("tiny", common)
    build_cache(cfg, tmp_path / "cache", views=2, dtype="fp32", log=quiet)
    probe = Trainer(cfg, tmp_path / "probe")
    steps = probe.sampler.steps_in_epoch(0) + 3          # into epoch 1
    common += [f"train.max_steps={steps}"]
    train(common, tmp_path / "fly")
    train(common + [f"data.cache={tmp_path / 'cache'}"], tmp_path / "cached")
    fly, cached = metrics(tmp_path / "fly"), metrics(tmp_path / "cached")
    assert cached[-1]["epoch"] == 1
    assert_close([r["loss"] for r in cached if "loss" in r], [r["loss"] for r in fly if "loss" in r])


def test_a_bf16_cache_gives_the_losses_of_bf16_rounded_features(toy_dir, tmp_path):
    """bf16 storage rounds the features, and nothing else: on-the-fly encoding rounded the same
    way gives the same losses."""
    common = tiny_overrides(toy_dir, **{"train.max_steps": 3, "train.deterministic": True})
    build_cache(load_config("tiny", common), tmp_path / "cache", dtype="bf16", log=quiet)

    def round_features(trainer):
        encode = trainer.features

        def rounded(batch):
            x0, y, y_mask, *rest = encode(batch)   # rest: the pixel size and any first-frame conditions
            return x0.bfloat16().float(), y.bfloat16().float(), y_mask, *rest
        trainer.features = rounded

    train(common, tmp_path / "fly", patch=round_features)
    train(common + [f"data.cache={tmp_path / 'cache'}"], tmp_path / "cached")
    assert_close(losses(tmp_path / "cached"), losses(tmp_path / "fly"))
    train(common, tmp_path / "fp32")                     # and differs from unrounded features by bf16's rounding
    assert losses(tmp_path / "fp32") != losses(tmp_path / "cached")
    assert_close(losses(tmp_path / "cached"), losses(tmp_path / "fp32"), rel=1e-2)


def test_resume_from_the_cache_is_exact_mid_epoch(toy_dir, tmp_path):
    common = tiny_overrides(toy_dir, **{"train.max_steps": 6, "train.batch_size": 8, "train.deterministic": True})
    build_cache(load_config("tiny", common), tmp_path / "cache", log=quiet)
    common += [f"data.cache={tmp_path / 'cache'}"]
    train(common, tmp_path / "straight")
    train(common + ["train.max_steps=3"], tmp_path / "split")
    train(common + ["resume=auto"], tmp_path / "split")
    assert losses(tmp_path / "split") == losses(tmp_path / "straight")   # bitwise


# --------------------------------------------------------------------------- real-architecture encoders, per family

WAN = {"model.preset": "wan-tiny", "model.depth": 2, "model.num_heads": 4, "diffusion.constant_shift": 5.0,
       "diffusion.prediction": "velocity", "diffusion.loss_space": "velocity"}   # as tests/train/test_wan_train.py


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    """Tiny random encoders of both families, with a word tokenizer over the toy vocabulary:
    a diffusers AutoencoderKL (2x spatial, 4 channels) and a T5 for STDiT; a Wan 2.1 VAE
    (AutoencoderKLWan: 4x causal time, 4x space, 4 channels) and a umT5 (diffusers' Wan layout)
    for Wan."""
    from videodit.toy.stand_ins import save_kl_vae, save_t5, save_umt5, save_wan_vae

    root = tmp_path_factory.mktemp("encoders")
    save_kl_vae(root / "vae")
    save_t5(root / "t5")
    save_wan_vae(root / "wan_vae", temperal_downsample=(True, True))
    save_umt5(root / "umt5")
    return root


def family_overrides(family, encoders):
    """The encoders (and, for Wan, the model and the 4k+1-frame clips) of one family."""
    if family == "stdit":
        return {"vae.kind": "diffusers", "vae.path": str(encoders / "vae"), "text.kind": "transformers",
                "text.path": str(encoders / "t5"), "text.max_length": 8, "model.patch_size": "[1,2,2]"}
    return {**WAN, "vae.kind": "wan2.1", "vae.path": str(encoders / "wan_vae"), "text.kind": "umt5",
            "text.path": str(encoders / "umt5"), "text.max_length": 8, "data.num_frames": 5}   # 5 = 4k+1 frames


def perturbed_copy(folder, to):
    """``folder`` (a model and its tokenizer) with other weights: the same architecture and sizes."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, to)
    for weights in to.rglob("*.safetensors"):
        state = load_file(str(weights))
        name = sorted(state)[0]
        state[name] = state[name] + 0.5
        save_file(state, str(weights), metadata={"format": "pt"})
    return to


@pytest.mark.parametrize("family", ["stdit", "wan"])
def test_real_encoders_from_the_cache_give_the_on_the_fly_losses(family, toy_dir, tmp_path, encoders):
    """STDiT with a diffusers VAE and a T5, Wan with Wan 2.1's VAE and a umT5: an fp32 cache
    trains to the on-the-fly losses (measured: bitwise equal for both)."""
    family_keys = family_overrides(family, encoders)
    common = tiny_overrides(toy_dir, **family_keys, **{
        "train.max_steps": 3, "validation.csv": str(toy_dir / "val.csv"), "validation.max_samples": 8,
        "train.deterministic": True})
    build_cache(load_config("tiny", common), tmp_path / "cache", dtype="fp32", shard_size=16, batch_size=5,
                log=quiet)
    fly = train(common, tmp_path / "fly")
    cached = common + [f"data.cache={tmp_path / 'cache'}"]
    trainer = train(cached, tmp_path / "cached")
    assert type(trainer.vae).__name__ == "CachedVAE" and trainer.vae.latent_channels == 4
    assert trainer.text.dim == 16 and trainer.text.max_length == 8
    assert type(trainer.model).__name__ == type(fly.model).__name__
    assert_close(losses(tmp_path / "cached"), losses(tmp_path / "fly"))
    assert_close(losses(tmp_path / "cached", "val_loss"), losses(tmp_path / "fly", "val_loss"))
    # The planner plans the cached run without its encoders, the captions' geometry from the cache.
    from videodit.cli import main
    from videodit.planner.plan import planner_from_config
    planner = planner_from_config(load_config("tiny", cached), 2**30)
    assert planner.encoder_bytes == 0 and planner.caption_length == 8
    assert main(["plan", "tiny", *cached, "--gpu-mem", "1GiB"]) == 0
    # Another text encoder (other weights, same architecture and sizes) is refused; so is another
    # VAE kind (the other family's VAE, same latent channels), each in one line.
    from videodit.errors import UserError
    other = perturbed_copy(encoders / Path(family_keys["text.path"]).name, tmp_path / "text-other")
    other_vae = {"stdit": ["vae.kind=wan2.1", f"vae.path={encoders / 'wan_vae'}"],
                 "wan": ["vae.kind=diffusers", f"vae.path={encoders / 'vae'}"]}[family]
    for change, reason in (([f"text.path={other}"], "another text encoder"), (other_vae, "another VAE")):
        with pytest.raises(UserError, match=reason) as info:
            Trainer(load_config("tiny", cached + change), tmp_path / "refused")
        assert "\n" not in str(info.value) and "videodit cache build" in str(info.value)


# --------------------------------------------------------------------------- damaged shards


@pytest.mark.parametrize("how", ["clean", "flipped", "header", "flipped-in-a-worker"])
def test_a_damaged_cache_stops_training_in_one_line(toy_dir, tmp_path, how):
    from videodit.errors import UserError

    workers = 2 if how.endswith("worker") else 0   # found by a DataLoader worker: still one line
    how = how.split("-")[0]
    common = tiny_overrides(toy_dir, **{"train.max_steps": 2, "train.deterministic": True,
                                        "data.num_workers": workers})
    cache = tmp_path / "cache"
    build_cache(load_config("tiny", common), cache, dtype="fp32", shard_size=64, log=quiet)   # one shard
    if how == "clean":   # a checksummed cache trains as the on-the-fly run
        train(common, tmp_path / "fly")
        train(common + [f"data.cache={cache}"], tmp_path / "cached")
        assert_close(losses(tmp_path / "cached"), losses(tmp_path / "fly"))
        return
    damage_shard(cache, how)
    with pytest.raises(UserError) as raised:
        train(common + [f"data.cache={cache}"], tmp_path / "cached")
    message = str(raised.value)
    assert "\n" not in message and "shard-00000.safetensors is damaged" in message
    assert f"videodit cache build CONFIG --out {cache}" in message
