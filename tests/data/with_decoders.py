"""Running a data test once per video decoder: ``from with_decoders import decoder`` and take the
``decoder`` fixture. The torchcodec run needs torchcodec with FFmpeg's shared libraries (``pip
install videodit[torchcodec]``, ``apt-get install ffmpeg``); where they do not load it is skipped
with the reason, as CUDA-only tests are without a GPU."""

import pytest

from videodit.data import decoder_choice
from videodit.data.decoder_choice import DecoderChoice

TORCHCODEC_PROBLEM = decoder_choice.torchcodec_problem()
needs_torchcodec = pytest.mark.skipif(TORCHCODEC_PROBLEM is not None,
                                      reason=f"needs torchcodec with FFmpeg's libraries: {TORCHCODEC_PROBLEM}")


@pytest.fixture(params=["pyav", pytest.param("torchcodec", marks=needs_torchcodec)])
def decoder(request, monkeypatch):
    """The decoder ``read_video`` uses during the test (DataLoader workers fork with it)."""
    monkeypatch.setattr(decoder_choice, "_current", DecoderChoice(request.param))
    if request.param == "torchcodec":
        from videodit.data.decode_torchcodec import READS

        READS.clear()
    return request.param
