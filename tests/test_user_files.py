"""Every file a user names is opened under one rule: regular files only, never a blocking open."""

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from videodit.errors import os_error_message
from videodit.user_files import FileTooLarge, NotRegularFile, open_user_file, read_user_json, read_user_text

FIXTURES = Path(__file__).parent / "fixtures"


def _special(tmp_path: Path, kind: str) -> Path:
    """A FIFO, a listening socket, a character device or a folder at a path of ``tmp_path``."""
    path = tmp_path / f"special-{kind}"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
        server.listen()
        _special.keep = server   # open for the test's duration
    elif kind == "device":
        path.symlink_to("/dev/zero")
    else:
        path.mkdir()
    return path


@pytest.mark.parametrize("kind, named", [("fifo", "a FIFO"), ("socket", "a socket"),
                                         ("device", "a character device"), ("folder", "a folder")])
def test_what_is_not_a_regular_file_is_refused_without_blocking(tmp_path, kind, named):
    path = _special(tmp_path, kind)
    with pytest.raises(NotRegularFile) as refused:
        read_user_text(path)
    assert os_error_message(refused.value) == f"{path} is not a regular file but {named}; give a regular file"


def test_size_bound_and_json_nesting(tmp_path):
    big = tmp_path / "big.json"
    big.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(FileTooLarge, match="200000 bytes, more than the 1000"):
        open_user_file(big, max_bytes=1000)
    with pytest.raises(ValueError, match="nested too deeply"):
        read_user_json(big)
    (tmp_path / "link.json").symlink_to(tmp_path / "small.json")
    (tmp_path / "small.json").write_text('{"a": 1}')
    assert read_user_json(tmp_path / "link.json") == {"a": 1}   # a symlink to a regular file is fine


# Released model folders, and the file of each replaced by a FIFO.
RELEASED = {"wan weights": ("wan/wan", "diffusion_pytorch_model.safetensors"), "wan config": ("wan/wan", "config.json"),
            "stdit weights": ("opensora/stdit3", "model.safetensors"), "stdit config": ("opensora/stdit3", "config.json")}


@pytest.mark.parametrize("entry", ["config", "prompts", *RELEASED])
def test_cli_refuses_a_fifo_in_one_line(tmp_path, entry):
    """Each command that reads a user's file, handed a FIFO, ends at once with one line."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    if entry == "config":
        args = ["config", "show", str(fifo)]
    elif entry == "prompts":
        args = ["sample", "--ckpt", str(tmp_path), "--prompts", str(fifo)]
    else:
        folder, name = RELEASED[entry]
        src = tmp_path / "released"
        shutil.copytree(FIXTURES / folder, src)
        fifo = src / name
        fifo.unlink()
        os.mkfifo(fifo)
        args = ["ckpt", "import", str(src), str(tmp_path / "out")]
    result = subprocess.run([sys.executable, "-m", "videodit", *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert f"{fifo} is not a regular file but a FIFO" in lines[0]
    assert not (tmp_path / "out").exists()
