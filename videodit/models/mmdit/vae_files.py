"""The released files of Open-Sora 2.0's autoencoders and how they are read: safetensors only
(never unpickled), with one-line errors."""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from videodit.errors import NotRegularFile, UserError, os_error_message
from videodit.user_files import check_regular_file

RELEASE_FILES = {"hunyuan": "hunyuan_vae.safetensors", "opensora-dc-ae": "F32T4C128_AE.safetensors"}


def read_safetensors(file: Path, where: str, release: str) -> dict[str, Tensor]:
    """All tensors of a ``.safetensors`` file, with one-line errors."""
    if file.suffix != ".safetensors":
        raise UserError(f"{where} is a {file.suffix or 'suffix-less'} file; Open-Sora 2.0 ships its autoencoders as "
                        f".safetensors ({release}): point vae.path to that file")
    try:
        from safetensors.torch import load_file
        return load_file(str(check_regular_file(file)))
    except NotRegularFile as exc:
        raise UserError(os_error_message(exc)) from None
    except OSError as exc:
        raise UserError(f"{where}: {os_error_message(exc)}") from None
    except Exception as exc:   # a bad header, a truncated file
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise UserError(f"{where} cannot be read as safetensors ({first}); restore it from {release}") from None


__all__ = ["RELEASE_FILES", "read_safetensors"]
