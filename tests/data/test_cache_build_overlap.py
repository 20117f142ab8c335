"""The cache build overlaps its stages: DataLoader workers decode, this process encodes, and a
thread writes finished shards (``feature_cache/background.py``). What it writes is byte for byte
the files of a build without the thread; its errors are the same one-line errors; it never runs
ahead of the disk by more than its queue, and nothing is written after the build returns."""

import errno
import os
import threading
import time

import pytest

from conftest import tiny_overrides
from videodit.cache import build_cache
from videodit.config import load_config
from videodit.data.feature_cache.background import ShardWriterThread
from videodit.data.feature_cache.writer import ShardWriter


def quiet(*args, **kwargs):
    pass


def snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def build(data, out, workers=0, **kw):
    cfg = load_config("tiny", tiny_overrides(data, **{"data.num_workers": workers}))
    return build_cache(cfg, out, log=quiet, shard_size=16, **kw)


class FakeShard:
    """Stands in for a ShardWriter: records where and in which order it was written."""

    def __init__(self, shard, log, fail=None, hold=None):
        self.shard, self.log, self.fail, self.hold = shard, log, fail, hold

    def write(self):
        if self.hold is not None:
            assert self.hold.wait(timeout=30)
        if self.fail is not None:
            raise self.fail
        self.log.append((self.shard, threading.current_thread().name))


# --------------------------------------------------------------------------- the thread alone


def test_shards_are_written_in_order_on_the_writer_thread():
    log = []
    writer = ShardWriterThread()
    for shard in range(5):
        writer.submit(FakeShard(shard, log))
    writer.close()
    assert log == [(shard, "cache-shard-writer") for shard in range(5)] and writer.written == 5
    writer.close()   # idempotent


def test_the_threads_error_is_raised_in_the_builder_as_it_is_and_nothing_is_written_after_it():
    log, full = [], OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "shard-00001.safetensors")
    writer = ShardWriterThread(depth=4)
    writer.submit(FakeShard(0, log))
    writer.submit(FakeShard(1, log, fail=full))
    writer.submit(FakeShard(2, log))
    with pytest.raises(OSError) as info:
        writer.close()
    assert info.value is full and log == [(0, "cache-shard-writer")]
    writer.close(abort=True)   # the finally of a build: quiet, already joined

    writer = ShardWriterThread()   # an error found by the next submit
    writer.submit(FakeShard(0, log, fail=full))
    deadline = time.monotonic() + 30
    with pytest.raises(OSError):
        while time.monotonic() < deadline:
            writer.submit(FakeShard(9, log))
            time.sleep(0.01)
    writer.close(abort=True)
    assert (9, "cache-shard-writer") not in log


def test_abort_finishes_the_shard_being_written_drops_the_queued_and_joins():
    log, hold = [], threading.Event()
    writer = ShardWriterThread(depth=2)
    writer.submit(FakeShard(0, log, hold=hold))   # being written, held
    writer.submit(FakeShard(1, log))
    writer.submit(FakeShard(2, log))
    threading.Timer(0.2, hold.set).start()
    writer.close(abort=True)
    assert log == [(0, "cache-shard-writer")] and not writer._thread.is_alive()


def test_the_builder_runs_at_most_depth_shards_ahead_of_the_disk():
    log, hold = [], threading.Event()
    writer = ShardWriterThread(depth=1)
    writer.submit(FakeShard(0, log, hold=hold))   # taken by the thread, held
    time.sleep(0.1)
    writer.submit(FakeShard(1, log))              # waits in the queue
    third = threading.Thread(target=writer.submit, args=(FakeShard(2, log),))
    third.start()
    time.sleep(0.3)
    assert third.is_alive()   # blocked: one shard being written, one waiting
    hold.set()
    third.join(timeout=30)
    writer.close()
    assert [s for s, _ in log] == [0, 1, 2]


# --------------------------------------------------------------------------- in a build


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shard_is_written_while_the_next_is_encoded_and_the_files_are_unchanged(toy_dir, tmp_path,
                                                                                 monkeypatch, workers):
    """Shard 0's write waits until samples of shard 1 have been encoded: only an overlapping build
    gets past it (a build that wrote in line would stop at the 30 s wait and fail)."""
    reference = build(toy_dir, tmp_path / "reference", workers)   # the files a build writes
    real_write, real_add = ShardWriter.write, ShardWriter.add
    shard1_encoded, threads = threading.Event(), set()

    def add(self, *args, **kwargs):
        real_add(self, *args, **kwargs)
        if self.shard == 1:
            shard1_encoded.set()

    def write(self):
        threads.add(threading.current_thread().name)
        if self.shard == 0:
            assert shard1_encoded.wait(timeout=30), "shard 1 was not encoded while shard 0 was written"
        real_write(self)

    monkeypatch.setattr(ShardWriter, "add", add)
    monkeypatch.setattr(ShardWriter, "write", write)
    done = build(toy_dir, tmp_path / "overlapped", workers)
    assert threads == {"cache-shard-writer"} and done["encoded"] == reference["encoded"]
    assert snapshot(tmp_path / "overlapped") == snapshot(tmp_path / "reference")
