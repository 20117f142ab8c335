"""A stop signal ends a run that is blocked reading its data, with its last checkpoint intact."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from conftest import tiny_overrides
from videodit.config import load_config
from videodit.train import Trainer
from videodit.train import stop as stop_module
from videodit.train.stop import StopSignals, StoppedWaitingForData


def _signal_soon(delay: float = 0.1) -> None:
    threading.Timer(delay, os.kill, (os.getpid(), signal.SIGTERM)).start()


@pytest.mark.parametrize("read_s, broken_off", [(0.3, False), (60.0, True)])
def test_a_data_wait_is_broken_off_only_when_it_outlasts_the_grace(read_s, broken_off):
    """A read that returns within the grace finishes (the loop then saves); one that does not
    is broken off within about the grace, not after the read."""
    started, previous = time.monotonic(), signal.getsignal(signal.SIGTERM)
    with StopSignals(grace_s=1.0) as stop:
        _signal_soon()
        if broken_off:
            with pytest.raises(StoppedWaitingForData, match="SIGTERM"):
                with stop.waiting_for_data():
                    time.sleep(read_s)
        else:
            with stop.waiting_for_data():
                time.sleep(read_s)
    assert stop.requested == "SIGTERM"
    assert time.monotonic() - started < 10
    assert signal.getsignal(signal.SIGTERM) is previous   # handed back


def test_a_main_thread_stuck_where_no_handler_runs_is_ended_by_the_watchdog(tmp_path):
    """Signals blocked in the main thread stand in for a read stuck in C code: the Python handler
    never runs, and the watchdog ends the process with 128 + SIGTERM after twice the grace."""
    script = textwrap.dedent("""
        import os, signal, threading, time
        from videodit.train.stop import StopSignals
        with StopSignals(grace_s=0.3) as stop:
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])   # the handler can never run
            with stop.waiting_for_data():
                print("waiting", flush=True)
                time.sleep(60)
        print("not reached", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "waiting"
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert time.monotonic() - started < 15
    assert "not reached" not in out
    assert "the last checkpoint is intact" in err and "Traceback" not in err


def test_sigterm_ends_a_run_blocked_in_its_data_and_keeps_its_last_checkpoint(toy_dir, tmp_path, monkeypatch,
                                                                                capsys):
    monkeypatch.setattr(stop_module, "DATA_WAIT_GRACE_S", 0.5)
    cfg = load_config("tiny", tiny_overrides(toy_dir, **{"train.max_steps": 50, "checkpoint.every_steps": 2}))
    trainer = Trainer(cfg, tmp_path / "run")
    batches = trainer.batches

    def hanging_after_three_steps():
        for index, batch in enumerate(batches()):
            if index == 3:   # the step-2 checkpoint is written; now the data source hangs
                _signal_soon(0.2)
                time.sleep(3600)
            yield batch

    monkeypatch.setattr(trainer, "batches", hanging_after_three_steps)
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    assert time.monotonic() - started < 120
    err = capsys.readouterr().err
    assert "while waiting for data after step 3, without saving" in err
    assert "step-0000002 is intact" in err
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert checkpoints == ["step-0000002"]
    assert not (tmp_path / "run" / ".lock").exists()


def test_a_signal_to_a_forked_worker_never_reaches_the_parents_watchdog():
    """DataLoader workers are forked: a SIGTERM sent to one alone must not stop the parent."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    with StopSignals(grace_s=0.2) as stop:
        worker = context.Process(target=time.sleep, args=(30,))
        worker.start()
        time.sleep(0.3)   # past the fork (a signal inside fork() itself still reaches the parent's descriptor)
        worker.terminate()
        worker.join(5)
        with stop.waiting_for_data():
            time.sleep(0.8)   # a healthy wait, longer than the grace
        worker.kill()   # it ignored SIGTERM: it inherited the loop's handler
    assert stop.requested is None


def test_the_watchdogs_resent_signal_after_the_wait_ended_does_not_interrupt_the_step():
    with StopSignals(grace_s=5.0) as stop:
        stop.requested, stop._resent = "SIGTERM", True   # as if the watchdog re-sent just as the wait ended
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)   # the handler runs here, outside any data wait: no KeyboardInterrupt
    assert stop.requested == "SIGTERM" and not stop._resent
