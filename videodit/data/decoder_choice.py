"""Which library decodes videos, and on which device: ``data.decoder`` and ``data.decode_device``.

``resolve_decoder`` checks a config's choice once, where the data is built (a choice that cannot
work is one line naming the fix), and turns ``auto`` into what this machine has: torchcodec where
it loads (with its FFmpeg libraries), else PyAV. ``use_decoder`` makes the result this process's
choice; ``video.read_video`` reads it on every call, so callers keep their signatures. DataLoader
workers inherit it when forked; a spawned worker must call ``use_decoder`` itself (the cache build's
dataset carries its choice for that).

Either decoder returns the same frames for the same indices (docs/feature_cache.md, "Decoders");
files torchcodec cannot number exactly are read by PyAV whatever the choice
(``decode_torchcodec.py``).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

from videodit.errors import UserError

DECODERS = ("auto", "pyav", "torchcodec")
DECODE_DEVICES = ("cpu", "cuda")
INSTALL_TORCHCODEC = ("pip install 'videodit[torchcodec]' and FFmpeg's shared libraries, version 4 to 8 "
                      "(e.g. apt-get install ffmpeg)")


@dataclass(frozen=True)
class DecoderChoice:
    """A resolved choice: ``decoder`` is ``pyav`` or ``torchcodec``, never ``auto``."""

    decoder: str = "pyav"
    device: str = "cpu"


_current = DecoderChoice()


def use_decoder(choice: DecoderChoice) -> None:
    """Make ``choice`` the decoder of every ``read_video`` call in this process."""
    global _current
    _current = choice


def current_decoder() -> DecoderChoice:
    return _current


@contextlib.contextmanager
def using_decoder(choice: DecoderChoice):
    """``choice`` for the duration of a build, then the process's choice of before."""
    before = _current
    use_decoder(choice)
    try:
        yield choice
    finally:
        use_decoder(before)


def use_decoder_in_worker(choice: DecoderChoice, worker_id: int) -> None:
    """A DataLoader ``worker_init_fn`` (with ``functools.partial``): a spawned worker starts with
    the default choice, so it is handed the builder's."""
    use_decoder(choice)


def decoding_workers(decoder: DecoderChoice, num_workers: int) -> dict:
    """DataLoader arguments that give its workers ``decoder``. CUDA cannot start in a forked child
    of a process that uses it, so NVDEC workers are spawned, and a spawned worker is told the
    choice (a forked one inherits it)."""
    spawn = decoder.device == "cuda" and num_workers > 0
    return {"multiprocessing_context": "spawn" if spawn else None,
            "worker_init_fn": functools.partial(use_decoder_in_worker, decoder)}


@functools.lru_cache(maxsize=None)
def torchcodec_problem() -> str | None:
    """Why torchcodec cannot decode videos in this process (one phrase), or None when it can.

    torchcodec imports without FFmpeg (its image decoders need none) and says so in
    ``ffmpeg_major_version``; a wheel built for CUDA fails to import on a CPU-only PyTorch."""
    try:
        import torchcodec
        from torchcodec.decoders import VideoDecoder  # noqa: F401 -- the class this path uses
    except ImportError as exc:
        if getattr(exc, "name", None) == "torchcodec":
            return "torchcodec is not installed"
        return f"torchcodec does not import ({_first_line(exc)})"
    except Exception as exc:   # noqa: BLE001 -- an OSError from a shared library it links, most often
        return f"torchcodec does not load ({_first_line(exc)})"
    if getattr(torchcodec, "ffmpeg_major_version", 0) is None:
        return "torchcodec finds no FFmpeg shared libraries (libavcodec, libavformat, ...: FFmpeg 4 to 8)"
    return None


def _first_line(exc: BaseException) -> str:
    cause = exc.__cause__ or exc
    text = " ".join(str(cause).split()) or type(cause).__name__
    return text[:200]


def resolve_decoder(decoder: str = "auto", device: str = "cpu", *, notice=None,
                    cuda_available: bool | None = None) -> DecoderChoice:
    """``data.decoder`` / ``data.decode_device`` as this machine can honour them, or a one-line
    UserError naming the fix. ``auto`` falls back to PyAV when torchcodec does not load: silently
    when it is not installed, with one ``notice`` line when it is installed but cannot load."""
    if decoder not in DECODERS:
        raise UserError(f"data.decoder={decoder} is not one of {', '.join(DECODERS)}")
    if device not in DECODE_DEVICES:
        raise UserError(f"data.decode_device={device} is not one of {', '.join(DECODE_DEVICES)}")
    if device == "cuda":
        if decoder == "pyav":
            raise UserError("data.decode_device=cuda decodes with torchcodec (NVDEC) and data.decoder=pyav decodes "
                            "on the CPU only; set data.decoder=torchcodec (or auto), or data.decode_device=cpu")
        if cuda_available is None:
            import torch

            cuda_available = torch.cuda.is_available()
        if not cuda_available:
            raise UserError("data.decode_device=cuda needs a GPU and none is visible; set data.decode_device=cpu")
    problem = torchcodec_problem()
    if problem is None:
        return DecoderChoice("pyav" if decoder == "pyav" else "torchcodec", device)
    if decoder == "torchcodec" or device == "cuda":
        option = "data.decoder=torchcodec" if decoder == "torchcodec" else "data.decode_device=cuda"
        raise UserError(f"{option}: {problem}; {INSTALL_TORCHCODEC}, or set "
                        + ("data.decoder=pyav" if decoder == "torchcodec" else "data.decode_device=cpu"))
    if decoder == "auto" and notice is not None and problem != "torchcodec is not installed":
        notice(f"data.decoder=auto: decoding with PyAV ({problem})")
    return DecoderChoice("pyav", device)
