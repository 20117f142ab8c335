"""Write tests/fixtures/ltx2_schedule/ from Lightricks' own LTX-2 code: ltx-trainer's sigma sampler
and training strategy, ltx-core's schedule, guider and Euler step, ltx-pipelines' denoising loop.

    python scripts/make_ltx2_schedule_fixtures.py --checkout /path/to/LTX-2 [--out DIR] [--no-check]

The checkout is Lightricks/LTX-2 (400fd31); its three ``packages/*/src`` folders go on sys.path.
It needs torch, numpy, scipy, einops, pydantic, rich, tqdm, av and PIL; torchaudio and OpenImageIO
(imported by modules on the way, used by none of what runs here) are answered with empty shells.

What it writes (about 0.1 MB):

- ``tensors.safetensors``:
  ``sigmas.{seed}.{tokens}.{batch}``: ``ShiftedLogitNormalTimestepSampler().sample(batch, tokens)``
  after ``torch.manual_seed(seed)``;
  ``objective.{case}.*``: ``FlexibleStrategy.prepare_training_inputs`` (one video stream, a
  ``first_frame`` condition of probability p or none) and ``compute_loss`` after
  ``torch.manual_seed(seed)``, on given latents ``x0`` and a given prediction ``pred``: the noisy
  tokens, per-token timesteps, sigmas, targets, loss mask and per-sample loss, in LTX's token layout;
  ``schedule.{case}``: ``LTX2Scheduler().execute(steps, latent=...)``;
  ``loop.{case}.*``: the result of ltx-pipelines' one-stage sampling (``_build_state`` with a
  ``GaussianNoiser`` and ``VideoConditionByLatentIndex`` at index 0, ``euler_denoising_loop`` with
  ``EulerDiffusionStep`` and a ``FactoryGuidedDenoiser``, ``clear_conditioning``, ``unpatchify``) with
  a stand-in transformer (below), fp32, one sample; plus the stand-in's weights and text contexts.
- ``cases.json``: the cases, library versions and the sha256 of the reference files read.

The stand-in transformer, on tokens [B, T, C] (``fake_velocity``, repeated in the test):
``v = x W^T + 0.3 tanh(x) + p mean_L(context) cos(pi/2 ts) + 0.1 sin(3 ts) + 0.05 sigma
+ keep * m mean_T(x)``, with ts the per-token timesteps, sigma the per-sample one, p and m vectors
(elementwise products) and keep 0 where the STG perturbation skips the video self-attention of the
STG block (the mean over tokens stands in for self-attention). Every sample's velocity is computed
alone (no products across the batch), so LTX's batching of its guidance branches into one call does
not change its bits. Deterministic: seeded, one thread, fp32 on CPU.

After writing, it runs videodit's ``ltx2_schedule`` / ``ltx2_sampler`` on the same inputs and prints
the largest difference of each comparison (``--no-check`` skips). tests/diffusion/test_ltx2_*.py read
the fixtures; they never need LTX-2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("ltx-core", "ltx-trainer", "ltx-pipelines")
READ = ["packages/ltx-trainer/src/ltx_trainer/timestep_samplers.py",
        "packages/ltx-trainer/src/ltx_trainer/training_strategies/flexible.py",
        "packages/ltx-core/src/ltx_core/components/schedulers.py",
        "packages/ltx-core/src/ltx_core/components/guiders.py",
        "packages/ltx-core/src/ltx_core/components/diffusion_steps.py",
        "packages/ltx-pipelines/src/ltx_pipelines/utils/samplers.py",
        "packages/ltx-pipelines/src/ltx_pipelines/utils/denoisers.py"]

SIGMA_SEEDS = [0, 7, 42]
SIGMA_TOKENS = [1, 512, 1024, 2048, 3570, 4096, 6000, 20000]
SIGMA_BATCHES = [1, 5, 16, 100]        # 16 and up: torch's vectorised normal path
# (name, seed, B, C, F, H, W, first-frame probability; None: no condition configured)
OBJECTIVES = [("t2v", 0, 4, 8, 3, 4, 6, None), ("i2v_half", 1, 6, 8, 3, 4, 6, 0.5),
              ("i2v_all", 2, 3, 16, 2, 2, 3, 1.0), ("one_frame_i2v", 3, 2, 8, 1, 4, 4, 1.0),
              ("batch20", 4, 20, 4, 2, 2, 2, 0.5)]
# (steps, tokens or None): the pipelines' call (no latent) and the HQ pipeline's (a latent's F*H*W)
SCHEDULES = [(1, None), (2, None), (8, None), (30, None), (40, None), (15, 3570), (15, 72), (30, 20000)]
UNSTRETCHED = [(30, None), (15, 3570)]
LATENT = (1, 16, 3, 4, 6)              # [B, C, F, H, W] of the sampling loops; T = 72 tokens
CONTEXT = (5, 16)                      # text tokens, width (= C)
STG_BLOCK = 28
# (name, steps, schedule tokens, cfg, stg, rescale, modality scale, first-frame strength or None, seed)
LOOPS = [("t2v_dev", 30, None, 3.0, 1.0, 0.7, 3.0, None, 11),
         ("i2v_dev", 30, None, 3.0, 1.0, 0.7, 3.0, 1.0, 12),
         ("i2v_strength", 8, None, 3.0, 0.0, 0.0, 1.0, 0.6, 13),
         ("cfg_only", 40, None, 3.0, 0.0, 0.0, 1.0, None, 14),
         ("shifted_rescale", 15, 72, 3.0, 0.0, 0.45, 1.0, 1.0, 15),
         ("unguided", 10, None, 1.0, 0.0, 0.0, 1.0, None, 16)]


def fake_velocity(w: dict, tokens, timesteps, sigma, context, keep):
    """The stand-in transformer's velocity on tokens [B, T, C]; timesteps [B, T] (or [B, T, 1]),
    sigma [B], context [B, L, D], keep [B] (0: the STG branch, self-attention skipped)."""
    b, t, _ = tokens.shape
    ts = timesteps.reshape(b, t, 1)
    text = (context.mean(dim=1) * w["P"])[:, None, :]
    mix = tokens.mean(dim=1, keepdim=True) * w["M"]
    return (tokens @ w["W"].T + 0.3 * torch.tanh(tokens) + text * torch.cos(math.pi / 2 * ts)
            + 0.1 * torch.sin(3 * ts) + 0.05 * sigma.view(b, 1, 1) + keep.view(b, 1, 1) * mix)


def import_reference(checkout: Path):
    for package in PACKAGES:
        sys.path.insert(0, str(checkout / "packages" / package / "src"))
    sys.path.insert(0, str(REPO / "scripts"))
    from opensora2_reference import _ShellFinder

    sys.meta_path.insert(0, _ShellFinder({"torchaudio", "OpenImageIO"}))
    warnings.filterwarnings("ignore")


def sigma_fixtures(tensors: dict, cases: dict) -> None:
    from ltx_trainer.timestep_samplers import ShiftedLogitNormalTimestepSampler

    sampler = ShiftedLogitNormalTimestepSampler()
    cases["sigmas"] = []
    for seed in SIGMA_SEEDS:
        for tokens in SIGMA_TOKENS:
            for batch in SIGMA_BATCHES:
                torch.manual_seed(seed)
                key = f"sigmas.{seed}.{tokens}.{batch}"
                tensors[key] = sampler.sample(batch, tokens)
                cases["sigmas"].append({"key": key, "seed": seed, "tokens": tokens, "batch": batch,
                                        "mu": sampler._get_shift_for_sequence_length(tokens)})


def objective_fixtures(tensors: dict, cases: dict) -> None:
    from ltx_trainer.timestep_samplers import ShiftedLogitNormalTimestepSampler
    from ltx_trainer.training_strategies.flexible import (FirstFrameConditionConfig, FlexibleStrategy,
                                                          FlexibleStrategyConfig, ModalityConfig)

    cases["objective"] = []
    for name, seed, b, c, f, h, w, p in OBJECTIVES:
        conditions = [] if p is None else [FirstFrameConditionConfig(probability=p)]
        config = FlexibleStrategyConfig(video=ModalityConfig(is_generated=True, latents_dir="latents",
                                                             conditions=conditions))
        strategy = FlexibleStrategy(config)
        gen = torch.Generator().manual_seed(100 + seed)
        x0 = torch.randn(b, c, f, h, w, generator=gen)
        pred = torch.randn(b, f * h * w, c, generator=gen)
        batch = {"video_latents": {"latents": x0, "num_frames": torch.full((b,), f), "height": torch.full((b,), h),
                                   "width": torch.full((b,), w), "fps": torch.full((b,), 24.0)},
                 "conditions": {"video_prompt_embeds": torch.zeros(b, 4, 8), "prompt_attention_mask": torch.ones(b, 4)}}
        torch.manual_seed(seed)
        inputs = strategy.prepare_training_inputs(batch, ShiftedLogitNormalTimestepSampler())
        loss = strategy.compute_loss(pred, None, inputs)
        prefix = f"objective.{name}"
        tensors.update({f"{prefix}.x0": x0, f"{prefix}.pred": pred, f"{prefix}.x_t": inputs.video.latent,
                        f"{prefix}.timesteps": inputs.video.timesteps, f"{prefix}.sigma": inputs.video.sigma,
                        f"{prefix}.target": inputs.video_targets,
                        f"{prefix}.loss_mask": inputs.video_loss_mask.to(torch.uint8), f"{prefix}.loss": loss})
        cases["objective"].append({"name": name, "seed": seed, "shape": [b, c, f, h, w], "first_frame_p": p})


def schedule_fixtures(tensors: dict, cases: dict) -> None:
    from ltx_core.components.schedulers import LTX2Scheduler

    cases["schedules"] = []
    for stretch, grid in ((True, SCHEDULES), (False, UNSTRETCHED)):
        for steps, tokens in grid:
            latent = None if tokens is None else torch.empty(1, 128, 1, 1, tokens)   # F*H*W = tokens
            key = f"schedule.{steps}.{tokens}.{'stretched' if stretch else 'plain'}"
            tensors[key] = LTX2Scheduler().execute(steps=steps, latent=latent, stretch=stretch)
            cases["schedules"].append({"key": key, "steps": steps, "tokens": tokens, "stretch": stretch})


class FakeTransformer(torch.nn.Module):
    """ltx-core's transformer interface, ``(video, audio, perturbations) -> (v, None)``."""

    num_blocks = 48

    def __init__(self, weights: dict):
        super().__init__()
        self.w = weights

    def forward(self, video, audio, perturbations):
        from ltx_core.guidance.perturbations import PerturbationType

        b = video.latent.shape[0]
        keep = (torch.ones(b) if perturbations is None else
                perturbations.mask(PerturbationType.SKIP_VIDEO_SELF_ATTN, STG_BLOCK).reshape(b))
        v = fake_velocity(self.w, video.latent, video.timesteps, video.sigma, video.context, keep)
        return v, None


def loop_fixtures(tensors: dict, cases: dict) -> None:
    from ltx_core.components.diffusion_steps import EulerDiffusionStep
    from ltx_core.components.guiders import MultiModalGuiderParams, create_multimodal_guider_factory
    from ltx_core.components.noisers import GaussianNoiser
    from ltx_core.components.patchifiers import VideoLatentPatchifier
    from ltx_core.components.schedulers import LTX2Scheduler
    from ltx_core.conditioning.types.latent_cond import VideoConditionByLatentIndex
    from ltx_core.model.transformer import X0Model
    from ltx_core.tools import VideoLatentTools
    from ltx_core.types import VideoLatentShape
    from ltx_pipelines.utils.blocks import _build_state
    from ltx_pipelines.utils.denoisers import FactoryGuidedDenoiser
    from ltx_pipelines.utils.samplers import euler_denoising_loop
    from ltx_pipelines.utils.types import ModalitySpec

    gen = torch.Generator().manual_seed(2026)
    c = LATENT[1]
    weights = {"W": -0.5 * torch.eye(c) + 0.2 * torch.randn(c, c, generator=gen),
               "P": torch.randn(c, generator=gen),
               "M": 0.5 * torch.randn(c, generator=gen)}
    prompt = torch.randn(1, *CONTEXT, generator=gen)
    negative = torch.randn(1, *CONTEXT, generator=gen)
    image = torch.randn(1, c, 1, *LATENT[3:], generator=gen)
    tensors.update({f"loop.model.{k}": v for k, v in weights.items()})
    tensors.update({"loop.prompt": prompt, "loop.negative": negative, "loop.image": image})
    transformer = X0Model(FakeTransformer(weights))
    tools = VideoLatentTools(VideoLatentPatchifier(patch_size=1), VideoLatentShape(*LATENT), fps=24.0)
    cases["loops"] = []
    for name, steps, tokens, cfg, stg, rescale, modality, strength, seed in LOOPS:
        params = MultiModalGuiderParams(cfg_scale=cfg, stg_scale=stg, rescale_scale=rescale, modality_scale=modality,
                                        skip_step=0, stg_blocks=[STG_BLOCK])
        latent = None if tokens is None else torch.empty(1, 128, 1, 1, tokens)
        sigmas = LTX2Scheduler().execute(steps=steps, latent=latent).to(torch.float32)
        conditionings = [] if strength is None else [VideoConditionByLatentIndex(image, strength, latent_idx=0)]
        noiser = GaussianNoiser(generator=torch.Generator().manual_seed(seed))
        state = _build_state(ModalitySpec(context=prompt, conditionings=conditionings), tools, noiser,
                             torch.float32, torch.device("cpu"))
        denoiser = FactoryGuidedDenoiser(v_context=prompt, a_context=None,
                                         video_guider_factory=create_multimodal_guider_factory(params, negative))
        with torch.no_grad():
            state, _ = euler_denoising_loop(sigmas, state, None, EulerDiffusionStep(), transformer, denoiser)
        state = tools.unpatchify(tools.clear_conditioning(state))
        tensors[f"loop.{name}.x"] = state.latent
        cases["loops"].append({"name": name, "steps": steps, "tokens": tokens, "cfg": cfg, "stg": stg,
                               "rescale": rescale, "modality_scale": modality, "strength": strength, "seed": seed})
    cases["loop_model"] = {"latent": list(LATENT), "context": list(CONTEXT), "stg_block": STG_BLOCK,
                           "formula": "x W^T + 0.3 tanh(x) + P * mean_L(ctx) cos(pi/2 ts) + 0.1 sin(3 ts) "
                                      "+ 0.05 sigma + keep * M * mean_T(x)"}


# ---------------------------------------------------------------------- videodit against the fixtures


def check(out: Path) -> None:
    """videodit's ltx2_schedule / ltx2_sampler on the stored inputs: the largest difference of each."""
    from videodit.diffusion import ltx2_sampler as sampler
    from videodit.diffusion import ltx2_schedule as schedule

    t = load_file(str(out / "tensors.safetensors"))
    cases = json.loads((out / "cases.json").read_text())
    worst = {}

    def note(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        diff = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
        worst[what] = max(worst.get(what, 0.0), diff)

    for case in cases["sigmas"]:
        got = schedule.sample_sigmas(case["batch"], case["tokens"], torch.Generator().manual_seed(case["seed"]))
        note("sigmas", got, t[case["key"]])
        assert schedule.shift_mu(case["tokens"]) == case["mu"]
    for case in cases["objective"]:
        p = f"objective.{case['name']}"
        x0, shape = t[f"{p}.x0"], t[f"{p}.x0"].shape
        got = schedule.noised(x0, torch.Generator().manual_seed(case["seed"]), case["first_frame_p"] or 0.0)
        note("objective sigma", got.sigma, t[f"{p}.sigma"])
        note("objective x_t", schedule.to_tokens(got.x_t), t[f"{p}.x_t"])
        note("objective target", schedule.to_tokens(got.target), t[f"{p}.target"])
        note("objective sigma per token", got.sigma_tokens, t[f"{p}.timesteps"])
        note("objective loss mask", got.loss_mask.to(torch.uint8), t[f"{p}.loss_mask"])
        pred = schedule.from_tokens(t[f"{p}.pred"], shape)
        note("loss", schedule.masked_mse(pred, got.target, got.loss_mask), t[f"{p}.loss"])
    for case in cases["schedules"]:
        note("schedule", sampler.sigmas(case["steps"], case["tokens"], stretch=case["stretch"]), t[case["key"]])
    w = {k: t[f"loop.model.{k}"] for k in "WPM"}

    def branch(context, keep):
        def velocity(x, sigma_tokens, sigma):
            v = fake_velocity(w, schedule.to_tokens(x), sigma_tokens, sigma, context.expand(x.shape[0], -1, -1),
                              torch.full((x.shape[0],), keep))
            return schedule.from_tokens(v, x.shape)
        return velocity

    for case in cases["loops"]:
        noise = sampler.initial_noise(LATENT, torch.Generator().manual_seed(case["seed"]))
        given = None if case["strength"] is None else sampler.FirstFrame(t["loop.image"], case["strength"])
        x = sampler.sample(branch(t["loop.prompt"], 1.0), noise, sampler.sigmas(case["steps"], case["tokens"]),
                           sampler.Guidance(case["cfg"], case["stg"], case["rescale"]),
                           uncond=branch(t["loop.negative"], 1.0), perturbed=branch(t["loop.prompt"], 0.0),
                           first_frame=given)
        want = t[f"loop.{case['name']}.x"]
        worst[f"loop {case['name']} (relative to max |x|)"] = ((x - want).abs().max() / want.abs().max()).item()
    for what, diff in worst.items():
        print(f"  {what:45s} max |difference| {diff:.3g}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkout", type=Path, required=True, help="Lightricks/LTX-2 checkout (400fd31)")
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "ltx2_schedule")
    ap.add_argument("--no-check", action="store_true", help="do not compare videodit's implementation after writing")
    args = ap.parse_args()
    checkout = args.checkout.resolve()
    torch.set_num_threads(1)
    import_reference(checkout)
    tensors, cases = {}, {"ltx2_commit": "400fd31", "torch": torch.__version__,
                          "sha256": {f: hashlib.sha256((checkout / f).read_bytes()).hexdigest() for f in READ}}
    sigma_fixtures(tensors, cases)
    objective_fixtures(tensors, cases)
    schedule_fixtures(tensors, cases)
    loop_fixtures(tensors, cases)
    args.out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(args.out / "tensors.safetensors"))
    (args.out / "cases.json").write_text(json.dumps(cases, indent=1) + "\n")
    print(f"wrote {len(tensors)} tensors to {args.out}")
    if not args.no_check:
        sys.path.insert(0, str(REPO))
        check(args.out)


if __name__ == "__main__":
    main()
