"""``text.kind: gemma3-ltx2``: LTX-2's text conditioning, the post-connector embeddings its DiT reads.

As ltx-core's text encoder pipeline (``text_encoders/gemma``) computes them:

1. each caption, stripped, is tokenized alone by Gemma 3's tokenizer (``tokenizer.json`` with the
   settings of ``tokenizer_config.json``), truncated to ``max_length`` (1024) tokens, a leading
   ``<bos>`` ensured, then LEFT-padded to ``max_length``;
2. Gemma 3 (transformers, the folder as downloaded: ``google/gemma-3-12b-it``) runs on the padded
   batch with its mask; all its hidden states (embeddings + every layer, 49 for the 12B) are kept;
3. the release's text side (``connectors.py``): normalisation (2.0 per sample mean/range, 2.3 per
   token RMS), ``text_embedding_projection.*``, the video (and audio) ``Embeddings1DConnector``,
   whose registers fill the padding: every one of the ``max_length`` positions is a token, the
   mask is all ones and the DiT attends all of them.

``encode`` gives the video stream's embeddings ([B, 1024, 3840] for LTX-2.0, whose DiT projects
them, [B, 1024, 4096] for 2.3) and the all-ones mask; ``encode_streams`` the audio stream's too.
Nothing downloads and nothing is unpickled: Gemma loads with ``local_files_only``, the release's
tensors are read lazily from its safetensors (the DiT, VAEs and vocoder in it are never read).

``text.path`` is a folder holding the release file (``ltx-2-19b-*.safetensors``,
``ltx-2.3-22b-*.safetensors``, or any safetensors with its ``model.diffusion_model.*_embeddings_connector.*``
and ``text_embedding_projection.*`` tensors and its metadata config) and Gemma 3 in ``gemma/``
(or ``text_encoder/`` + ``tokenizer/`` as in a diffusers LTX-2 folder).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from videodit.errors import UserError
from videodit.models.ltx2.connectors import ConnectorShape, TextProjection, TextSide
from videodit.models.text_base import FrozenTextEncoder, as_caption_list
from videodit.models.vae_base import load_strict
from videodit.models.weight_files import ConfigValues, LazyTensors, build_bounded, open_safetensors, read_json

MAX_LENGTH = 1024    # ltx-core's TOKENIZER_MAX_LENGTH
PREFIX = "model.diffusion_model."
PROJECTION = "text_embedding_projection."
VIDEO, AUDIO, VIDEO_ONLY = "video_embeddings_connector.", "audio_embeddings_connector.", "embeddings_connector."
GEMMA_FOLDERS = (("gemma", "gemma"), ("text_encoder", "tokenizer"), (".", "."))
# ltx-core's test of an LTX-2.3 text side (``_V2_EXPECTED_CONFIG``): all four keys with these values.
PER_STREAM_KEYS = {"caption_proj_before_connector": True, "caption_projection_first_linear": False,
                   "caption_proj_input_norm": False, "caption_projection_second_linear": False}
# tokenizer_config.json keys that are not settings of the tokenizer object (ltx-core drops them too)
_NOT_SETTINGS = {"tokenizer_class", "auto_map", "model_max_length", "backend", "is_local", "local_files_only",
                 "processor_class", "added_tokens_decoder"}
_WHERE = ("point text.path to a folder holding the LTX-2 release file (ltx-2-19b-*.safetensors or "
          "ltx-2.3-22b-*.safetensors) and Gemma 3 as gemma/ (google/gemma-3-12b-it as downloaded); nothing is "
          "downloaded")


# ----------------------------------------------------------------------------- files

def find_files(path) -> tuple[Path, Path, Path]:
    """(Gemma's folder, its tokenizer's folder, the release file) inside ``text.path``."""
    if path is None or not str(path).strip():
        raise UserError(f"text.path is required for text.kind=gemma3-ltx2: {_WHERE}")
    root = Path(path).expanduser()
    if not root.is_dir():
        raise UserError(f"text.path='{path}' is not an existing folder: {_WHERE}")
    gemma = next(((root / m).resolve(), (root / t).resolve()) for m, t in GEMMA_FOLDERS
                 if (root / m / "config.json").is_file() or m == ".")
    if not (gemma[0] / "config.json").is_file():
        raise UserError(f"text.path='{path}' holds no Gemma 3 folder (gemma/config.json): {_WHERE}")
    if not (gemma[1] / "tokenizer.json").is_file():
        raise UserError(f"{gemma[1]} has no tokenizer.json: pass Gemma 3's folder as downloaded (its tokenizer "
                        "files included)")
    releases = [f for f in sorted(root.glob("*.safetensors")) if _holds_text_side(f)]
    if len(releases) != 1:
        what = "no file" if not releases else f"{len(releases)} files ({', '.join(f.name for f in releases)})"
        raise UserError(f"text.path='{path}' holds {what} with LTX-2's text connectors "
                        f"({PREFIX}{VIDEO}*); keep exactly one release file there")
    return gemma[0], gemma[1], releases[0]


def _holds_text_side(file: Path) -> bool:
    return any(k.startswith(PREFIX + VIDEO) or k.startswith(PREFIX + VIDEO_ONLY) for k in open_safetensors(file).keys())


def release_config(file: Path) -> dict:
    """The ``transformer`` section of the release's metadata ``config``."""
    metadata = open_safetensors(file).metadata() or {}
    try:
        config = json.loads(metadata["config"])["transformer"]
    except (KeyError, TypeError, ValueError, RecursionError):
        raise UserError(f"{file} has no transformer config in its safetensors metadata; pass the release file as "
                        "downloaded (its configuration travels inside it)") from None
    if not isinstance(config, dict):
        raise UserError(f"{file}: the metadata config's transformer section is not a JSON object; restore the file")
    return config


def text_side_shapes(config: dict, file: Path, gemma_width: int, gemma_states: int):
    """(projection, video connector, audio connector) of a release config, as ltx-core's
    configurators read it (its defaults for absent keys)."""
    v = ConfigValues(config, f"{file} (metadata config.transformer)", "restore the release file")
    present = {k: config[k] for k in PER_STREAM_KEYS if k in config}
    if present and present != PER_STREAM_KEYS:
        given = ", ".join(f"{k}={present.get(k)!r}" for k in PER_STREAM_KEYS)
        raise UserError(f"{file}: the metadata config sets {given}"
                        "; ltx-core builds a text side only for none of them (LTX-2.0) or all four as LTX-2.3 has "
                        f"them ({PER_STREAM_KEYS})")
    if config.get("rope_type", "split") != "split":
        raise UserError(f"{file}: rope_type={config.get('rope_type')!r}: the connectors' interleaved RoPE "
                        "(pre-release LTX-2) is not built by videodit")
    if not v.bool("connector_ff_bias", True):
        raise UserError(f"{file}: connector_ff_bias=false (LTX-2.5's connectors) is not built by videodit")
    max_pos = config.get("connector_positional_embedding_max_pos", [1])
    if not (isinstance(max_pos, list) and len(max_pos) == 1 and isinstance(max_pos[0], int) and max_pos[0] >= 1):
        raise UserError(f"{file}: connector_positional_embedding_max_pos={max_pos!r} is not a list of one positive "
                        "integer; restore the release file")
    common = dict(gated=v.bool("connector_apply_gated_attention", False), max_pos=max_pos[0],
                  double_precision=config.get("frequencies_precision", False) == "float64",
                  registers=v.int("connector_num_learnable_registers", 128, high=1 << 16))
    heads, head_dim = v.int("connector_num_attention_heads", 30), v.int("connector_attention_head_dim", 128)
    layers = v.int("connector_num_layers", 2, high=256)
    video = ConnectorShape(heads, head_dim, layers, **common)
    audio = ConnectorShape(v.int("audio_connector_num_attention_heads", heads),
                           v.int("audio_connector_attention_head_dim", head_dim),
                           v.int("audio_connector_num_layers", layers, high=256), **common)
    per_stream = None
    if present:   # LTX-2.3: each stream's own projection, to the DiT's stream widths
        per_stream = (v.int("num_attention_heads", 32) * v.int("attention_head_dim", 128),
                      v.int("audio_num_attention_heads", 32) * v.int("audio_attention_head_dim", 64))
    projection = (gemma_width * gemma_states, gemma_width, per_stream)
    return projection, video, audio


def load_text_side(file: Path, gemma_width: int, gemma_states: int, audio: bool, dtype: torch.dtype) -> TextSide:
    """The release's projection and connectors (the audio one only when ``audio``), strictly."""
    config = release_config(file)
    projection, video, audio_shape = text_side_shapes(config, file, gemma_width, gemma_states)
    sources, video_name = {}, VIDEO
    for key in open_safetensors(file).keys():
        name = key[len(PREFIX):] if key.startswith(PREFIX) else key
        if name.startswith(VIDEO_ONLY):   # a video-only release's one connector
            name, video_name = VIDEO + name[len(VIDEO_ONLY):], VIDEO_ONLY
        if name.startswith((VIDEO, PROJECTION)) or (audio and name.startswith(AUDIO)):
            if not (name.startswith(PROJECTION) and "audio_aggregate_embed" in name and not audio):
                sources[name] = (file, key)
    tensors = LazyTensors(sources)
    weight = PROJECTION + ("video_aggregate_embed.weight" if projection[2] else "aggregate_embed.weight")
    if weight in tensors and tensors.shape(weight)[-1] != projection[0]:
        raise UserError(f"{file}: {weight} takes {tensors.shape(weight)[-1]} features, but the Gemma in text.path "
                        f"gives {projection[0]} ({gemma_states} hidden states x {gemma_width}): pair the release with "
                        "the Gemma 3 it was trained on (google/gemma-3-12b-it)")
    widths = (projection[1],) * 2 if projection[2] is None else projection[2]
    for shape, width, what in ((video, widths[0], "video"), (audio_shape, widths[1], "audio")):
        if shape.width != width and (what == "video" or audio):
            raise UserError(f"{file}: the {what} connector is {shape.heads} x {shape.head_dim} wide but the "
                            f"projection gives it {width} features; restore the release file")
    features, gemma, per_stream = projection
    per_stream = per_stream if per_stream is None or audio else (per_stream[0], None)
    side = build_bounded(lambda: TextSide(TextProjection(features, gemma, per_stream), video,
                                          audio_shape if audio else None),
                         len(sources), f"{file}: its metadata config describes text connectors far larger than the "
                         f"{len(sources)} tensors it holds; restore the release file")
    given = {k: tensors[k].to(dtype) for k in tensors}
    load_strict(side, given, where=str(file), fix="pass an LTX-2 release file as downloaded",
                stranger=f"is not part of LTX-2's text side as its config describes it (read as {video_name})")
    return side


# ----------------------------------------------------------------------------- the encoder

def _dtype_kwarg() -> str:
    import transformers
    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def load_tokenizer(folder: Path):
    """Gemma's tokenizer as ltx-core builds it: tokenizer.json with tokenizer_config.json's settings."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    settings = read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
    if not isinstance(settings, dict):
        raise UserError(f"{folder / 'tokenizer_config.json'} is not a JSON object; restore Gemma's tokenizer files")
    settings = {k: v for k, v in settings.items() if k not in _NOT_SETTINGS}
    try:
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(folder / "tokenizer.json")),
                                            **settings)
    except Exception as exc:   # tokenizers raises its own exception types for a bad file
        raise UserError(f"cannot load Gemma's tokenizer from {folder}: {_first_line(exc)}") from None
    if tokenizer.bos_token_id is None:
        raise UserError(f"{folder}: the tokenizer has no bos_token; pass Gemma 3's tokenizer files")
    return tokenizer


class LTX2TextEncoder(FrozenTextEncoder):
    """Gemma 3 and a release's text side -> the embeddings LTX-2's DiT reads (module docstring)."""

    def __init__(self, gemma_dir: Path, tokenizer_dir: Path, release: Path, max_length: int = MAX_LENGTH,
                 dtype: torch.dtype = torch.float32, audio: bool = False):
        super().__init__()
        try:
            from transformers import AutoConfig, AutoModel
        except ImportError:
            raise UserError("text.kind=gemma3-ltx2 needs the transformers package: pip install 'videodit[hf]'") \
                from None
        config_json = read_json(gemma_dir / "config.json")
        if not isinstance(config_json, dict) or config_json.get("model_type") not in ("gemma3", "gemma3_text"):
            kind = config_json.get("model_type") if isinstance(config_json, dict) else None
            raise UserError(f"{gemma_dir / 'config.json'} has model_type={kind!r}, not 'gemma3': text.kind=gemma3-ltx2 "
                            "needs Gemma 3 (google/gemma-3-12b-it) there")
        self.tokenizer = load_tokenizer(tokenizer_dir)
        try:
            config = AutoConfig.from_pretrained(str(gemma_dir), local_files_only=True)
            self.gemma = AutoModel.from_pretrained(str(gemma_dir), local_files_only=True, **{_dtype_kwarg(): dtype})
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise UserError(f"cannot load Gemma 3 from {gemma_dir}: {_first_line(exc)}") from None
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        width, states = int(text_config.hidden_size), int(text_config.num_hidden_layers) + 1
        self.side = load_text_side(release, width, states, audio, dtype)
        registers = self.side.video_embeddings_connector.shape.registers or 1
        if max_length % registers:
            raise UserError(f"text.max_length={max_length} is not a multiple of the connectors' {registers} "
                            f"registers: set text.max_length={MAX_LENGTH} (LTX-2's)")
        self.max_length, self.dtype = int(max_length), dtype
        self.dim = self.side.video_embeddings_connector.shape.width
        self.audio_dim = self.side.audio_embeddings_connector.shape.width if audio else None
        self._freeze()

    def tokenize(self, captions: list[str]) -> tuple[Tensor, Tensor]:
        """(ids [B, max_length], mask [B, max_length] bool), left-padded as ltx-core's tokenizer."""
        tok, length = self.tokenizer, self.max_length
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        rows, masks = [], []
        for caption in as_caption_list(captions):
            ids = tok(caption.strip(), padding=False, truncation=True, max_length=length)["input_ids"]
            if not ids or ids[0] != tok.bos_token_id:
                ids = [tok.bos_token_id, *ids][:length]
            rows.append([pad] * (length - len(ids)) + ids)
            masks.append([False] * (length - len(ids)) + [True] * len(ids))
        return torch.tensor(rows), torch.tensor(masks)

    @torch.no_grad()
    def encode_streams(self, captions: list[str]) -> tuple[Tensor, Tensor | None, Tensor]:
        """(video [B, L, dim], audio [B, L, audio_dim] or None, mask [B, L] all True), fp32. With the
        audio connector, the last captions' result is kept: a training step asks for the video text,
        then the audio stream's, of the same captions, and Gemma runs once."""
        key = (tuple(as_caption_list(captions)), torch.is_autocast_enabled())
        last = getattr(self, "_last_streams", None)
        if self.audio_dim is not None and last is not None and last[0] == key:
            return last[1]
        result = self._encode_streams(captions)
        if self.audio_dim is not None:
            self._last_streams = (key, result)
        return result

    def _encode_streams(self, captions: list[str]) -> tuple[Tensor, Tensor | None, Tensor]:
        ids, valid = self.tokenize(captions)
        ids, valid = ids.to(self.device), valid.to(self.device)
        out = self.gemma(input_ids=ids, attention_mask=valid.long(), output_hidden_states=True)
        hidden = torch.stack(out.hidden_states, dim=-1)
        video, audio, mask = self.side(hidden, valid)
        return video.float(), None if audio is None else audio.float(), mask

    def encode(self, captions: list[str]) -> tuple[Tensor, Tensor]:
        video, _, mask = self.encode_streams(captions)
        return video, mask


def load_ltx2_text(path, max_length: int | None = None, dtype: torch.dtype = torch.float32,
                   audio: bool = False) -> LTX2TextEncoder:
    """A frozen :class:`LTX2TextEncoder` from the folder ``text.path`` (:func:`find_files`);
    ``max_length`` None: 1024 tokens; ``audio``: the audio connector too (``encode_streams``)."""
    gemma, tokenizer, release = find_files(path)
    return LTX2TextEncoder(gemma, tokenizer, release, max_length=max_length or MAX_LENGTH, dtype=dtype, audio=audio)


__all__ = ["MAX_LENGTH", "LTX2TextEncoder", "find_files", "load_ltx2_text", "load_text_side", "text_side_shapes"]
