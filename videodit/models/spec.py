"""The model-family seam: everything the rest of videodit knows of a kind of video DiT.

A family is a folder ``models/<family>/`` holding its pure model code, its weight layouts
and one :class:`ModelSpec`. The trainer, ``parallel/``, the planner, the FLOP model, LoRA,
the feature cache, ``checkpoint/`` and ``sample.py`` ask the spec (through
``models/families.py``), never a model class; adding a family is a folder, a spec, fixtures
from the reference code and a docs page (``docs/architecture.md``).

What a spec answers, grouped as the system asks:

* **build**: a geometry (the model's arguments, a frozen dataclass) from the config and the
  encoders' sizes, the module from a geometry (meta-device friendly), the config.json of a
  model folder and back, the latent channels of a state dict;
* **weights**: which released layouts it reads (``read_released``, ``load_released``) and
  writes (``export_released``);
* **geometry**: the patch, the token grid of a latent clip;
* **objective**: the model inputs of a training or sampling step (:class:`Conditions`),
  the unconditional branch of classifier-free guidance;
* **blocks**: ``model.blocks``, the repeated units of FSDP, checkpointing, compile and
  pipeline stages, plus what a pipeline stage is (``pipeline_stage``);
* **parallel plans**, declared as data so that model code stays free of torch.distributed:
  a tensor-parallel plan per block and at the root, the sequence-parallel scheme, the
  parameters whose gradients tensor parallelism leaves partial;
* **LoRA** target names in other namings; **FLOPs** per block; the planner's **activation** sizes.
  (The default targets live with the config: ``config/schema.py``'s ``LORA_TARGETS``.)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn


@dataclass
class Conditions:
    """Everything but the noisy latents and the time that a step hands the model: the caption
    tokens ``y`` [B, L, C] and mask [B, L], ``drop`` [B] bool (the caption is dropped: CFG's
    unconditional branch in training), fps [B], the clip's pixel size, the frame mask
    ``x_mask`` [B, T'] (True: generated) and image features ``image`` [B, tokens, C] (Wan 2.1
    I2V's CLIP) and ``given`` [B, C', T, H, W], channels entering beside x_t (Wan i2v's mask and
    given frames' latents, from :meth:`ModelSpec.first_frame_condition`; the MMDiT's mask and masked
    latents) and ``pooled`` [B, C_pooled], a pooled caption vector beside the tokens (Open-Sora 2.0's
    CLIP-L ``pooler_output``) and ``audio``, the audio stream's inputs of a family with one
    (:class:`AudioInputs`: LTX-2 trained with ``model.train_audio``). A family uses what it needs."""
    y: torch.Tensor
    y_mask: torch.Tensor
    drop: torch.Tensor | None = None
    fps: torch.Tensor | None = None
    height: torch.Tensor | float | None = None
    width: torch.Tensor | float | None = None
    x_mask: torch.Tensor | None = None
    image: torch.Tensor | None = None
    given: torch.Tensor | None = None
    pooled: torch.Tensor | None = None
    audio: "AudioInputs | None" = None


@dataclass
class AudioInputs:
    """An audio stream's step inputs: its noisy tokens ``x_t`` [B, Ta, C_a], its own sigma ``t`` [B]
    and its caption embeddings ``context`` [B, L, C] (a dropped caption, ``Conditions.drop``, zeroes
    them as it zeroes ``y``)."""
    x_t: torch.Tensor
    t: torch.Tensor
    context: torch.Tensor


def model_parts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name prefix, model) of each whole model inside ``model``: the experts of a two-expert
    model (its ``models()``: Wan 2.2 A14B trained with ``model.expert=both``), else the model
    itself. Each has its own ``blocks``; the parallel layers and LoRA targets apply per part."""
    if not hasattr(model, "models"):
        return [("", model)]
    names = {id(child): name for name, child in model.named_children()}
    return [(f"{names[id(part)]}.", part) for part in model.models()]


@dataclass(frozen=True)
class ActivationDims:
    """The sizes of one block that the planner's activation model reads (``planner/estimate.py``):
    width, heads, MLP hidden width and the tokens text is attended from."""
    hidden_size: int
    num_heads: int
    mlp_hidden: int
    caption_channels: int


@dataclass(frozen=True)
class Saved:
    """One kind of tensor that autograd keeps for backward, for the planner's activation model
    (``planner/estimate.py``), in ``units`` of a width ``per``: ``"D"`` (hidden size), ``"M"``
    (MLP width), ``"C"`` (caption channels), ``"H"`` (heads) or ``"1"`` (one value), for every
    element of ``on``: ``"tokens"`` (video tokens on this rank), ``"caption"`` (caption tokens of
    the micro-batch, batch x caption length) or ``"latent"`` (latent elements, per="1").

    ``low``: in the compute dtype (bf16 under autocast), else always fp32. ``tp``: split over
    tensor-parallel ranks (per-head or per-MLP-column tensors). ``selective``: kept by selective
    checkpointing (outputs of matmuls and attention kernels); ``selective_units`` overrides the
    units kept then (a matmul output that plain autograd frees, or keeps in another dtype).
    ``autocast_units`` overrides ``units`` under bf16 autocast (which casts a linear's input once
    per layer, or leaves no copy where fp32 shares one tensor). ``needed_by``: kept only for the
    gradients of these: layers of the block (their weights), ``"adaln"`` (the modulation),
    ``"qk_norm"`` (its weights) or a layer outside the blocks; empty: always kept (the input of an
    op whose output needs a gradient). LoRA freezes all of these but the adapted layers."""
    what: str
    units: float
    per: str
    low: bool
    tp: bool
    selective: bool
    needed_by: tuple[str, ...] = ()
    on: str = "tokens"
    selective_units: float | None = None
    autocast_units: float | None = None


@dataclass(frozen=True)
class ActivationProfile:
    """What a family's model keeps for backward (the planner's activation model): ``block`` per
    repeated block, ``outside`` once for the layers before and after the blocks (on the whole
    token grid), ``caption_layers`` the block layers that read caption tokens (LoRA).
    Under sequence parallelism the model also keeps ``sp_gathered`` fp32 D-wide values per token
    of the whole grid (the gathered block output, where ``outside`` does not count it already)
    and ``sp_local`` per token of the rank's slice."""
    block: tuple[Saved, ...]
    outside: tuple[Saved, ...]
    caption_layers: tuple[str, ...] = ("cross_attn.k", "cross_attn.v")
    sp_gathered: float = 1.0
    sp_local: float = 0.0
    # The caption is a stream through the blocks (the MMDiT's text tokens), not one tensor they
    # all read: each block's input holds it, so full checkpointing keeps it once per block.
    caption_stream: bool = False
    # What a checkpointed block holds as its inputs besides the token stream(s): tensors made
    # outside the blocks that every block reads and plain training frees after forward (LTX-2's
    # per-token modulation [B, T, rows D]), kept once, on the rank's tokens, while any block is
    # checkpointed. ``residual_low``: the token stream a checkpointed block keeps as its input is
    # in the compute dtype under autocast (LTX-2's bf16 residual stream), else fp32.
    checkpoint_inputs: tuple[Saved, ...] = ()
    residual_low: bool = False


@dataclass(frozen=True)
class TensorParallelPlan:
    """Declared per block (``block``) and at the root (``root``): module path -> style, where a
    style is ``"colwise"``, ``"rowwise"``, ``"colwise_gathered"`` (column-wise, output gathered
    whole) or ``("inputs", layouts)`` (the module's tensor inputs handed on as replicated DTensors,
    ``layouts`` one of "replicate"/None per input). ``partial``: parameter-name suffixes whose
    gradients each TP rank computes only in part (summed over TP after backward).
    ``sharded_norms``: module-path suffixes (inside a block) of norms taken over all heads of a
    column-sharded projection (Wan's q/k RMSNorm): TP shards their weight like the columns and
    reduces their mean of squares over the ranks."""
    block: Callable[[nn.Module], dict[str, Any]]
    root: dict[str, Any] = field(default_factory=dict)
    partial: tuple[str, ...] = ()
    sharded_norms: tuple[str, ...] = ()


class ModelSpec:
    """One model family. Subclasses set the class attributes and implement the methods."""

    family: str                       # model.family
    model_type: str                   # config.json "model_type" of videodit's model folders
    geometry_type: type               # the frozen dataclass of the model's arguments
    sequence_parallel: str            # "stdit_frames" or "full_attention" (parallel/ maps it)
    sequence_args: dict = {}          # full_attention: block arg -> token dim, or (dim, ndim) when per token
    block_streams: int = 1            # token streams a block passes on (its first outputs = next block's first args)
    # full_attention: attention kinds whose queries are whole on every SP rank and whose keys are the
    # sharded tokens (LTX-2's video -> audio attention), run as a ring over the SP group
    whole_query_kinds: tuple[str, ...] = ()
    released_encoders: tuple[int, int, int]   # (latent channels, caption channels, caption tokens) of its releases

    # ------------------------------------------------------------------ build

    def geometry(self, model_cfg, latent_channels: int, caption_channels: int, caption_length: int):
        """The model's arguments from ``model.*`` (resolved) and the encoders' sizes."""
        raise NotImplementedError

    def build(self, geometry) -> nn.Module:
        raise NotImplementedError

    def configure(self, model: nn.Module, model_cfg) -> nn.Module:
        """What the config says about training parts of a built model (freezing); default nothing."""
        return model

    def geometry_config(self, geometry) -> dict:
        raise NotImplementedError

    def geometry_from_config(self, config: dict):
        raise NotImplementedError

    def latent_channels(self, tensors: dict[str, torch.Tensor]) -> int:
        """The latent channels of a state dict of this family (to rebuild a model from a checkpoint)."""
        raise NotImplementedError

    def released_encoders_of(self, model_cfg) -> tuple[int, int, int]:
        """:attr:`released_encoders` of the release a model config describes (a family's releases
        may be built on different encoders)."""
        return self.released_encoders

    def takes_first_frame(self, geometry) -> bool:
        """Whether the model takes a given first frame as input channels (Wan's i2v), encoded by the
        VAE as a clip of that frame followed by zero (mid-grey) frames."""
        return False

    def first_frame_condition(self, first_frame_latents: torch.Tensor) -> torch.Tensor:
        """The input channels (``Conditions.given``) of a first frame given as the latents of a clip
        [B, C, T, H, W] holding it and zero frames after (for :meth:`takes_first_frame` models)."""
        raise NotImplementedError

    def combine_experts(self, high: nn.Module, low: nn.Module, boundary: float) -> nn.Module:
        """A two-expert model: ``high`` denoises above ``boundary``, ``low`` below; its
        ``models()`` are the experts (each with its ``blocks``, for the parallel layers).
        Families without such models refuse."""
        from videodit.errors import UserError
        raise UserError(f"the {self.family} family has no two-expert models")

    def expert_guidance(self, boundary: float, guidance: tuple[float, float]) -> Callable[[torch.Tensor], float]:
        """A two-expert model's CFG scale as a function of t (``guidance`` = (low, high))."""
        raise NotImplementedError

    def expert_at(self, t: float, boundary: float) -> str:
        """The expert ("high" or "low") of a two-expert model that denoises at time ``t``."""
        raise NotImplementedError

    def build_image_encoder(self, path: str, dtype: torch.dtype) -> nn.Module:
        """The frozen image encoder (``encode(frames [B, 3, H, W] in [-1, 1]) -> [B, tokens, dim]``,
        ``dim``) of a model with ``image_dim``, loaded from ``path``."""
        raise NotImplementedError


    def caption_channels(self, tensors: dict[str, torch.Tensor]) -> int:
        """The text encoder's width a state dict of this family was built for."""
        raise NotImplementedError

    # ------------------------------------------------------------------ weights

    released_name: str = ""           # how errors name its released weights ("Open-Sora STDiT3")
    released_format: str = ""         # its id in an import's export.json ("opensora-stdit3")
    released_short: str = ""          # in messages about weights taken ("Open-Sora")
    released_takes_given_frames: bool = False   # its releases were trained with frame masks (``--ref``)
    # export format -> (high-noise, low-noise) expert folders of a two-expert model in that layout
    expert_folders: dict[str, tuple[str, str]] = {}
    # the (high, low) experts' name prefixes in the module :meth:`combine_experts` builds
    expert_prefixes: tuple[str, str] = ()
    released_fix: str = ""            # what to set when released weights do not fit the model
    # Geometry fields a run may set apart from the weights it starts from (model.init_from compares
    # every other field), and the option that sets a field whose model.* key is not its own name.
    run_fields: tuple[str, ...] = ()
    field_options: dict[str, str] = {}
    export_formats: tuple[str, ...] = ()   # ``ckpt export --format`` values besides videodit's own
    # ``ckpt export --lora-format`` values whose files load somewhere for this family (peft's loads
    # onto any videodit model; diffusers and ComfyUI need a pipeline or model of theirs)
    lora_formats: tuple[str, ...] = ("peft",)

    def lora_module_name(self, fmt: str, module: str) -> str:
        """A module path of the model (``blocks.0.self_attn.q``) as a LoRA file in ``fmt`` names it."""
        return module

    def released_layout(self, path: Path) -> bool:
        """Whether ``path`` holds weights in one of the family's released layouts."""
        return False

    def read_released(self, path: Path, ema: bool = False) -> tuple[Any, dict[str, torch.Tensor]]:
        """(geometry, tensors in the family's own names) of released weights (``released_layout``);
        of a two-expert model, both experts' (named as in :meth:`combine_experts`' model)."""
        raise NotImplementedError

    def released_files(self, path: Path) -> list[Path]:
        """The weight files of released weights that the model reads (a LoRA base's fingerprint)."""
        suffixes = (".safetensors", ".pt", ".pth", ".bin")
        return [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.suffix in suffixes)

    def read_released_like(self, path: Path, ema: bool = False, like: dict | None = None):
        """:meth:`read_released`, where ``like`` (field -> value of the model the weights are read
        for: a run's model.* or geometry) gives what the released files cannot say; default: nothing."""
        return self.read_released(path, ema=ema)

    def released_config(self, geometry, experts: bool = False) -> str | None:
        """The config ``ckpt import`` records with released weights of ``geometry`` (``experts``: a
        two-expert model; None: the family's usual one) when no --config is given: the recipe whose
        encoders and sampling fit them; None when none does."""
        return None

    def expert_source(self, path: Path, expert: str) -> Path | None:
        """The folder of one expert ("high" or "low") when ``path`` holds a two-expert model, else None."""
        return None

    def load_released(self, path: Path, ema: bool = False) -> nn.Module:
        """The fp32 model of released weights; families with sharded releases load them lazily."""
        geometry, tensors = self.read_released(path, ema=ema)
        with torch.device("meta"):
            model = self.build(geometry)
        model.load_state_dict({name: t.float() if t.is_floating_point() else t for name, t in tensors.items()},
                              assign=True)
        return model

    def export_released(self, fmt: str, geometry, tensors: dict[str, torch.Tensor]
                        ) -> tuple[dict[str, torch.Tensor], dict[str, str], str]:
        """(tensors, {file name: text}, weights file name) of a folder in released format ``fmt``
        (one of ``export_formats``)."""
        raise NotImplementedError

    def export_metadata(self, fmt: str, geometry) -> dict[str, str]:
        """The safetensors metadata of the weights file :meth:`export_released` names (LTX-2's
        release format carries its configuration there)."""
        return {"format": "pt"}

    def parameter_scope(self) -> str | None:
        """What a preset's parameter count covers where a release counts otherwise (``model info``
        prints it), or None: the whole model a release names."""
        return None

    # ------------------------------------------------------------------ its encoders

    vae_kinds: tuple[str, ...] = ()    # vae.kind values of the family's own VAEs
    text_kinds: tuple[str, ...] = ()   # text.kind values of the family's own text encoders

    def build_vae(self, kind: str, path, subfolder, *, scaling_factor, micro_batch: int,
                  temporal_micro_batch: int, dtype: torch.dtype):
        """The frozen VAE ``vae.kind=kind`` names (one of ``vae_kinds``); loaded lazily by
        ``models/vae.py``'s ``build_vae``, the one factory."""
        raise NotImplementedError

    def build_text_encoder(self, kind: str, path, max_length: int | None, dtype: torch.dtype, mask: bool = True):
        """The frozen text encoder ``text.kind=kind`` names (one of ``text_kinds``); ``mask=False``
        (``text.mask``) only for the kinds ``components.UNMASKED_TEXT_KINDS`` lists."""
        raise NotImplementedError

    audio_kinds: tuple[str, ...] = ()  # audio.kind values of the family's own audio VAEs (a model with an audio stream)

    def build_audio(self, kind: str, path, subfolder, *, dtype: torch.dtype):
        """The frozen audio VAE ``audio.kind=kind`` names (one of ``audio_kinds``): ``encode(mel)``,
        ``tokens(latents)``, ``latent_frames(mel_frames)``, ``token_width``; loaded lazily."""
        raise NotImplementedError

    def audio_channels(self, geometry) -> int | None:
        """The width of the audio tokens the model's audio stream takes, or None: no audio stream."""
        return None

    def audio_text_width(self, m) -> int | None:
        """The width of the audio stream's text that ``model.*`` (a ModelConfig) takes, or None: any
        (or no audio stream). A text encoder built for the run (the toy one) gives it that wide."""
        return None

    # ------------------------------------------------------------------ geometry, objective

    def patch_size(self, geometry) -> tuple[int, int, int]:
        return tuple(geometry.patch_size)

    def token_grid(self, geometry, frames: int, height: int, width: int) -> tuple[int, int]:
        """(patched frames T', positions per frame S) of a latent clip, padded up to the patch."""
        pt, ph, pw = self.patch_size(geometry)
        return -(-frames // pt), -(-height // ph) * -(-width // pw)

    def tokens(self, geometry, frames: int, height: int, width: int) -> int:
        return math.prod(self.token_grid(geometry, frames, height, width))

    def model_inputs(self, x_t: torch.Tensor, t: torch.Tensor, cond: Conditions) -> tuple:
        """The positional inputs of ``model(...)`` for one step: x_t first, t second."""
        raise NotImplementedError

    def unconditional(self, cond: Conditions, negative: tuple[torch.Tensor, torch.Tensor] | None) -> Conditions:
        """The conditions of CFG's unconditional branch; ``negative``: the encoded negative prompt
        (y, y_mask) where the family samples with one."""
        raise NotImplementedError

    def frame_mask_index(self) -> int | None:
        """Where ``x_mask`` sits in :meth:`model_inputs` (frame conditioning), None if unsupported."""
        return None

    # ------------------------------------------------------------------ blocks and parallelism

    def pipeline_stage(self, model: nn.Module, block_ids, *, first: bool, last: bool) -> nn.Module:
        """The model restricted to the blocks ``block_ids`` (its parts keep their names), with the
        embedding when ``first`` and the output layer when ``last``."""
        raise NotImplementedError(f"{self.family}: no pipeline stages")

    def stage_io(self, stage: nn.Module, inputs: tuple, microbatches: int) -> dict:
        """Meta tensors of one micro-batch's stage inputs and outputs (``input_args``,
        ``output_args``), from the model inputs of the whole batch."""
        raise NotImplementedError

    def stage_latents(self, output: torch.Tensor, latent_shape, geometry) -> torch.Tensor:
        """The last stage's output as the model's output (latents of ``latent_shape``)."""
        raise NotImplementedError

    def tensor_parallel_plan(self) -> TensorParallelPlan:
        raise NotImplementedError

    def block_kind(self, block: nn.Module) -> str:
        """The kind of a repeated block (blocks of one kind share compiled graphs)."""
        return "block"

    def dynamic_dims(self, args: tuple) -> list[tuple[torch.Tensor, list[int]]]:
        """(tensor, dims) of a block's positional inputs whose sizes change between buckets
        (batch, frames, positions or tokens): ``train.compile_dynamic`` marks them dynamic."""
        raise NotImplementedError

    def num_blocks(self, depth: int) -> int:
        """How many repeated blocks ``model.depth`` gives."""
        return depth

    def blocks_of(self, model_cfg) -> int:
        """How many repeated blocks a (resolved) model config gives: :meth:`num_blocks` of its
        depth, unless the family counts more than ``model.depth`` (the MMDiT's single blocks)."""
        return self.num_blocks(model_cfg.depth)

    def lora_target(self, name: str) -> str:
        """A ``lora.targets`` entry (a path inside every block, or a full module path) written in
        another naming of the family's layers, in its own module names (Wan: diffusers'
        ``attn1.to_q`` -> ``self_attn.q``). ``models/lora.py`` asks it for a name that names no
        layer as given; default: the name unchanged."""
        return name

    def check_sequence_parallel(self, num_heads: int, *, tp: int, sp: int, ring: int) -> None:
        """Raise a one-line UserError when ``parallel.sp`` (``ring`` of it ring attention) does not
        fit a model of ``num_heads`` heads split ``tp`` ways."""
        raise NotImplementedError

    # ------------------------------------------------------------------ FLOPs and memory

    def forward_flops(self, geometry, frames: int, positions: int, caption_tokens: int):
        """A :class:`videodit.models.flop_count.FlopCount` of one sample on the patched grid."""
        raise NotImplementedError

    def activation_dims(self, geometry) -> ActivationDims:
        raise NotImplementedError

    def activation_profile(self, geometry) -> ActivationProfile:
        """The tensors one block (and the rest of the model) keeps for backward."""
        raise NotImplementedError

    def kind_activation_profile(self, geometry, kind: str) -> ActivationProfile:
        """What one block of ``kind`` keeps (the planner weighs per-kind checkpointing with it);
        default: :meth:`activation_profile`, one profile for every block."""
        return self.activation_profile(geometry)

    def block_kinds(self, geometry) -> tuple[str, ...]:
        """:meth:`block_kind` of each repeated block in order (``memory.checkpoint_blocks`` counts
        per kind), read off the model built on the meta device once per geometry."""
        return _block_kinds(self, geometry)


@functools.lru_cache(maxsize=32)
def _block_kinds(spec: ModelSpec, geometry) -> tuple[str, ...]:
    with torch.device("meta"):   # structure only: no memory, no initialisation
        model = spec.build(geometry)
    return tuple(spec.block_kind(block) for block in model.blocks)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def check_ulysses_ring(num_heads: int, *, tp: int, sp: int, ring: int) -> None:
    """The sizes of sp = Ulysses x ring over a token sequence (Wan's tokens, the MMDiT's image
    tokens): Ulysses splits each TP rank's heads sp/ring ways; ring attention (``parallel.sp_ring``)
    takes any sp. A one-line UserError naming the valid ``sp_ring`` values otherwise."""
    from videodit.errors import UserError
    divisors = [d for d in range(1, sp + 1) if sp % d == 0]
    if ring < 1 or sp % ring:
        raise UserError(f"parallel.sp_ring={ring} does not divide parallel.sp={sp}; valid: "
                        f"{', '.join(map(str, divisors))}")
    ulysses, heads = sp // ring, num_heads // tp
    if heads % ulysses:
        valid = [r for r in divisors if heads % (sp // r) == 0]
        raise UserError(f"parallel.sp={sp} with parallel.sp_ring={ring} leaves {ulysses} Ulysses ranks, which do not "
                        f"divide the {heads} attention heads per tensor-parallel rank; valid parallel.sp_ring: "
                        f"{', '.join(map(str, valid))} (sp_ring={sp}: ring attention only, any sp)")
