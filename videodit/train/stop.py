"""Stop signals: SIGTERM / SIGINT end a run cleanly, even one blocked reading its data.

A signal asks the loop to stop after the current step; the loop then saves. If the loop is
instead waiting for its next batch and that read does not come back within ``grace_s`` (a hung
network mount, a stuck decoder), the wait is broken off (:class:`StoppedWaitingForData`) and
the run ends without saving: nothing is half-updated there, the last checkpoint stays as it
was and ``resume=auto`` goes on from it. (Saving there would not be exact: some micro-batches
of the next step may already have been taken from the sampler.) A second signal ends at once.

The escalation is a watchdog thread's, since a Python handler runs only when the main thread
returns to the interpreter. The C-level handler writes every signal to ``signal.set_wakeup_fd``,
so the watchdog sees it even then. After ``grace_s`` in one data wait it re-sends the signal to
the main thread (which breaks a blocking system call, and the handler raises); after another
``grace_s`` with the main thread still stuck in C code that released the GIL (blocking I/O does),
it ends the process with exit status 128 + signal. (Code that holds the GIL stops the watchdog
too; nothing in Python can end that but SIGKILL.) Forked children (DataLoader workers) point the
wakeup descriptor at /dev/null as they start, so a signal sent to a worker alone does not reach
this watchdog (one landing inside ``fork()`` itself still can).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_SIGNAL_NUMBERS = {int(sig) for sig in _SIGNALS}
DATA_WAIT_GRACE_S = 10.0   # how long a data wait may go on after a stop signal


class StoppedWaitingForData(KeyboardInterrupt):
    """A stop signal arrived while the loop waited for a batch: end now, without saving. The CLI
    exits with ``exit_status`` (128 + the signal)."""

    def __init__(self, name: str):
        super().__init__(name)
        self.exit_status = 128 + int(signal.Signals[name])


def _drop_wakeup_in_child() -> None:
    """In a forked child: the parent's wakeup descriptor is not the child's to write. Its number
    is pointed at /dev/null (closing it could let another file take the number and receive the
    signal bytes; ``set_wakeup_fd`` cannot be called this early in a child)."""
    if _owner is not None and os.getpid() != _owner[0]:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, _owner[1])
        os.close(null)


_owner: tuple[int, int] | None = None   # (pid, wakeup fd) of the StopSignals that owns the descriptor
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_wakeup_in_child)


class StopSignals:
    """SIGTERM / SIGINT ask the loop to stop after the current step (then it saves); a data wait
    (:meth:`waiting_for_data`) that outlasts ``grace_s`` after one is broken off."""

    def __init__(self, grace_s: float | None = None):
        self.requested: str | None = None
        self.grace_s = DATA_WAIT_GRACE_S if grace_s is None else grace_s
        self._previous: dict = {}
        self._waiting_since: float | None = None   # monotonic time the current data wait began
        self._wakeup = None            # (read end, write end) of the watchdog's socket pair
        self._previous_wakeup_fd = -1
        self._resent = False           # the watchdog re-sent the signal (not a user's second one)

    def __enter__(self):
        for sig in _SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:   # not the main thread: leave signals alone
                return self
        self._start_watchdog()
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._wakeup is not None:
            global _owner
            _owner = None
            signal.set_wakeup_fd(self._previous_wakeup_fd)
            self._wakeup[1].close()    # the watchdog's read returns empty and it ends
            self._wakeup = None

    @contextmanager
    def waiting_for_data(self):
        """Mark a wait for the next batch, which the watchdog may break off after a stop signal."""
        self._waiting_since = time.monotonic()
        try:
            yield
        finally:
            self._waiting_since = None

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.requested:   # a second signal (or the watchdog's): stop now
            if self._waiting_since is not None:
                raise StoppedWaitingForData(self.requested)
            if self._resent:   # the watchdog's, landing after the wait ended: the step finishes, then saves
                self._resent = False
                return
            raise KeyboardInterrupt
        self.requested = name

    def _start_watchdog(self) -> None:
        read_end, write_end = socket.socketpair()
        write_end.setblocking(False)
        try:
            self._previous_wakeup_fd = signal.set_wakeup_fd(write_end.fileno(), warn_on_full_buffer=False)
        except ValueError:   # not the main thread after all
            read_end.close()
            write_end.close()
            return
        self._wakeup = (read_end, write_end)
        global _owner
        _owner = (os.getpid(), write_end.fileno())
        threading.Thread(target=self._watch, args=(read_end,), name="videodit-stop-watchdog", daemon=True).start()

    def _watch(self, read_end: socket.socket) -> None:
        """After a stop signal, escalate once the loop has sat in one data wait for ``grace_s``."""
        signalled, since_signal, resent = None, 0.0, False
        read_end.settimeout(0.1)
        with read_end:
            while True:
                try:
                    got = read_end.recv(16)
                    if not got:   # the signals were handed back
                        return
                    if signalled is None and any(byte in _SIGNAL_NUMBERS for byte in got):
                        signalled = signal.Signals(next(b for b in got if b in _SIGNAL_NUMBERS))
                        since_signal = time.monotonic()
                except socket.timeout:
                    pass
                except OSError:
                    return
                since = self._waiting_since
                if signalled is None or since is None:
                    continue
                waited = time.monotonic() - max(since, since_signal)
                if not resent and waited > self.grace_s:
                    resent = self._resent = True   # breaks a blocking call; the handler then raises
                    signal.pthread_kill(threading.main_thread().ident, signalled)
                elif waited > 2 * self.grace_s:
                    self._end(signalled)

    def _end(self, sig: signal.Signals) -> None:
        print(f"stopping on {sig.name}: the read of the next batch did not return within {2 * self.grace_s:g} s; "
              "ending without saving (the last checkpoint is intact; resume with resume=auto)",
              file=sys.stderr, flush=True)
        os._exit(128 + int(sig))
