"""A feature cache abused as a careless user or an attacker would (issue #28): two builds into
one folder, a damaged index or manifest, shards swapped, a full disk during the build, a FIFO
(socket, device) where a cache file belongs. Each ends in one ``error:`` line, exit status 2,
the cache folder as it was, and no hang; ``cache build`` into the same folder repairs what it
can. (Damaged shard bytes and headers: tests/data/test_feature_cache.py.)"""

import errno
import json
import os
import socket
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import tiny_overrides
from videodit.cache import build_cache
from videodit.cli import main
from videodit.config import load_config
from videodit.data.feature_cache import FeatureCache
from videodit.data.feature_cache.lock import process_start_tick
from videodit.data.feature_cache.writer import ShardWriter
from videodit.errors import UserError


def quiet(*args, **kwargs):
    pass


def snapshot(folder):
    """Relative path -> bytes (or the kind of a special file) of everything under ``folder``,
    hidden files included."""
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_symlink():
            out[str(path.relative_to(folder))] = "-> " + os.readlink(path)
        elif path.is_file():
            out[str(path.relative_to(folder))] = path.read_bytes()
        elif not path.is_dir():
            out[str(path.relative_to(folder))] = "special"
    return out


def overrides(data, **extra):
    return tiny_overrides(data, **extra)


def build(data, out, **kw):
    cfg = load_config("tiny", overrides(data, **{k: v for k, v in kw.items() if "." in k}))
    build_cache(cfg, out, log=quiet, **{k: v for k, v in kw.items() if "." not in k})
    return out


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: ") and "Traceback" not in err, err
    return err


def refused(capsys, argv) -> str:
    """Run the command line; it must end in one error line and exit status 2."""
    capsys.readouterr()
    assert main(argv) == 2
    return one_line_error(capsys)


def train_argv(data, cache, run):
    return ["train", "tiny", *overrides(data, **{"data.cache": str(cache), "train.max_steps": 1}), "--out", str(run)]


@pytest.fixture(scope="module")
def clean(toy_dir, tmp_path_factory):
    """A checksummed bf16 cache of the 54 toy clips in 4 shards of 16."""
    return build(toy_dir, tmp_path_factory.mktemp("clean") / "c", shard_size=16)


@pytest.fixture
def cache(clean, tmp_path):
    import shutil

    shutil.copytree(clean, tmp_path / "c")
    return tmp_path / "c"


def strip_checksums(folder):
    """``folder`` as a cache built before checksums: no records in its Parquet files."""
    for path in [folder / "index.parquet", *(folder / "shards").glob("*.parquet")]:
        pq.write_table(pq.read_table(path).replace_schema_metadata(None), path)


# --------------------------------------------------------------------------- two builds, one folder


def test_a_second_build_into_the_same_out_is_refused_while_the_first_runs(toy_dir, clean, tmp_path, capsys,
                                                                            monkeypatch):
    """The second build refuses in one line naming the first (this process: it runs inside the
    first's shard write), touches nothing, and the first finishes as if alone."""
    out = tmp_path / "c"
    real_write, seen = ShardWriter.write, []

    def write_then_race(self):
        if self.shard == 1 and not seen:
            before = snapshot(out)
            assert ".lock" in before
            seen.append(refused(capsys, ["cache", "build", "tiny", *overrides(toy_dir), "--out", str(out),
                                         "--shard-size", "16"]))
            assert snapshot(out) == before
        real_write(self)

    monkeypatch.setattr(ShardWriter, "write", write_then_race)
    build(toy_dir, out, shard_size=16)
    assert f"--out {out} is being built by another `videodit cache build` (process {os.getpid()}," in seen[0]
    assert f"remove {out / '.lock'} if that build is gone" in seen[0]
    assert snapshot(out) == snapshot(clean)   # finished as if alone, and its lock released


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


@pytest.mark.parametrize("holder", ["dead", "reused-pid", "crashed-while-writing", "alive", "other-host"])
def test_a_stale_build_lock_is_taken_over_and_a_live_one_refused(toy_dir, clean, tmp_path, capsys, holder):
    out = tmp_path / "c"
    out.mkdir()
    lock = out / ".lock"
    sleeper = None
    if holder == "crashed-while-writing":
        lock.write_text('{"pid": 12')
        os.utime(lock, (0, 0))   # long ago: not a lock being written this instant
    else:
        if holder == "alive":
            sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        pid = {"dead": _dead_pid(), "alive": sleeper and sleeper.pid}.get(holder, os.getpid())
        host = "elsewhere.example" if holder == "other-host" else socket.gethostname()
        # "reused-pid": a live process id (ours), but another start tick than the lock's process had.
        tick = process_start_tick(pid) if holder == "alive" else 1
        lock.write_text(json.dumps({"pid": pid, "host": host, "tick": tick, "started": "2026-01-01T00:00:00"}))
    try:
        argv = ["cache", "build", "tiny", *overrides(toy_dir), "--out", str(out), "--shard-size", "16"]
        if holder in ("alive", "other-host"):
            before = snapshot(out)
            message = refused(capsys, argv)
            assert "is being built by another `videodit cache build`" in message
            assert (f"process {sleeper.pid}," if sleeper else "on elsewhere.example") in message
            assert snapshot(out) == before
        else:
            assert main(argv) == 0
            assert snapshot(out) == snapshot(clean)   # taken over, built, released
    finally:
        if sleeper:
            sleeper.kill()
            sleeper.wait()


# --------------------------------------------------------------------------- index and manifest


def _deep_manifest(folder):
    (folder / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)


def _rewrite_index(folder, change):
    pq.write_table(change(pq.read_table(folder / "index.parquet")), folder / "index.parquet")


def _edit_manifest(folder, change):
    manifest = json.loads((folder / "manifest.json").read_text())
    change(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))


DAMAGE = {
    "index: random bytes": (lambda f: (f / "index.parquet").write_bytes(os.urandom(5000)), "index.parquet is damaged"),
    "index: a text file": (lambda f: (f / "index.parquet").write_text("clip,view\n1,0\n"), "not a Parquet file"),
    "index: another table": (lambda f: pq.write_table(pa.table({"a": [1]}), f / "index.parquet"),
                             "no column 'clip'"),
    "index: a shard beyond the manifest": (
        lambda f: _rewrite_index(f, lambda t: t.set_column(3, "shard", pa.array([99] * len(t), pa.int32()))),
        "column 'shard' holds 99, outside 0..3"),
    "index: checksums not JSON": (
        lambda f: _rewrite_index(f, lambda t: t.replace_schema_metadata({b"videodit.shards": b"[[["})),
        "its shard checksums cannot be read"),
    "failed.parquet: random bytes": (lambda f: (f / "failed.parquet").write_bytes(os.urandom(300)),
                                     "failed.parquet is damaged"),
    "manifest: nested 100,000 deep": (_deep_manifest, "nested too deeply"),
    "manifest: not JSON": (lambda f: (f / "manifest.json").write_text("{not json"), "manifest.json cannot be read"),
    "manifest: a list": (lambda f: (f / "manifest.json").write_text("[1, 2]"), "not a version-1"),
    "manifest: no latent shapes": (lambda f: _edit_manifest(f, lambda m: m["latent"].pop("shapes")),
                                   "no latent.shapes"),
    "manifest: a string for a size": (lambda f: _edit_manifest(f, lambda m: m["source"].update(rows="54")),
                                      "source.rows is str, not int"),
    "manifest: 10^12 clips": (lambda f: _edit_manifest(f, lambda m: m["source"].update(rows=10**12)),
                              "more than a cache holds"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_index_or_manifest_ends_info_and_training_in_one_line(toy_dir, clean, cache, tmp_path, capsys,
                                                                        damage):
    how, expected = DAMAGE[damage]
    how(cache)
    before = snapshot(cache)
    for argv in (["cache", "info", str(cache)], train_argv(toy_dir, cache, tmp_path / "run")):
        if damage.startswith("failed") and argv[0] == "train":
            assert main(argv) == 0   # training does not read the list of unreadable videos
            continue
        message = refused(capsys, argv)
        assert expected in message, message
        assert "cache build CONFIG --out" in message   # the fix
    assert snapshot(cache) == before
    if damage.startswith(("index", "failed")):   # the build writes a damaged index again
        assert main(["cache", "build", "tiny", *overrides(toy_dir), "--out", str(cache), "--shard-size", "16"]) == 0
        assert snapshot(cache) == snapshot(clean)


# --------------------------------------------------------------------------- swapped shards


def _swap(a, b):
    tmp = a.with_name("swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


# Where shard 1 comes from, and what finds it: the header check against the index (the tensor
# names, dtype or shapes), or only the checksum (the same names, shapes and size: other values).
SWAPS = {"another shard of the cache": ({}, "its tensors are not the index's"),
         "the same shard of a bf16 build": ({"dtype": "bf16"}, "is BF16 [3, 4, 16, 16], the index says F32"),
         "the same shard of an 8x8 build": ({"data.height": 8, "data.width": 8},
                                            "is F32 [3, 4, 8, 8], the index says F32 [3, 4, 16, 16]"),
         "the same shard of a build of another seed": ({"train.seed": 1}, "its SHA-256 is not the one recorded")}


@pytest.mark.parametrize("checksums", [True, False], ids=["checksummed", "built-before-checksums"])
@pytest.mark.parametrize("source", list(SWAPS))
def test_a_shard_from_elsewhere_is_named_in_one_line(toy_dir, tmp_path, source, checksums):
    change, found_by = SWAPS[source]
    folder = build(toy_dir, tmp_path / "c", shard_size=16, dtype="fp32")
    if source == "another shard of the cache":
        _swap(folder / "shards" / "shard-00001.safetensors", folder / "shards" / "shard-00002.safetensors")
    else:
        other = build(toy_dir, tmp_path / "other", shard_size=16, **{"dtype": "fp32", **change})
        _swap(folder / "shards" / "shard-00001.safetensors", other / "shards" / "shard-00001.safetensors")
    if not checksums:
        strip_checksums(folder)
    cache = FeatureCache(folder)
    if not checksums and "seed" in source:   # the same names, shapes and dtype: only a checksum can tell
        cache.tensors(20)
        return
    with pytest.raises(UserError) as raised:
        for row in range(len(cache)):
            cache.tensors(row)
    message = str(raised.value)
    assert "\n" not in message and "shard-00001.safetensors is damaged" in message
    # With checksums the size check can speak first (a bf16 shard is smaller); without, the header check.
    assert found_by in message or (checksums and "bytes, " in message), message


def test_training_on_a_cache_with_shards_swapped_between_buckets_ends_in_one_line(mixed_toy, tmp_path, capsys):
    buckets = "{'24px': {1: [1.0, 4], 4: [1.0, 4]}, '16px': {1: [1.0, 4], 4: [1.0, 4]}}"
    folder = build(mixed_toy, tmp_path / "c", shard_size=8, **{"data.bucket_config": buckets})
    _swap(folder / "shards" / "shard-00000.safetensors", folder / "shards" / "shard-00003.safetensors")
    before = snapshot(folder)
    argv = ["train", "tiny", *overrides(mixed_toy, **{"data.cache": str(folder), "data.bucket_config": buckets,
                                                      "train.max_steps": 1000}), "--out", str(tmp_path / "run")]
    message = refused(capsys, argv)
    assert "is damaged" in message and ("shard-00000" in message or "shard-00003" in message), message
    assert snapshot(folder) == before


# --------------------------------------------------------------------------- a full disk


@pytest.mark.parametrize("victim", ["manifest.json", "shard-00001.safetensors", "shard-00002.parquet",
                                    "index.parquet"])
def test_a_full_disk_during_the_build_leaves_no_temporary_file(toy_dir, clean, tmp_path, capsys, monkeypatch,
                                                               victim):
    """The write of ``victim`` fails half-way with ENOSPC: one line naming the file, no temporary
    file and no lock left; the same build run again finishes the cache byte for byte."""
    import builtins

    import videodit.data.feature_cache.format as fmt

    class FullDisk:
        def __init__(self, handle):
            self.handle = handle

        def write(self, data):
            self.handle.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name):
            return getattr(self.handle, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

    def full_for_victim(path, mode="r", *args, **kwargs):
        handle = builtins.open(path, mode, *args, **kwargs)
        return FullDisk(handle) if "w" in mode and f".{victim}.tmp-" in str(path) else handle

    monkeypatch.setattr(fmt, "open", full_for_victim, raising=False)
    out = tmp_path / "c"
    argv = ["cache", "build", "tiny", *overrides(toy_dir), "--out", str(out), "--shard-size", "16"]
    message = refused(capsys, argv)
    assert "No space left on device" in message and victim in message and "free space" in message, message
    assert not [p.name for p in out.rglob("*") if ".tmp-" in p.name or p.name == ".lock"]
    monkeypatch.undo()
    assert main(argv) == 0
    assert snapshot(out) == snapshot(clean)


# --------------------------------------------------------------------------- FIFOs, sockets, devices


def _special(path, kind):
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path.symlink_to("/dev/zero")
    else:   # a listening socket, bound by a relative name (socket paths are short)
        cwd = os.getcwd()
        os.chdir(path.parent)
        try:
            server = socket.socket(socket.AF_UNIX)
            server.bind(path.name)
            server.listen()
            _special.keep = server
        finally:
            os.chdir(cwd)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("target,kind", [
    ("shards/shard-00001.safetensors", "fifo"), ("shards/shard-00001.safetensors", "socket"),
    ("shards/shard-00001.safetensors", "device"), ("shards/shard-00001.safetensors", "fifo-before-checksums"),
    ("index.parquet", "fifo"), ("failed.parquet", "fifo"), ("manifest.json", "fifo"), ("manifest.json", "device")])
def test_a_fifo_socket_or_device_in_a_cache_is_refused_without_blocking(toy_dir, clean, cache, tmp_path, capsys,
                                                                        target, kind):
    if kind.endswith("before-checksums"):
        strip_checksums(cache)   # no recorded size to differ: the header read itself must not block
    _special(cache / target, kind.split("-")[0])
    named = {"fifo": "a FIFO", "socket": "a socket", "device": "a character device"}[kind.split("-")[0]]
    before = snapshot(cache)
    train = train_argv(toy_dir, cache, tmp_path / "run")
    if target.startswith("shards/"):
        assert main(["cache", "info", str(cache)]) == 1   # reported as damaged, not read
        assert f"shard-00001.safetensors: it is not a regular file but {named}" in capsys.readouterr().out
        message = refused(capsys, train)
        assert f"shard-00001.safetensors is damaged (it is not a regular file but {named})" in message, message
    else:
        for argv in (["cache", "info", str(cache)], train):
            if target == "failed.parquet" and argv is train:
                assert main(argv) == 0   # training does not read the list of unreadable videos
                continue
            message = refused(capsys, argv)
            assert f"{target} is" in message and f"not a regular file but {named}" in message, message
    assert snapshot(cache) == before
    if target != "manifest.json":   # the build replaces what is not a regular file
        assert main(["cache", "build", "tiny", *overrides(toy_dir), "--out", str(cache), "--shard-size", "16"]) == 0
        if not kind.endswith("before-checksums"):
            assert snapshot(cache) == snapshot(clean)
