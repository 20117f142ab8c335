"""Write the golden STDiT3 fixtures of tests/fixtures/opensora/stdit3/ with Open-Sora's own code.

    /path/to/venv/bin/python scripts/make_opensora_fixtures.py --opensora /path/to/Open-Sora [--out DIR]

``--opensora`` is a checkout of hpcaitech/Open-Sora at tag v1.2.0 (commit 17cce90). The venv needs
Open-Sora's model dependencies (torch, transformers, einops, timm, rotary_embedding_torch==0.5.3,
mmengine, safetensors); xformers and colossalai are NOT needed: small stand-ins are installed in
``sys.modules`` first (a dense CPU ``memory_efficient_attention`` with ``BlockDiagonalMask``, the
reference semantics of the packed cross-attention, and import-only colossalai names). Only the
modules STDiT3 and RFLOW need are imported (the package ``__init__``s that pull in every model and
text encoder are skipped).

What it writes into ``--out`` (default tests/fixtures/opensora/stdit3, about 0.8 MB):

- ``config.json`` + ``model.safetensors``: a tiny STDiT3 (depth 2, hidden 32, 2 heads, patch
  (1,2,2), 4 latent channels, 16-wide captions of 12 tokens) as ``STDiT3.save_pretrained`` writes
  it, every weight overwritten with seeded random values (Open-Sora zero-initialises several
  projections, which would hide mistakes in a converter), except ``rope.freqs``, which is a
  constant of the architecture.
- ``cases.safetensors``: inputs and Open-Sora's fp32 outputs, ``{case}.{name}``, for the forward
  cases in ``CASES`` (square, non-square, padded, 240p-like grids, an image, ``x_mask``, the CFG
  null caption) and ``sample.*``: a 10-step CFG-7 ``RFLOW.sample`` loop with the timestep
  transform, through a stub text encoder that returns fixed embeddings and masks.

Deterministic: the same checkout and library versions write the same bytes. After writing, it
checks that videodit's import of the folder reproduces the outputs and that videodit's export
loads back into Open-Sora's STDiT3 (its config.json through ``STDiT3Config.from_pretrained``, its
weights strictly) with the same outputs (``--no-check`` skips this; it needs videodit importable).
tests/models/test_opensora_stdit.py reads the fixtures; it never needs Open-Sora.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
SEED = 2024
TINY = dict(depth=2, hidden_size=32, num_heads=2, patch_size=(1, 2, 2), in_channels=4, caption_channels=16,
            model_max_length=12, mlp_ratio=4.0, qk_norm=True, pred_sigma=True)
# name: (batch, latent frames, latent height, latent width, pixel height, pixel width)
GRIDS = {"square": (2, 3, 8, 8, 64, 64), "nonsquare": (2, 2, 6, 10, 48, 80), "padded": (2, 3, 7, 9, 52, 70),
         "240p": (2, 2, 30, 53, 240, 426), "image": (2, 1, 8, 8, 64, 64)}
CASES = [*GRIDS, "x_mask", "null_caption"]
# Timesteps that are exact in fp32 after videodit's t/1000 -> *1000 round trip.
TIMESTEPS = (500.0, 875.0)


# ------------------------------------------------------------------------------- stand-ins

class BlockDiagonalMask:
    """xformers' block-diagonal attention bias: query block i attends to key block i only."""

    def __init__(self, q_seqlen: list[int], kv_seqlen: list[int]):
        self.q_seqlen, self.kv_seqlen = q_seqlen, kv_seqlen

    @classmethod
    def from_seqlens(cls, q_seqlen, kv_seqlen=None):
        return cls([int(n) for n in q_seqlen], [int(n) for n in (q_seqlen if kv_seqlen is None else kv_seqlen)])

    def dense(self, device) -> torch.Tensor:
        """[sum(q_seqlen), sum(kv_seqlen)] bool, True where attention is allowed."""
        q_ids = torch.repeat_interleave(torch.arange(len(self.q_seqlen)), torch.tensor(self.q_seqlen))
        kv_ids = torch.repeat_interleave(torch.arange(len(self.kv_seqlen)), torch.tensor(self.kv_seqlen))
        return (q_ids[:, None] == kv_ids[None, :]).to(device)


def memory_efficient_attention(query, key, value, attn_bias=None, p=0.0, scale=None):
    """Dense reference of xformers' attention on [batch, tokens, heads, head_dim] inputs."""
    assert p == 0.0, "the fixtures run in eval mode"
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))          # [B, H, M, K]
    scores = (q @ k.transpose(-2, -1)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if attn_bias is not None:
        scores = scores.masked_fill(~attn_bias.dense(scores.device), float("-inf"))
    return (scores.softmax(dim=-1) @ v).transpose(1, 2).contiguous()   # xformers returns dense [B, M, H, K]


class _ImportOnly:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("colossalai is stubbed: import-only")


def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, module)
    return module


def import_opensora(checkout: Path):
    """(STDiT3, STDiT3Config, RFLOW) from the checkout, with the stand-ins installed."""
    _module("xformers")
    _module("xformers.ops", memory_efficient_attention=memory_efficient_attention)
    _module("xformers.ops.fmha", BlockDiagonalMask=BlockDiagonalMask)
    _module("colossalai")
    _module("colossalai.booster", Booster=_ImportOnly)
    _module("colossalai.booster.plugin", LowLevelZeroPlugin=_ImportOnly)
    _module("colossalai.checkpoint_io", GeneralCheckpointIO=_ImportOnly)
    _module("colossalai.cluster", ProcessGroupMesh=_ImportOnly)
    _module("colossalai.utils", get_current_device=lambda: torch.device("cpu"))
    # Bare packages: their __init__s import every model and text encoder (ftfy, diffusers, ...).
    for package in ("opensora", "opensora.models", "opensora.models.stdit.model"):
        _module(package).__path__ = [str(checkout / package.replace(".", "/"))]
    sys.path.insert(0, str(checkout))
    from opensora.models.stdit.stdit3 import STDiT3, STDiT3Config
    from opensora.schedulers.rf import RFLOW
    return STDiT3, STDiT3Config, RFLOW


# ------------------------------------------------------------------------------- the model

def randomize(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Every weight and buffer but the RoPE frequencies: O(1) activations, nothing zero."""
    state = model.state_dict()
    with torch.no_grad():
        for name in sorted(state):
            tensor = state[name]
            if name == "rope.freqs":
                continue
            noise = torch.randn(tensor.shape, generator=generator)
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                value = 1 + 0.2 * noise
            elif tensor.dim() == 1:
                value = 0.1 * noise
            elif name.endswith("scale_shift_table") or name.endswith("y_embedding"):
                value = noise / tensor.shape[-1] ** 0.5
            else:
                value = noise / tensor[0].numel() ** 0.5   # 1/sqrt(fan in)
            tensor.copy_(value)


class FixedTextEncoder:
    """What ``RFLOW.sample`` needs of a text encoder: fixed caption embeddings and masks, and the
    model's null caption (as Open-Sora's T5Encoder.null gives it)."""

    def __init__(self, y: torch.Tensor, mask: torch.Tensor, model):
        self.y, self.mask, self.model = y, mask, model

    def encode(self, prompts):
        assert len(prompts) == self.y.shape[0]
        return {"y": self.y, "mask": self.mask}

    def null(self, n):
        return self.model.y_embedder.y_embedding[None].repeat(n, 1, 1)[:, None]


def caption(generator, batch: int, lengths) -> tuple[torch.Tensor, torch.Tensor]:
    """Open-Sora's caption input [B, 1, L, C] and mask [B, L] (valid tokens first)."""
    y = torch.randn(batch, 1, TINY["model_max_length"], TINY["caption_channels"], generator=generator)
    mask = (torch.arange(TINY["model_max_length"])[None] < torch.tensor(lengths)[:, None]).long()
    return y, mask


def forward_case(name: str, model, generator) -> dict[str, torch.Tensor]:
    grid = GRIDS.get(name, GRIDS["square"])
    batch, frames, height, width, pixel_h, pixel_w = grid
    y, mask = caption(generator, batch, (5, TINY["model_max_length"]))
    inputs = {"x": torch.randn(batch, TINY["in_channels"], frames, height, width, generator=generator),
              "timestep": torch.tensor(TIMESTEPS), "y": y, "mask": mask, "fps": torch.tensor([24.0, 8.0]),
              "height": torch.full((batch,), float(pixel_h)), "width": torch.full((batch,), float(pixel_w))}
    if name == "x_mask":   # True: generated; False: given (t=0 modulation)
        inputs["x_mask"] = torch.tensor([[False, True, True], [True, False, False]])
    if name == "null_caption":   # CFG's unconditional half: the null caption under the prompt's mask
        inputs["y"] = model.y_embedder.y_embedding[None, None].repeat(batch, 1, 1, 1).clone()
    with torch.no_grad():
        out = model(**inputs)
    return {**inputs, "out": out}


def sample_case(model, RFLOW, generator) -> dict[str, torch.Tensor]:
    n, frames, height, width, pixel_h, pixel_w, num_frames = 2, 5, 8, 10, 64, 80, 17
    y, mask = caption(generator, n, (7, 3))
    z = torch.randn(n, TINY["in_channels"], frames, height, width, generator=generator)
    extra = {"height": torch.full((n,), float(pixel_h)), "width": torch.full((n,), float(pixel_w)),
             "num_frames": torch.full((n,), float(num_frames)), "fps": torch.full((n,), 24.0)}
    scheduler = RFLOW(num_sampling_steps=10, cfg_scale=7.0, use_timestep_transform=True)
    with torch.no_grad():
        out = scheduler.sample(model, FixedTextEncoder(y, mask, model), z=z.clone(), prompts=["a", "b"],
                               device="cpu", additional_args=extra, progress=False)
    return {"z": z, "y": y, "mask": mask, **extra, "steps": torch.tensor(10), "guidance": torch.tensor(7.0),
            "out": out}


def write(opensora, out: Path) -> None:
    STDiT3, STDiT3Config, RFLOW = opensora
    torch.manual_seed(SEED)
    generator = torch.Generator().manual_seed(SEED)
    model = STDiT3(STDiT3Config(**TINY)).eval()
    randomize(model, generator)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tensors = {}
    for name in CASES:
        tensors.update({f"{name}.{k}": v.contiguous() for k, v in forward_case(name, model, generator).items()})
    tensors.update({f"sample.{k}": v.contiguous() for k, v in sample_case(model, RFLOW, generator).items()})
    # One metadata key: the order of several is not stable, so the file's bytes would not be.
    save_file(tensors, str(out / "cases.safetensors"),
              metadata={"generator": "scripts/make_opensora_fixtures.py, Open-Sora v1.2.0"})
    print(f"wrote {out}: " + ", ".join(f"{p.name} {p.stat().st_size // 1024} KiB" for p in sorted(out.iterdir())))


# ------------------------------------------------------------------------------- the check

def check(opensora, out: Path) -> None:
    """videodit's import reproduces Open-Sora's outputs, and its export loads back into Open-Sora."""
    sys.path.insert(0, str(REPO))
    from safetensors.torch import load_file

    from videodit.models import load_pretrained
    from videodit.models.stdit.opensora_files import save_opensora
    STDiT3, STDiT3Config, _ = opensora

    cases = load_file(str(out / "cases.safetensors"))
    ours = load_pretrained(out).eval()
    case = {k.split(".", 1)[1]: v for k, v in cases.items() if k.startswith("padded.")}
    with torch.no_grad():
        mine = ours(case["x"], case["timestep"] / 1000, case["y"][:, 0], case["mask"].bool(), case["fps"],
                    height=case["height"], width=case["width"])
    diff = (mine + case["out"][:, :4]).abs().max()   # videodit predicts noise - x0, Open-Sora x0 - noise
    print(f"videodit vs Open-Sora (padded): max |diff| {diff:.2e}")
    assert diff <= 1e-5, diff
    with tempfile.TemporaryDirectory() as tmp:
        save_opensora(ours, tmp)
        # What STDiT3.from_pretrained does under the transformers 4.x of Open-Sora 1.2's time: the
        # model from config.json, then every tensor, strictly. (transformers 5's from_pretrained calls
        # initialize_weights after loading, which STDiT3 overrides to re-initialise every Linear.)
        theirs = STDiT3(STDiT3Config.from_pretrained(tmp)).eval()
        theirs.load_state_dict(load_file(f"{tmp}/model.safetensors"), strict=True)
        inputs = {k: v for k, v in case.items() if k != "out"}
        with torch.no_grad():
            again = theirs(**inputs)[:, :4]
    diff = (again - case["out"][:, :4]).abs().max()
    print(f"export -> Open-Sora's STDiT3 (padded): max |diff| {diff:.2e}")
    assert diff <= 1e-5, diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--opensora", required=True, type=Path, help="Open-Sora checkout at tag v1.2.0")
    parser.add_argument("--out", type=Path, default=REPO / "tests/fixtures/opensora/stdit3")
    parser.add_argument("--no-check", action="store_true", help="skip the videodit round trip")
    args = parser.parse_args()
    torch.set_num_threads(1)   # the same reduction order everywhere
    opensora = import_opensora(args.opensora.resolve())
    write(opensora, args.out)
    if not args.no_check:
        check(opensora, args.out)
    (args.out / "README.md").write_text(README)


README = """\
# Open-Sora 1.2 STDiT3 golden fixtures

Written by `scripts/make_opensora_fixtures.py --opensora OPEN_SORA_V1.2.0_CHECKOUT` with
Open-Sora's own STDiT3 and RFLOW code (tag v1.2.0, commit 17cce90) on CPU in fp32; see the
script's docstring for the cases. `config.json` + `model.safetensors` are a tiny random STDiT3 in
Open-Sora's `save_pretrained` layout; `cases.safetensors` holds the inputs and outputs.
Read by `tests/models/test_opensora_stdit.py`.
"""


if __name__ == "__main__":
    main()
