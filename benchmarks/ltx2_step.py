"""One fp32 CPU training step of videodit's LTX-2 DiT vs Lightricks' own ``LTXModel`` (ltx-core).

    python benchmarks/ltx2_step.py --checkout /tmp/ltx2bench [--size S|tiny] [--version 2.3|2.0]
        [--steps 10] [--warmup 2] [--threads 1] [--profile]

The checkout is Lightricks/LTX-2 (400fd31; ``git archive`` of it is enough);
``scripts/ltx2_reference.py`` imports its ltx-core on CPU (pure PyTorch, einops, numpy). Its
``LTXModel`` is built by ``LTXModelConfigurator.from_metadata`` from a release-style metadata config
at a smaller size, with PyTorch's SDPA at torch's default kernel priority as its attention (what
videodit's attention calls too: equal kernels, so this compares the two models' own code), given
seeded random weights (``make_ltx2_fixtures.randomise``: nothing zero, not even the tables and gates
LTX leaves uninitialised), and its state dict loaded *strictly* into videodit's ``LTX2Model`` built
from the same config (``release_config.geometry_from_release``): the same function, the same FLOPs.
Before timing the forward outputs must agree to 1e-5 relative (max |diff| / max |output|).

Both sides train the video stream, as videodit's LTX-2 does and as ltx-trainer's text-to-video
strategy does without audio: ltx-core is called with ``audio=None`` (its audio stream and cross-modal
attentions idle, their weights present on both sides and left without gradients). Each side gets
the same clips: latents, sigma per sample, the time per token (training's form: ltx-trainer always
passes per-token timesteps), 24 fps and the text. ltx-core takes ltx-trainer's inputs, built once
outside the timed step: patchified latents [B, T, C], positions [B, 3, T, 2] (pixels and seconds) and
the per-token timesteps; videodit takes the latents [B, C, F, H, W], sigma, fps and the frame mask
and builds its RoPE positions and per-token times inside its forward (so it is timed doing a little
more).

Sizes: ``S`` is LTX-2.3's block (gated attention, the modulated text attention, 9 modulation rows)
at video 512 wide (8 heads x 64), audio 256 (8 x 32), 4 blocks, 128 latent channels (LTX's VAE), and
a batch of 2 clips of 128 x 4 x 12 x 16 latents (25 frames at 384x512: 768 video tokens each) with
256 text tokens each, about LTX's 3.5 video tokens per text token at 960x544x49. ``--version 2.0``
takes LTX-2.0's block instead (6 rows, no gates, the DiT's own caption projection from 3840-wide
text). ``tiny`` is a seconds-long smoke run. The timing (interleaved steps, medians, paired ratios,
CPU time, peak RSS growth, ``--profile``) is ``step_race.py``'s.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import step_race  # noqa: E402  (benchmarks/, this script's folder)
import ltx2_reference as ref  # noqa: E402
from make_ltx2_fixtures import randomise  # noqa: E402

from videodit.models.ltx2.model import LTX2Model  # noqa: E402
from videodit.models.ltx2.release_config import geometry_from_release  # noqa: E402

SEED = 2026
# (ltx-core transformer config sizes, latents [B, C, F, H, W], text tokens)
SIZES = {
    "S": (dict(num_attention_heads=8, attention_head_dim=64, audio_num_attention_heads=8, audio_attention_head_dim=32,
               in_channels=128, out_channels=128, audio_in_channels=128, audio_out_channels=128, num_layers=4,
               cross_attention_dim=512, audio_cross_attention_dim=256), (2, 128, 4, 12, 16), 256),
    "tiny": (dict(num_attention_heads=2, attention_head_dim=16, audio_num_attention_heads=2, audio_attention_head_dim=8,
                  in_channels=8, out_channels=8, audio_in_channels=8, audio_out_channels=8, num_layers=1,
                  cross_attention_dim=32, audio_cross_attention_dim=16), (2, 8, 2, 3, 4), 8),
}
COMMON = dict(norm_eps=1e-6, positional_embedding_theta=10000.0, positional_embedding_max_pos=[20, 2048, 2048],
              audio_positional_embedding_max_pos=[20], timestep_scale_multiplier=1000,
              av_ca_timestep_scale_multiplier=1000, rope_type="split", frequencies_precision="float64")
VERSIONS = {"2.3": dict(caption_proj_before_connector=True, apply_gated_attention=True, cross_attention_adaln=True),
            "2.0": dict(caption_channels=3840)}
SIGMAS = (0.35, 0.8)
FPS = 24.0


def config(size: str, version: str) -> dict:
    sizes, _, _ = SIZES[size]
    extra = dict(VERSIONS[version])
    if version == "2.0" and size == "tiny":
        extra["caption_channels"] = 24
    return {"transformer": ref.transformer_config(**sizes, **COMMON, **extra)}


def build_models(checkout: str, size: str, version: str):
    ref.import_ltx_core(checkout)
    from ltx_core.model.transformer.attention import PytorchAttention
    from ltx_core.model.transformer.model_configurator import LTXModelConfigurator
    from ltx_core.model.transformer.transformer import TransformerOpsConfig

    sdpa = PytorchAttention()   # torch's default SDPA priority, as videodit's attention
    cfg = config(size, version)
    torch.manual_seed(SEED)
    theirs = LTXModelConfigurator.from_metadata({"config": cfg},
                                                ops=TransformerOpsConfig.from_functions(attention=sdpa,
                                                                                        masked_attention=sdpa))
    if any(p.is_meta for p in theirs.parameters()):   # LTX-2.0's caption projections (ltx_reference.py)
        theirs.to_empty(device="cpu")
    randomise(theirs, torch.Generator().manual_seed(SEED))
    ours = LTX2Model(geometry_from_release(cfg, "benchmark config"))
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return ours.train(), theirs.train()


def make_inputs(checkout: str, size: str, version: str, generator: torch.Generator) -> dict:
    sizes, latent, tokens = SIZES[size]
    b, _, frames, height, width = latent
    text_width = config(size, version)["transformer"].get("caption_channels") if version == "2.0" else \
        sizes["cross_attention_dim"]
    t = torch.tensor(SIGMAS[:b])
    inputs = {"x": torch.randn(latent, generator=generator), "t": t, "fps": torch.full((b,), FPS),
              "x_mask": torch.ones(b, frames, dtype=torch.bool),
              "context": torch.randn(b, tokens, text_width, generator=generator),
              "target": torch.randn(latent, generator=generator)}
    # ltx-trainer's form, built once: patchified latents, positions, per-token timesteps
    inputs["positions"] = ref.video_positions(checkout, frames, height, width, b, FPS)
    inputs["timesteps"] = t[:, None].expand(b, frames * height * width).contiguous()
    return inputs


def run_ours(model, i: dict) -> torch.Tensor:
    return model(i["x"], i["t"], i["context"], i["fps"], i["x_mask"])


def make_run_theirs(checkout: str):
    ref.import_ltx_core(checkout)
    from ltx_core.model.transformer.modality import Modality

    def run_theirs(model, i: dict) -> torch.Tensor:
        video = Modality(latent=ref.patchify(i["x"]), sigma=i["t"], timesteps=i["timesteps"],
                         positions=i["positions"], context=i["context"], context_mask=None)
        out, _ = model(video, None, None)
        return out.transpose(1, 2).reshape(i["x"].shape)
    return run_theirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", required=True, help="a Lightricks/LTX-2 checkout (packages/ltx-core)")
    parser.add_argument("--size", choices=tuple(SIZES), default="S")
    parser.add_argument("--version", choices=tuple(VERSIONS), default="2.3")
    step_race.add_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    load_before = os.getloadavg()

    ours, theirs = build_models(args.checkout, args.size, args.version)
    inputs = make_inputs(args.checkout, args.size, args.version, torch.Generator().manual_seed(SEED))
    sides = {"videodit": (ours, run_ours), "ltx-core": (theirs, make_run_theirs(args.checkout))}
    relative, scale = step_race.forward_error(sides["videodit"], sides["ltx-core"], inputs)
    print(f"forward check (eval, no grad): max |videodit - ltx-core| / max |ltx-core| = {relative:.2e} "
          f"(outputs up to {scale:.2f})", flush=True)
    if relative > 1e-5:
        sys.exit("videodit and ltx-core disagree: the model, the inputs or the weight names are wrong")

    records = step_race.race(sides, inputs, args.steps, args.warmup, args.profile_rows if args.profile else 0)
    load_after = os.getloadavg()
    sizes, latent, tokens = SIZES[args.size]
    b, c, frames, h, w = latent
    trained = sum(p.numel() for p in ours.parameters() if p.grad is not None)
    print(f"\nLTX-{args.version} {args.size}: video {sizes['num_attention_heads']} heads x "
          f"{sizes['attention_head_dim']}, audio {sizes['audio_num_attention_heads']} x "
          f"{sizes['audio_attention_head_dim']}, {sizes['num_layers']} blocks; "
          f"{sum(p.numel() for p in ours.parameters()):,} parameters ({trained:,} reached by a video step), both sides")
    print(f"latents {b} x {c} x {frames} x {h} x {w} ({frames * h * w} video + {tokens} text tokens per sample), "
          f"per-token times, fp32, {torch.get_num_threads()} thread(s), torch {torch.__version__}; median of "
          f"{args.steps} interleaved steps after {args.warmup} warm-up; loadavg {load_before[0]:.2f} before, "
          f"{load_after[0]:.2f} after")
    step_race.print_table(records, "ltx-core")
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
