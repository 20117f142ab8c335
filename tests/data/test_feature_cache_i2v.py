"""The feature cache of an image-to-video model (Wan ``model.task=i2v``): the given first frame's
latents (and, with ``model.image_dim``, its CLIP features) are stored beside the latents and
captions; training from the cache gives the on-the-fly losses; a cache without what the model
takes is refused in one line; damage to the extra tensors is caught like other shard damage."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from conftest import tiny_overrides
from videodit.cache import build_cache
from videodit.cli import main
from videodit.config import load_config
from videodit.data.feature_cache import FeatureCache
from videodit.data.feature_cache.format import read_manifest
from videodit.errors import UserError
from videodit.train.trainer import Trainer

WAN = {"model.preset": "wan-tiny", "model.depth": 2, "model.num_heads": 4, "diffusion.constant_shift": 5.0,
       "diffusion.prediction": "velocity", "diffusion.loss_space": "velocity"}   # as tests/train/test_wan_train.py
CLIP_ENCODER = Path(__file__).parents[1] / "fixtures" / "wan_clip" / "diffusers"
CLIP = {"model.image_dim": 32, "image_encoder.path": str(CLIP_ENCODER)}   # the tiny CLIP: 17 tokens x 32
REL = 1e-5


def quiet(*args, **kwargs):
    pass


def losses(run, key="loss"):
    return [r[key] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if key in r]


def files(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def wan_vae(tmp_path_factory):
    """A tiny random Wan 2.1 VAE (4x causal time, 4x space, 4 channels)."""
    from videodit.toy.stand_ins import save_wan_vae

    return save_wan_vae(tmp_path_factory.mktemp("wan_vae") / "vae", temperal_downsample=(True, True))


def overrides(toy_dir, variant="i2v", wan_vae=None, **extra):
    """The tiny Wan of tests/train/test_wan_train.py's i2v test: ``i2v`` (no CLIP, identity VAE),
    ``i2v-clip`` (with the tiny CLIP), ``i2v-wan-vae`` (Wan 2.1's causal VAE), or ``t2v``."""
    keys = {**WAN, "train.max_steps": 3, "train.deterministic": True, "data.num_frames": 5,
            "model.task": "t2v" if variant == "t2v" else "i2v"}
    if variant == "i2v-clip":
        keys.update(CLIP)
    if variant == "i2v-wan-vae":
        keys.update({"vae.kind": "wan2.1", "vae.path": str(wan_vae)})
    return tiny_overrides(toy_dir, **{**keys, **extra})


def build(common, out, **kwargs):
    build_cache(load_config("tiny", common), out, **{"dtype": "fp32", "shard_size": 16, "log": quiet, **kwargs})
    return out


def train(common, run):
    trainer = Trainer(load_config("tiny", common), run)
    trainer.fit()
    return trainer


@pytest.mark.parametrize("variant", ["i2v", "i2v-clip", "i2v-wan-vae"])
def test_an_i2v_cache_trains_to_the_on_the_fly_losses(toy_dir, tmp_path, wan_vae, variant):
    """An fp32 cache of an i2v model holds its given frames' latents (and CLIP features) and
    trains to the losses of encoding them on the fly (measured: bitwise equal in all three)."""
    common = overrides(toy_dir, variant, wan_vae)
    cache = build(common, tmp_path / "cache", batch_size=5)   # encoded in groups of 5, trained in batches of 4
    manifest = read_manifest(cache)
    clip = variant == "i2v-clip"
    assert manifest["conditions"] == (["first_frame", "image"] if clip else ["first_frame"])
    assert ("image" in manifest["encoders"]) == clip and ("image_geometry" in manifest) == clip
    stored = FeatureCache(cache)
    latent, _ = stored.tensors(0)
    first = stored.condition(0, "first_frame")
    assert first.shape == latent.shape and first.dtype == torch.float32
    if clip:
        assert manifest["image_geometry"] == {"tokens": 17, "dim": 32}
        assert stored.condition(0, "image").shape == (17, 32)
    if variant == "i2v-wan-vae":   # the grey frames after the given one do not encode to zero: all of it is stored
        assert first.shape[1] == 2 and first[:, 1:].abs().max() > 0

    fly = train(common, tmp_path / "fly")
    cached = train(common + [f"data.cache={cache}"], tmp_path / "cached")
    assert cached.image_encoder is None and type(cached.vae).__name__ == "CachedVAE"
    assert cached.model.geometry.in_channels == fly.model.geometry.in_channels
    a, b = losses(tmp_path / "cached"), losses(tmp_path / "fly")
    assert len(a) == len(b) == 3
    assert all(abs(x - y) <= REL * abs(y) for x, y in zip(a, b)), (a, b)
    # Not vacuous: the cached conditions reach the model (zeroed, the run trains otherwise).
    blind = Trainer(load_config("tiny", common + [f"data.cache={cache}"]), tmp_path / "blind")
    read = blind.features

    def zeroed(batch):
        *rest, given, image = read(batch)
        return (*rest, torch.zeros_like(given), None if image is None else torch.zeros_like(image))
    blind.features = zeroed
    blind.fit()
    assert losses(tmp_path / "blind")[1:] != a[1:]   # step 1 alike: Wan's head starts at zero


@pytest.mark.parametrize("variant", ["i2v", "i2v-clip"])
def test_a_cache_without_what_the_model_takes_is_refused_in_one_line(toy_dir, tmp_path, variant):
    """A t2v cache for an i2v run (and an i2v cache without CLIP features for a CLIP run): one
    line naming what is missing and `videodit cache build`, before anything is started."""
    t2v = build(overrides(toy_dir, "t2v"), tmp_path / "t2v")
    caches = [(t2v, "no latents of the given first frames")]
    if variant == "i2v-clip":
        caches.append((build(overrides(toy_dir, "i2v"), tmp_path / "i2v"), "no image features of the given first"))
    for cache, reason in caches:
        with pytest.raises(UserError) as info:
            Trainer(load_config("tiny", overrides(toy_dir, variant, **{"data.cache": str(cache)})), tmp_path / "run")
        message = str(info.value)
        assert reason in message and "videodit cache build" in message and "\n" not in message, message
        assert not (tmp_path / "run").exists()
        main_args = ["train", "--out", str(tmp_path / "cli"), "tiny", *overrides(toy_dir, variant),
                     f"data.cache={cache}"]
        assert main(main_args) == 2 and not (tmp_path / "cli").exists()


def test_a_cache_of_another_image_encoder_is_refused_in_one_line(toy_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    cache = build(overrides(toy_dir, "i2v-clip"), tmp_path / "cache")
    other = tmp_path / "other-clip"
    shutil.copytree(CLIP_ENCODER, other)
    weights = other / "image_encoder" / "model.safetensors"
    state = load_file(str(weights))
    state[sorted(state)[0]] += 0.5   # the same architecture, other weights
    save_file(state, str(weights))
    for change, reason in ((f"image_encoder.path={other}", "another image encoder"),
                           ("image_encoder.dtype=bf16", "another image encoder")):
        with pytest.raises(UserError, match=reason) as info:
            Trainer(load_config("tiny", overrides(toy_dir, "i2v-clip", **{"data.cache": str(cache)}) + [change]),
                    tmp_path / "run")
        assert "\n" not in str(info.value) and "videodit cache build" in str(info.value)


def test_an_i2v_cache_trains_a_t2v_model_too_and_t2v_caches_keep_their_format(toy_dir, tmp_path):
    """The extras are ignored (not even read) by a model that does not take them; a t2v build
    writes no condition keys, so it is the cache of before (and old caches read as t2v ones)."""
    i2v = build(overrides(toy_dir, "i2v-clip"), tmp_path / "i2v")
    t2v_run = overrides(toy_dir, "t2v")
    t2v = build(t2v_run, tmp_path / "t2v")
    assert not {"conditions", "image_geometry"} & set(read_manifest(t2v)) and set(read_manifest(t2v)["encoders"]) \
        == {"vae", "text"}
    from safetensors.torch import load_file
    assert {k.split(".")[-1] for k in load_file(str(t2v / "shards" / "shard-00000.safetensors"))} == {"latent", "text"}
    train(t2v_run, tmp_path / "fly")
    trainer = train(t2v_run + [f"data.cache={i2v}"], tmp_path / "from-i2v")
    assert trainer.data.dataset.conditions == ()
    batch = next(iter(trainer.data.loader))
    assert batch.first_frame is None and batch.image is None
    assert losses(tmp_path / "from-i2v") == losses(tmp_path / "fly")
    # A build into a folder of the other kind is another build, named.
    with pytest.raises(UserError, match=r"another build \(differs in: .*conditions"):
        build(t2v_run, i2v)


def swap_shape(folder, name_ending, shard=0):
    """Reverse the shape of the first tensor whose name ends with ``name_ending`` in a shard's
    safetensors header (same bytes and length: only the index and manifest can tell)."""
    path = Path(folder) / "shards" / f"shard-{shard:05d}.safetensors"
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + n].decode()
    m = re.search(r'"(\d+\.\d+\.' + name_ending + r')":\{"dtype":"\w+","shape":\[([\d,]+)\]', header)
    shape = m.group(2).split(",")
    assert shape != shape[::-1]
    header = header[: m.start(2)] + ",".join(reversed(shape)) + header[m.end(2):]
    data[8 : 8 + n] = header.encode()
    path.write_bytes(data)
    return m.group(1), [int(s) for s in shape]


@pytest.fixture(scope="module")
def clip_cache(toy_dir, tmp_path_factory):
    return build(overrides(toy_dir, "i2v-clip"), tmp_path_factory.mktemp("clip") / "cache")


@pytest.mark.parametrize("tensor", ["first_frame", "image"])
def test_a_damaged_condition_tensor_is_caught_like_other_shard_damage(toy_dir, clip_cache, tmp_path, capsys, tensor):
    folder = tmp_path / "cache"
    shutil.copytree(clip_cache, folder)
    name, shape = swap_shape(folder, tensor, shard=1)
    common = overrides(toy_dir, "i2v-clip", **{"data.cache": str(folder)})
    with pytest.raises(UserError) as raised:   # training: at the shard's first read
        train(common, tmp_path / "run")
    message = str(raised.value)
    assert "\n" not in message and "shard-00001.safetensors is damaged" in message, message
    assert f"tensor '{name}' is F32 {list(reversed(shape))}, the index says F32 {shape}" in message
    assert f"videodit cache build CONFIG --out {folder}" in message
    capsys.readouterr()
    assert main(["cache", "info", str(folder), "--json"]) == 1   # cache info lists it
    assert [d["shard"] for d in json.loads(capsys.readouterr().out)["damaged"]] == [1]
    build(overrides(toy_dir, "i2v-clip"), folder)   # the build repairs it, byte for byte
    assert files(folder) == files(clip_cache)


def test_validation_from_an_i2v_cache_equals_validation_on_the_fly(toy_dir, tmp_path):
    """The cache's validation set holds the conditions too, and validation hands them to the model:
    the same validation losses as encoding validation.csv on the fly."""
    val = {"validation.csv": str(toy_dir / "val.csv"), "validation.max_samples": 8, "train.max_steps": 1}
    cache = build(overrides(toy_dir, "i2v-clip", **val), tmp_path / "cache")
    assert read_manifest(cache / "validation")["conditions"] == ["first_frame", "image"]
    fly = train(overrides(toy_dir, "i2v-clip", **val), tmp_path / "fly").last_validation
    cached = train(overrides(toy_dir, "i2v-clip", **val, **{"data.cache": str(cache)}), tmp_path / "cached")
    assert cached.last_validation == fly and fly["val_loss"] > 0


@pytest.mark.parametrize("edit,problem", [
    (lambda m: m.update(conditions=["first_frame", "depth"]), "conditions"),
    (lambda m: m.update(conditions=[]), "conditions"),
    (lambda m: m.pop("image_geometry"), "image_geometry"),
    (lambda m: m["encoders"].pop("image"), "encoders.image"),
])
def test_a_manifest_with_bad_condition_keys_is_refused_in_one_line(clip_cache, tmp_path, edit, problem):
    folder = tmp_path / "cache"
    shutil.copytree(clip_cache, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    edit(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="not a valid cache manifest") as info:
        FeatureCache(folder)
    assert problem in str(info.value) and "\n" not in str(info.value)
