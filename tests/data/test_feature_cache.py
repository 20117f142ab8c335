"""The feature cache on disk: build, resume after a kill, torchrun, unreadable videos, info,
and the refusal of a cache made for another config. (Training from it: tests/train/test_train_from_cache.py.)"""

import json
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from conftest import damage_shard, tiny_overrides, torchrun
from videodit.cache import build_cache
from videodit.cli import main
from videodit.config import load_config
from videodit.data.feature_cache import FeatureCache
from videodit.data.feature_cache.writer import ShardWriter
from videodit.errors import UserError
from videodit.train.trainer import Trainer


def config(toy_dir, **extra):
    return load_config("tiny", tiny_overrides(toy_dir, **extra))


def files(folder):
    """Relative path -> bytes of every file under ``folder``."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def quiet(*args, **kwargs):
    pass


def test_build_stores_every_sample_once_with_valid_tokens_only(toy_dir, tmp_path):
    cfg = config(toy_dir, **{"validation.csv": str(toy_dir / "val.csv"), "validation.max_samples": 10})
    build_cache(cfg, tmp_path / "c", shard_size=16, log=quiet)
    cache = FeatureCache(tmp_path / "c")
    assert len(cache) == 54 and cache.manifest["shards"] == 4      # 54 toy clips, one bucket, shards of 16
    assert sorted(cache.clip.tolist()) == list(range(54))
    latent, tokens = cache.tensors(0)
    assert latent.dtype == torch.bfloat16 and latent.shape == (3, 4, 16, 16)
    # "a red circle moving right": 5 tokens stored of the 8 padded ones, 64 wide.
    assert tokens.shape == (int(cache.text_len[0]), 64) and 0 < cache.text_len[0] < 8
    assert len(list((tmp_path / "c" / "shards").glob("*.safetensors"))) == 4   # sharded, not a file per sample
    assert len(FeatureCache(tmp_path / "c" / "validation")) == 10


def test_a_killed_build_resumes_without_redoing_finished_shards(toy_dir, tmp_path, monkeypatch):
    cfg = config(toy_dir)
    build_cache(cfg, tmp_path / "straight", shard_size=8, log=quiet)

    real_write, written = ShardWriter.write, []

    def dies_on_the_third(self):
        if len(written) == 2:
            # The kill lands while the third shard's tensors are being written.
            (self.folder / "shards" / ".shard-00002.safetensors.tmp-1234").write_bytes(b"partial")
            raise KeyboardInterrupt
        real_write(self)
        written.append(self.shard)

    monkeypatch.setattr(ShardWriter, "write", dies_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        build_cache(cfg, tmp_path / "killed", shard_size=8, log=quiet)
    monkeypatch.setattr(ShardWriter, "write", real_write)
    killed = tmp_path / "killed"
    assert not (killed / "index.parquet").exists()
    with pytest.raises(UserError, match="not complete .2 of 7 shards"):
        FeatureCache(killed)
    first = {p.name: p.stat().st_mtime_ns for p in (killed / "shards").glob("shard-0000[01].*")}
    lines = []
    redone = []
    monkeypatch.setattr(ShardWriter, "write", lambda self: (redone.append(self.shard), real_write(self)))
    build_cache(cfg, killed, shard_size=8, log=lambda *a, **k: lines.append(a[0]))
    assert redone == [2, 3, 4, 5, 6]                     # finished shards are not encoded again
    assert any("resuming, 2 of 7 shards" in line and "1 unfinished file" in line for line in lines)
    assert {p.name: p.stat().st_mtime_ns for p in (killed / "shards").glob("shard-0000[01].*")} == first
    assert files(killed) == files(tmp_path / "straight")   # byte for byte


def test_a_build_that_resizes_another_way_does_not_resume_the_folder(toy_dir, tmp_path, monkeypatch):
    cfg = config(toy_dir)
    build_cache(cfg, tmp_path / "c", shard_size=8, log=quiet)
    assert FeatureCache(tmp_path / "c").manifest["layout"]["decode"]["resize"] == "uint8-bilinear-antialias"
    monkeypatch.setattr("videodit.data.pixels.RESIZE_METHOD", "float-bilinear")   # as the float path resized
    with pytest.raises(UserError, match="holds a cache of another build .differs in: layout"):
        build_cache(cfg, tmp_path / "c", shard_size=8, log=quiet)


def test_torchrun_build_equals_a_one_process_build(toy_dir, tmp_path):
    args = tiny_overrides(toy_dir)
    assert main(["cache", "build", "tiny", *args, "--out", str(tmp_path / "one"), "--shard-size", "8"]) == 0
    done = torchrun(2, "-m", "videodit", "cache", "build", "tiny", *args, "--out", str(tmp_path / "two"),
                    "--shard-size", "8")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 1: encoded 24 clips" in done.stdout + done.stderr   # shards 1, 3, 5 of 7 (8 + 8 + 8)
    assert files(tmp_path / "two") == files(tmp_path / "one")


def test_a_cache_for_another_config_is_refused_in_one_line(toy_dir, tmp_path):
    build_cache(config(toy_dir), tmp_path / "c", shard_size=64, log=quiet)
    cache = str(tmp_path / "c")
    cases = [
        ("another text encoder", {"text.dim": 32}),
        ("another VAE", {"vae.scaling_factor": 0.5}),
        ("another VAE", {"vae.dtype": "bf16"}),   # bf16 encodes other latents
        ("another resolution table", {"data.height": 8, "data.width": 8}),
        ("another frame sampling", {"data.frame_interval": 2}),
    ]
    for reason, change in cases:
        with pytest.raises(UserError) as info:
            Trainer(config(toy_dir, **{"data.cache": cache, **change}), tmp_path / "run")
        message = str(info.value)
        assert reason in message and "videodit cache build" in message and "\n" not in message, message
    assert not (tmp_path / "run").exists()
    # A build into a folder holding another build is refused too, naming what differs.
    with pytest.raises(UserError, match=r"another build \(differs in: .*encoders"):
        build_cache(config(toy_dir, **{"text.dim": 32}), tmp_path / "c", shard_size=64, log=quiet)
    with pytest.raises(UserError, match="is not complete|does not exist"):
        Trainer(config(toy_dir, **{"data.cache": str(tmp_path / "missing")}), tmp_path / "run")


def test_another_batch_size_is_not_a_mismatch(toy_dir, tmp_path):
    build_cache(config(toy_dir), tmp_path / "c", log=quiet)
    trainer = Trainer(config(toy_dir, **{"data.cache": str(tmp_path / "c"), "train.batch_size": 2}), tmp_path / "r")
    assert len(next(trainer.batches())) == 2


def test_unreadable_videos_are_skipped_and_reported(toy_dir, tmp_path, capsys):
    data = tmp_path / "toy"
    shutil.copytree(toy_dir, data)
    victim = sorted((data / "videos").glob("*.mp4"))[3]
    victim.write_bytes(b"not a video")
    cfg = config(data)
    build_cache(cfg, tmp_path / "c", shard_size=16)
    assert "skipped 1 unreadable video(s)" in capsys.readouterr().out
    failed = pq.read_table(tmp_path / "c" / "failed.parquet").to_pylist()
    assert len(failed) == 1 and failed[0]["path"].endswith(victim.name) and failed[0]["reason"]
    cache = FeatureCache(tmp_path / "c")
    assert len(cache) == 53 and failed[0]["clip"] not in cache.clip.tolist()
    assert cache.buckets_of_view(0)[failed[0]["clip"]] == -1     # never drawn in training
    assert main(["cache", "info", str(tmp_path / "c")]) == 0
    assert "skipped 1 unreadable" in capsys.readouterr().out


def test_cache_info_summarises_buckets_bytes_and_encoders(mixed_toy, tmp_path, capsys):
    buckets = "{'24px': {1: [1.0, 4], 4: [1.0, 4]}, '16px': {1: [1.0, 4], 4: [1.0, 4]}}"
    cfg = config(mixed_toy, **{"data.bucket_config": buckets})
    build_cache(cfg, tmp_path / "c", views=2, log=quiet)
    assert main(["cache", "info", str(tmp_path / "c"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["complete"] and info["views"] == 2 and info["encoders"]["vae"]["kind"] == "identity"
    assert info["encoders"]["text"] == {"kind": "toy", "max_length": 8, "dim": 64}
    assert len(info["buckets"]) >= 3 and sum(b["samples"] for b in info["buckets"]) == info["samples"]
    assert {(b["num_frames"], b["height"]) for b in info["buckets"]} >= {(1, 16), (4, 16), (4, 24)}
    assert info["bytes"] > info["latent_bytes"] + info["text_bytes"] > 0
    assert info["mean_caption_bytes"] < info["padded_caption_bytes"]
    assert main(["cache", "info", str(tmp_path / "c")]) == 0
    text = capsys.readouterr().out
    assert "VAE: identity" in text and "samples" in text and "24px" in text


def test_views_are_the_first_epochs_draws(toy_dir, tmp_path):
    cfg = config(toy_dir, **{"data.frame_interval": 1})
    build_cache(cfg, tmp_path / "c", views=2, dtype="fp32", log=quiet)
    cache = FeatureCache(tmp_path / "c")
    assert cache.views == 2 and len(cache) == 108
    a, _ = cache.tensors(cache.row(0, 0))
    b, _ = cache.tensors(cache.row(0, 1))
    assert not torch.equal(a, b)   # two random 4-frame windows of an 8-frame clip (seeded per epoch)


def test_plan_counts_no_encoders_with_a_cache(toy_dir, tmp_path):
    from videodit.planner.plan import planner_from_config

    cfg = config(toy_dir)
    assert planner_from_config(cfg, 2**30).encoder_bytes > 0            # the toy text encoder's tables
    cached = config(toy_dir, **{"data.cache": str(tmp_path / "not-built-yet")})
    assert planner_from_config(cached, 2**30).encoder_bytes == 0


def test_shard_files_are_safetensors_with_one_entry_per_tensor(toy_dir, tmp_path):
    build_cache(config(toy_dir), tmp_path / "c", shard_size=64, log=quiet)
    tensors = load_file(str(tmp_path / "c" / "shards" / "shard-00000.safetensors"))
    assert len(tensors) == 2 * 54 and all(t.dtype == torch.bfloat16 for t in tensors.values())
    index = pq.read_table(tmp_path / "c" / "index.parquet")
    assert np.all(index.column("text_bytes").to_numpy() == index.column("text_len").to_numpy() * 64 * 2)


def test_wan_encoder_identities_digest_what_the_encoders_read(tmp_path):
    """vae.kind=wan2.1 given as Wan's checkpoint file is identified by that file's bytes, not by
    its path alone; text.kind=umt5 given as a whole diffusers Wan folder by its text_encoder/ and
    tokenizer/ only (its transformer may be fine-tuned without touching the cache)."""
    from videodit.data.feature_cache.format import encoder_identity

    wan = tmp_path / "Wan2.1-T2V-1.3B-Diffusers"
    for name, data in {"Wan2.1_VAE.pth": b"vae", "text_encoder/config.json": b"{}",
                       "text_encoder/model.safetensors": b"t5", "tokenizer/tokenizer.json": b"{}",
                       "transformer/diffusion_pytorch_model.safetensors": b"dit"}.items():
        (wan / name).parent.mkdir(parents=True, exist_ok=True)
        (wan / name).write_bytes(data)

    def identity():
        cfg = load_config("tiny", ["model.preset=wan-tiny", "vae.kind=wan2.1", f"vae.path={wan / 'Wan2.1_VAE.pth'}",
                                   "text.kind=umt5", f"text.path={wan}", "text.max_length=512"])
        return encoder_identity(cfg)

    first = identity()
    assert first["vae"]["weights"] and first["text"]["weights"]
    (wan / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"fine-tuned")
    assert identity() == first
    (wan / "Wan2.1_VAE.pth").write_bytes(b"another vae")
    (wan / "text_encoder" / "model.safetensors").write_bytes(b"another t5")
    second = identity()
    assert second["vae"]["weights"] != first["vae"]["weights"]
    assert second["text"]["weights"] != first["text"]["weights"]


# --------------------------------------------------------------------------- damaged shards


@pytest.fixture(scope="module")
def clean_cache(toy_dir, tmp_path_factory):
    """A checksummed fp32 cache of 4 shards (54 toy clips, 16 a shard)."""
    out = tmp_path_factory.mktemp("clean") / "c"
    build_cache(config(toy_dir), out, shard_size=16, dtype="fp32", log=quiet)
    return out


def strip_checksums(folder):
    """Make ``folder`` a cache as built before checksums: no records in its Parquet files."""
    for path in [folder / "index.parquet", *(folder / "shards").glob("*.parquet")]:
        pq.write_table(pq.read_table(path).replace_schema_metadata(None), path)


def read_all(folder):
    cache = FeatureCache(folder)
    for row in range(len(cache)):
        cache.tensors(row)
    return cache


@pytest.mark.parametrize("how,old", [("flipped", False), ("header", False), ("header", True)],
                         ids=["flipped-bytes", "header-shapes", "header-shapes-old-cache"])
def test_a_damaged_shard_is_refused_in_one_line_at_its_first_read(clean_cache, tmp_path, how, old):
    folder = tmp_path / "c"
    shutil.copytree(clean_cache, folder)
    if old:
        strip_checksums(folder)
    read_all(folder)   # intact: every sample reads
    damage_shard(folder, how, shard=1)
    with pytest.raises(UserError) as raised:
        read_all(folder)
    message = str(raised.value)
    assert "\n" not in message and "shard-00001.safetensors is damaged" in message
    assert f"videodit cache build CONFIG --out {folder}" in message
    assert ("SHA-256" in message) if how == "flipped" else ("the index says F32 [3, 4, 16, 16]" in message)


def test_shards_are_checked_once_per_process(clean_cache, monkeypatch):
    import videodit.data.feature_cache.verify as verify

    hashed = []
    real = verify._sha256_file
    monkeypatch.setattr(verify, "_sha256_file", lambda path: (hashed.append(path.name), real(path))[1])
    cache = read_all(clean_cache)
    for row in range(len(cache)):
        cache.tensors(row)
    assert sorted(hashed) == [f"shard-0000{s}.safetensors" for s in range(4)]


@pytest.mark.parametrize("how", ["flipped", "header"])
def test_cache_info_reports_damaged_shards(clean_cache, tmp_path, capsys, how):
    folder = tmp_path / "c"
    shutil.copytree(clean_cache, folder)
    assert main(["cache", "info", str(folder), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["checksums"] and info["shards_checked"] == 4 and info["damaged"] == []
    damage_shard(folder, how, shard=2)
    damage_shard(folder, "flipped", shard=3)
    assert main(["cache", "info", str(folder), "--json"]) == 1   # damage: non-zero, for scripts
    info = json.loads(capsys.readouterr().out)
    assert [d["shard"] for d in info["damaged"]] == [2, 3]
    assert main(["cache", "info", str(folder)]) == 1
    text = capsys.readouterr().out
    assert "DAMAGED: 2 of 4 shard(s)" in text and "shard-00002.safetensors" in text and "shard-00003" in text
    assert f"--out {folder}" in text


def test_cache_info_says_a_cache_of_before_checksums_is_not_verified(clean_cache, tmp_path, capsys):
    folder = tmp_path / "c"
    shutil.copytree(clean_cache, folder)
    strip_checksums(folder)
    assert main(["cache", "info", str(folder)]) == 0
    text = capsys.readouterr().out
    assert "not verified by checksum" in text and "none damaged" in text
    damage_shard(folder, "header", shard=1)
    assert main(["cache", "info", str(folder), "--json"]) == 1
    info = json.loads(capsys.readouterr().out)
    assert not info["checksums"] and [d["shard"] for d in info["damaged"]] == [1]


@pytest.mark.parametrize("how", ["flipped", "header"])
def test_a_build_into_the_same_out_redoes_damaged_shards(toy_dir, clean_cache, tmp_path, how, monkeypatch):
    folder = tmp_path / "c"
    shutil.copytree(clean_cache, folder)
    damage_shard(folder, how, shard=1)
    redone, lines = [], []
    real_write = ShardWriter.write
    monkeypatch.setattr(ShardWriter, "write", lambda self: (redone.append(self.shard), real_write(self)))
    build_cache(config(toy_dir), folder, shard_size=16, dtype="fp32", log=lambda *a, **k: lines.append(a[0]))
    assert redone == [1]
    assert any("1 damaged shard(s) removed, to encode again: 1" in line for line in lines)
    assert files(folder) == files(clean_cache)   # repaired byte for byte
    read_all(folder)
