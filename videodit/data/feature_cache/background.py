"""Writing finished shards on a thread, so that a cache build decodes and encodes the next shard
while the last one is serialised, hashed, fsynced and renamed (``ShardWriter.write``).

``submit`` hands a filled ``ShardWriter`` over (the builder never touches it again) and blocks
while ``depth`` shards already wait: the build runs at most that far ahead of the disk, and holds
at most ``depth + 2`` shards in memory (one being filled, ``depth`` waiting, one being written).
The thread's time goes to hashing and to the disk, both of which release the GIL, so it costs the
encoding thread little.

Errors: the thread stops writing at its first error and keeps it; the next ``submit`` or ``close``
raises that same exception in the building thread, so a full disk is still the one-line ``OSError``
the CLI words, and nothing is written after it. ``close`` always joins the thread: no write runs
after the build returns and releases its lock (``lock.py``). Each file is written under a temporary
name and renamed (``format.atomic_write_bytes``) and a shard is finished only when its index part
exists, so a build stopped at any moment leaves whole shards and no partial one.
"""

from __future__ import annotations

import queue
import threading
import time

from videodit.data.feature_cache.writer import ShardWriter

_DONE = object()   # the queue's end marker


class ShardWriterThread:
    """A thread that writes the shards it is handed, in order, one at a time."""

    def __init__(self, depth: int = 1):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None   # the thread's first error, until raised here
        self._failed = False     # once set, nothing more is written
        self._dropping = False   # after an abort: skip what is still queued
        self._closed = False
        self.written = 0
        self.write_seconds = 0.0   # time spent in ShardWriter.write, for progress and benchmarks
        self._thread = threading.Thread(target=self._run, name="cache-shard-writer", daemon=True)
        self._thread.start()

    def submit(self, writer: ShardWriter) -> None:
        """Queue ``writer``'s shard; raises the thread's error, if it had one."""
        self._raise_error()
        self._queue.put(writer)   # never blocks for good: after an error the thread only drains

    def close(self, *, abort: bool = False) -> None:
        """Wait for the queued shards to be written (``abort``: drop them; the one being written
        is finished) and for the thread to end; then raise its error, unless aborting. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._dropping = abort
        self._queue.put(_DONE)
        self._thread.join()
        if not abort:
            self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None   # raised once: a later close() stays quiet
            raise error

    def _run(self) -> None:
        while True:
            writer = self._queue.get()
            if writer is _DONE:
                return
            if self._failed or self._dropping:
                continue
            started = time.perf_counter()
            try:
                writer.write()
            except BaseException as exc:   # noqa: BLE001 -- handed to the building thread as it is
                self._error, self._failed = exc, True
            else:
                self.written += 1
            self.write_seconds += time.perf_counter() - started
