"""What the GPU suite runs: the XL workload (Open-Sora 1.2's geometry) on a GPU or its tiny CPU
stand-in, and the helpers every section sizes its measurements with (the planner's batch, tokens)."""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from videodit.components import model_geometry
from videodit.config import load_config
from videodit.models.spec import count_parameters
from videodit.models.stdit.model import STDiT
from videodit.parallel.distributed import init_distributed
from videodit.planner.estimate import Parallel
from videodit.planner.plan import LatentGeometry, Planner

GiB = 2**30


@dataclass(frozen=True)
class Shape:
    label: str
    height: int       # pixels
    width: int
    frames: int


@dataclass
class Workload:
    """What the suite runs: the XL workload on a GPU, or its tiny CPU stand-in (``--dry-run``)."""
    dry: bool
    device: torch.device
    model: list[str]               # config overrides of the model
    caption: tuple[int, int]       # channels, tokens
    latent: LatentGeometry
    mfu_shapes: list[Shape]
    plan_shapes: list[Shape]
    tune_shapes: list[Shape]
    lever_shape: Shape
    steps: int
    warmup: int
    backend: str                   # compile backend
    bf16: bool

    @property
    def overrides(self) -> list[str]:
        return [*self.model, f"text.max_length={self.caption[1]}", f"train.device={self.device.type}",
                f"train.precision={'bf16' if self.bf16 else 'fp32'}", "train.ema_decay=0"]

    def config(self, extra=()):
        return load_config("tiny", [*self.overrides, *extra])

    def geometry(self, cfg=None):
        return model_geometry(cfg or self.config(), self.latent.channels, self.caption[0])

    def latent_shape(self, shape: Shape) -> tuple[int, int, int]:
        s = self.latent.spatial
        return self.latent.frames(shape.frames), shape.height // s, shape.width // s


def xl_workload(args) -> Workload:
    return Workload(
        dry=False, device=torch.device("cuda"),
        model=["model.preset=XL", "model.temporal_pos_embed=false", "model.pooled_caption=false"],
        caption=(4096, 300), latent=LatentGeometry.parse("opensora-v1.2"),
        mfu_shapes=[Shape("240p", 240, 426, 51), Shape("360p", 360, 640, 51)],
        plan_shapes=[Shape("144p", 144, 256, 51), Shape("240p", 240, 426, 51), Shape("240p", 240, 426, 102),
                     Shape("360p", 360, 640, 51), Shape("480p", 480, 854, 51)],
        tune_shapes=[Shape("240p", 240, 426, 51), Shape("360p", 360, 640, 51)],
        lever_shape=Shape("240p", 240, 426, 51), steps=args.steps, warmup=3, backend="inductor", bf16=True)


def dry_workload(args) -> Workload:
    return Workload(
        dry=True, device=torch.device("cpu"),
        model=["model.preset=tiny", "model.depth=1", "model.hidden_size=32", "model.num_heads=4",
               "model.patch_size=[1,2,2]", "model.temporal_pos_embed=false", "model.pooled_caption=false"],
        caption=(16, 8), latent=LatentGeometry.parse("opensora-v1.2"),
        mfu_shapes=[Shape("32x48", 32, 48, 17), Shape("48x64", 48, 64, 17)],
        plan_shapes=[Shape("32x32", 32, 32, 17), Shape("32x48", 32, 48, 17), Shape("32x48", 32, 48, 34),
                     Shape("48x64", 48, 64, 17), Shape("64x64", 64, 64, 17)],
        tune_shapes=[Shape("32x48", 32, 48, 17), Shape("48x64", 48, 64, 17)],
        lever_shape=Shape("32x48", 32, 48, 17), steps=2, warmup=1, backend="eager", bf16=False)



def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def free_memory() -> None:
    torch._dynamo.reset()   # compiled graphs hold on to the blocks they were traced from
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()



def single_context(w: Workload, cfg):
    """The one-process DistContext the Trainer would have."""
    return init_distributed(cfg)



def precision(w: Workload) -> str:
    return "bf16 autocast" if w.bf16 else "fp32"


def tokens(w: Workload, geometry, shape: Shape) -> int:
    frames, height, width = w.latent_shape(shape)
    pt, ph, pw = geometry.patch_size
    return -(-frames // pt) * -(-height // ph) * -(-width // pw)


def count_parameters_of(w: Workload) -> int:
    with torch.device("meta"):
        return count_parameters(STDiT(w.geometry()))


def planner_for(w: Workload, cfg) -> Planner:
    gpu = torch.cuda.get_device_properties(0).total_memory if w.device.type == "cuda" else 8 * GiB
    # config: the planner counts what the run trains (LTX-2's audio stream is frozen without train_audio)
    return Planner(w.geometry(cfg), Parallel(), w.bf16, cfg.memory, w.latent, w.caption[1], gpu, margin=0.1,
                   ema=False, config=cfg)


def pick_batch(w: Workload, cfg, shape: Shape, cap: int, planner: Planner | None = None) -> int:
    """The planner's largest batch that fits, at most ``cap`` (at least 1)."""
    planner = planner or planner_for(w, cfg)
    return max(1, min(cap, planner.max_batch(shape.frames, shape.height, shape.width)))

