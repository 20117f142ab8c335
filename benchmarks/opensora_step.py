"""One fp32 training step (forward + loss + backward) of videodit's STDiT vs Open-Sora 1.2's STDiT3.

    /work/osenv/bin/python benchmarks/opensora_step.py --opensora /path/to/Open-Sora-v1.2.0 [--depth 2]

``--opensora`` is a checkout of hpcaitech/Open-Sora at tag v1.2.0; the Python running this needs
Open-Sora's model dependencies (einops, timm, rotary_embedding_torch==0.5.3, mmengine,
transformers) and videodit. xformers and colossalai are replaced by the stand-ins of
``scripts/make_opensora_fixtures.py`` (its ``import_opensora``).

Both models are XL wide (hidden 1152, 16 heads, MLP ratio 4, patch (1, 2, 2), 4 latent channels,
4096-channel captions of ``--caption-length`` tokens) at a reduced ``--depth`` (spatial+temporal
block pairs) so that a CPU step takes seconds. Open-Sora's STDiT3 is built by its own code with
seeded random weights (Open-Sora zero-initialises several projections); videodit's STDiT is built
as the ``opensora-v1.2`` model preset builds it (``position_embedding=opensora``,
``null_caption_mask=prompt``, ``bf16_timesteps``, frozen null caption) and gets the same weights
through ``videodit.models.stdit.opensora_stdit.from_opensora``, so both compute the same function with
the same FLOPs. Before timing, the forward outputs are compared in eval mode (videodit predicts
``noise - x0``, Open-Sora ``x0 - noise`` in the first C of its 2C output channels).

Same work on both sides:

- caption masks are all valid (Open-Sora packs only the valid caption tokens, videodit masks the
  padding, so with padding Open-Sora's cross-attention would do less work);
- no caption dropout (Open-Sora's ``token_drop`` calls ``.cuda()``, so STDiT3 is built with
  ``class_dropout_prob=0``; videodit gets no ``drop_caption``);
- Open-Sora's cross-attention goes through ``xformers.ops.memory_efficient_attention`` with a
  block-diagonal mask. The fixture stand-in is a dense reference: at batch B it attends every
  video token to all B captions and masks B-1 of them, B times xformers' work. For timing it is
  swapped (``--xformers blockwise``, the default) for one that runs
  ``F.scaled_dot_product_attention`` per block, as much work as xformers and as videodit's masked
  SDPA; the check below shows both give the same outputs. ``--xformers dense`` keeps the stand-in;
- Open-Sora's self-attention is its own non-flash path (``enable_flash_attn=False``: matmul,
  fp32 softmax, matmul), the one it runs without the flash_attn package; videodit's is SDPA.

The loss is the mean squared error of the velocity on the first C output channels, as
Open-Sora's ``RFLOW.training_losses`` computes it. The steps of the two models alternate
(videodit, Open-Sora, videodit, ...) so machine noise hits both alike; the median of
``--reps`` steps after ``--warmup`` is reported, with the ratio videodit / Open-Sora of the
medians and the median of the ratios of each videodit step to the Open-Sora step right after it.
``--threads`` defaults to 1: on a 2-core machine that other jobs share, 2 intra-op threads made
every step 1.6-2x as slow and noisier (OpenMP threads waiting on busy cores).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from make_opensora_fixtures import import_opensora, randomize  # noqa: E402

from videodit.components import build_model  # noqa: E402
from videodit.config.schema import ModelConfig  # noqa: E402
from videodit.models import count_parameters  # noqa: E402
from videodit.models.stdit.opensora_stdit import from_opensora  # noqa: E402

SEED = 2024
LATENT_CHANNELS, CAPTION_CHANNELS, VAE_STRIDE = 4, 4096, 8
# name: (batch, latent frames, latent height, latent width); pixel size = 8 x the latent's.
CASES = {"16x16": (2, 2, 16, 16), "30x40": (1, 2, 30, 40)}


def blockwise_attention(query, key, value, attn_bias=None, p=0.0, scale=None):
    """xformers' ``memory_efficient_attention`` on packed [1, tokens, heads, head_dim] inputs with a
    ``BlockDiagonalMask``, as much work as xformers does: one SDPA per block."""
    assert p == 0.0
    if attn_bias is None:
        blocks = [(query, key, value)]
    else:
        blocks = zip(query.split(attn_bias.q_seqlen, dim=1), key.split(attn_bias.kv_seqlen, dim=1),
                     value.split(attn_bias.kv_seqlen, dim=1))
    out = [F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale)
           for q, k, v in blocks]
    return torch.cat(out, dim=2).transpose(1, 2).contiguous()


def use_attention(kind: str) -> None:
    ops = sys.modules["xformers.ops"]
    if not hasattr(ops, "dense_stand_in"):
        ops.dense_stand_in = ops.memory_efficient_attention
    ops.memory_efficient_attention = blockwise_attention if kind == "blockwise" else ops.dense_stand_in


def build_models(opensora, depth: int, caption_length: int):
    STDiT3, STDiT3Config, _ = opensora
    torch.manual_seed(SEED)
    theirs = STDiT3(STDiT3Config(depth=depth, hidden_size=1152, num_heads=16, mlp_ratio=4.0, patch_size=(1, 2, 2),
                                 in_channels=LATENT_CHANNELS, caption_channels=CAPTION_CHANNELS,
                                 model_max_length=caption_length, qk_norm=True, pred_sigma=True,
                                 class_dropout_prob=0.0))
    randomize(theirs, torch.Generator().manual_seed(SEED))
    # videodit's model as `model.preset=opensora-v1.2 model.depth=N` builds it (videodit.components).
    model_cfg = ModelConfig(preset="opensora-v1.2", depth=depth).resolved()
    cfg = types.SimpleNamespace(model=model_cfg, text=types.SimpleNamespace(max_length=caption_length))
    ours = build_model(cfg, types.SimpleNamespace(latent_channels=LATENT_CHANNELS),
                       types.SimpleNamespace(dim=CAPTION_CHANNELS))
    ours.load_state_dict(from_opensora(theirs.state_dict(), ours.geometry, pred_sigma=True))
    return ours, theirs


def make_inputs(case: tuple[int, int, int, int], caption_length: int, generator: torch.Generator) -> dict:
    batch, frames, height, width = case
    t = torch.tensor([0.5, 0.25, 0.75, 0.125][:batch])   # exact in bf16 after *1000 (bf16_timesteps)
    return {"x": torch.randn(batch, LATENT_CHANNELS, frames, height, width, generator=generator), "t": t,
            "y": torch.randn(batch, caption_length, CAPTION_CHANNELS, generator=generator),
            "mask": torch.ones(batch, caption_length, dtype=torch.bool), "fps": torch.full((batch,), 24.0),
            "height": torch.full((batch,), float(height * VAE_STRIDE)),
            "width": torch.full((batch,), float(width * VAE_STRIDE)),
            "target": torch.randn(batch, LATENT_CHANNELS, frames, height, width, generator=generator)}


def run_ours(model, i: dict) -> torch.Tensor:
    """videodit's velocity prediction (noise - x0)."""
    return model(i["x"], i["t"], i["y"], i["mask"], i["fps"], height=i["height"], width=i["width"])


def run_theirs(model, i: dict) -> torch.Tensor:
    """Open-Sora's prediction, negated and cut to C channels: the same quantity as videodit's."""
    out = model(i["x"], i["t"] * 1000, i["y"][:, None], i["mask"].long(), fps=i["fps"], height=i["height"],
                width=i["width"])
    return -out[:, :LATENT_CHANNELS]


def train_step(model, run, inputs: dict) -> tuple[float, float]:
    """(seconds, loss) of forward + loss + backward; gradients freed before the clock starts."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss = F.mse_loss(run(model, inputs), inputs["target"])
    loss.backward()
    return time.perf_counter() - start, loss.item()


def check(ours, theirs, inputs: dict) -> dict[str, float]:
    """max |videodit - Open-Sora| of the forward outputs (eval mode, no grad), per attention stand-in."""
    ours.eval(), theirs.eval()
    diffs = {}
    with torch.no_grad():
        mine = run_ours(ours, inputs)
        for kind in ("dense", "blockwise"):
            use_attention(kind)
            diffs[kind] = (mine - run_theirs(theirs, inputs)).abs().max().item()
        diffs["scale"] = mine.abs().max().item()
    ours.train(), theirs.train()
    return diffs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--opensora", required=True, type=Path, help="Open-Sora checkout at tag v1.2.0")
    parser.add_argument("--depth", type=int, default=2, help="spatial+temporal block pairs (XL has 28)")
    parser.add_argument("--caption-length", type=int, default=300, help="caption tokens (Open-Sora 1.2: 300)")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (fixed)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--xformers", choices=("blockwise", "dense"), default="blockwise",
                        help="Open-Sora's cross-attention for timing: per-block SDPA (xformers' work) or the "
                             "fixtures' dense stand-in (B times the work at batch B)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    opensora = import_opensora(args.opensora.resolve())
    started = time.perf_counter()
    ours, theirs = build_models(opensora, args.depth, args.caption_length)
    ours.train(), theirs.train()
    generator = torch.Generator().manual_seed(SEED)
    inputs = {name: make_inputs(CASES[name], args.caption_length, generator) for name in args.cases}

    diffs = check(ours, theirs, inputs[args.cases[0]])
    print(f"forward check ({args.cases[0]}, eval): max |videodit - Open-Sora| {diffs['blockwise']:.2e} with the "
          f"blockwise stand-in, {diffs['dense']:.2e} with the dense one (outputs up to {diffs['scale']:.2f})")
    if diffs["blockwise"] > 1e-4 or diffs["dense"] > 1e-4:
        sys.exit("videodit and Open-Sora disagree: the weight conversion or the model options are wrong")
    use_attention(args.xformers)

    sides = {"videodit": (ours, run_ours), "opensora": (theirs, run_theirs)}
    rows = []
    for name in args.cases:
        times = {side: [] for side in sides}
        losses = {}
        for rep in range(args.warmup + args.reps):
            for side, (model, run) in sides.items():
                seconds, losses[side] = train_step(model, run, inputs[name])
                if rep >= args.warmup:
                    times[side].append(seconds)
        median = {side: statistics.median(v) for side, v in times.items()}
        paired = statistics.median(a / b for a, b in zip(times["videodit"], times["opensora"]))
        rows.append((name, median, paired, abs(losses["videodit"] - losses["opensora"]) / losses["opensora"]))
        print(f"  {name}: videodit {times['videodit']}, opensora {times['opensora']}", flush=True)

    params = {"videodit": count_parameters(ours), "opensora": sum(p.numel() for p in theirs.parameters())}
    trainable = {"videodit": sum(p.numel() for p in ours.parameters() if p.requires_grad),
                 "opensora": sum(p.numel() for p in theirs.parameters() if p.requires_grad)}
    print(f"\ndepth {args.depth} (XL width 1152, 16 heads, patch 1x2x2), captions {CAPTION_CHANNELS} x "
          f"{args.caption_length} tokens, fp32, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"Open-Sora cross-attention stand-in: {args.xformers}, median of {args.reps} after {args.warmup} warm-up")
    for side in sides:
        print(f"parameters {side}: {params[side]:,} ({trainable[side]:,} trainable)")
    print("\n| latents (B x C x T x H x W) | pixels | videodit s/step | Open-Sora s/step | ratio videodit/Open-Sora "
          "| median of paired ratios | loss rel. diff |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, median, paired, loss_diff in rows:
        b, t, h, w = CASES[name]
        print(f"| {b} x {LATENT_CHANNELS} x {t} x {h} x {w} | {h * VAE_STRIDE}x{w * VAE_STRIDE} "
              f"| {median['videodit']:.3f} | {median['opensora']:.3f} "
              f"| **{median['videodit'] / median['opensora']:.3f}** | {paired:.3f} | {loss_diff:.1e} |")
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
