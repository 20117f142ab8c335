"""Write tests/fixtures/opensora2/sampler_* from Open-Sora 2.0's own code: its objective, timestep
shift, conditioning modes and three-way-CFG sampling loop.

    python scripts/make_opensora2_sampler_fixtures.py --checkout /work/refs/opensora2 [--out DIR]

The checkout is hpcaitech/Open-Sora main (7ad6a96), imported through ``scripts/opensora2_reference.py``
plus a few more shells this script needs (torchvision, pandas, openai, ``opensora.datasets`` as a
namespace; peft is imported before the flash_attn stub, which has no ``__spec__``).

What it writes (about 0.3 MB):

- ``sampler_objective.safetensors`` / ``sampler_cases.json`` ``objective``: the lines of
  ``scripts/diffusion/train.py`` that draw t, shift it and build x_t and the target, read from the
  checkout and run as written (``exec``) on given x0, noise and normal draws; their shift alpha
  for several latent shapes; ``get_schedule`` for several sampling grids.
- ``sampler_conditions.safetensors`` / ``cases.json`` ``conditions``: ``prepare_visual_condition_causal``
  and ``_uncausal`` on a random clip with the fake VAE of ``tests/diffusion/opensora2_fake_vae.py``,
  each mode alone and a mixed draw (Python's ``random`` seeded; the uniforms it drew are stored);
  ``prepare_inference_condition`` of each sampling mode from the fake VAE's encodes of a reference.
- ``sampler_model.safetensors`` + ``sampler_loops.safetensors``: a tiny random ``MMDiTModel`` (every
  weight random, liger layout) and the result of Open-Sora's ``prepare_api`` sampling function
  (noise from its ``get_noise``, ``get_schedule``, ``prepare``, ``prepare_inference_condition``,
  ``I2VDenoiser``, the i2v frame replacement) with stand-in T5/CLIP outputs, per case.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "scripts"), str(REPO / "tests" / "diffusion")]

SIGMA_MIN = 1e-5
# latent shapes [B, C, T, H, W] for the training shift (tokens per frame 16 .. 3600)
ALPHA_SHAPES = [(1, 16, 1, 8, 8), (1, 16, 5, 32, 32), (1, 16, 33, 32, 32), (1, 16, 1, 64, 64), (1, 16, 17, 96, 96),
                (1, 16, 32, 90, 160), (1, 128, 32, 24, 24)]
# (steps, latent H, latent W, latent frames, patch) for get_schedule as the sampler calls it
SCHEDULES = [(10, 4, 4, 3, 2), (50, 32, 32, 33, 2), (50, 96, 96, 33, 2), (30, 24, 40, 1, 2), (50, 24, 24, 32, 1)]
CONDITION_MODES = ["t2v", "i2v_head", "i2v_tail", "i2v_loop", "v2v_head", "v2v_tail", "v2v_head_easy", "v2v_tail_easy"]
MIXED = {"t2v": 1, "i2v_head": 5, "i2v_loop": 1, "i2v_tail": 1, "v2v_head": 1, "v2v_tail_easy": 1}
# tiny MMDiT: head 24 = axes (4, 10, 10)
TINY = dict(in_channels=16, vec_in_dim=16, context_in_dim=32, hidden_size=48, mlp_ratio=2.0, num_heads=2,
            depth=1, depth_single_blocks=2, axes_dim=[4, 10, 10], theta=10_000, qkv_bias=True,
            guidance_embed=False, cond_embed=True, fused_qkv=False, use_liger_rope=True)
TEXT_TOKENS = 6
# (name, cond_type, pixel frames, steps, text/image oscillation, temporal ramp)
LOOPS = [("t2v", "t2v", 9, 10, False, False), ("i2v_head", "i2v_head", 9, 10, False, True),
         ("i2v_loop_osci", "i2v_loop", 9, 14, True, True), ("i2v_tail", "i2v_tail", 9, 10, False, False),
         ("v2v_tail", "v2v_tail", 41, 10, False, False)]


def import_reference(checkout: Path):
    import peft  # noqa: F401  (before the flash_attn stub, which transformers' probe cannot read)
    from opensora2_reference import _ShellFinder, import_opensora2

    import_opensora2(checkout)
    sys.meta_path.insert(0, _ShellFinder({"torchvision", "pandas", "openai", "cv2", "decord"}))
    datasets = types.ModuleType("opensora.datasets")
    datasets.__path__ = [str(checkout / "opensora" / "datasets")]
    datasets.save_sample = None   # inference.py imports it; only its saving uses it
    sys.modules["opensora.datasets"] = datasets
    return import_opensora2(checkout, "utils.sampling", "utils.train", "utils.inference", "models.mmdit.model")


def train_lines(checkout: Path, starts: list[str]) -> str:
    """The lines of scripts/diffusion/train.py beginning with ``starts`` (stripped), in order."""
    lines = [line.strip() for line in (checkout / "scripts" / "diffusion" / "train.py").read_text().splitlines()]
    found = []
    for start in starts:
        hits = [line for line in lines if line.startswith(start)]
        if not hits:
            raise SystemExit(f"train.py has no line starting {start!r}: a different Open-Sora version?")
        found.append(hits[0])
    return "\n".join(found)


def objective(checkout: Path, sampling, tensors: dict, cases: dict) -> None:
    alpha_code = train_lines(checkout, ["shift_alpha = get_res_lin_function()", "shift_alpha *= math.sqrt"])
    draw_code = train_lines(checkout, ["t = torch.sigmoid(torch.randn", "t = time_shift(shift_alpha, t)",
                                       "t_rev = 1 - t", "x_t = t_rev", "v_t = (1 - sigma_min)"])
    scope = dict(math=math, torch=torch, get_res_lin_function=sampling.get_res_lin_function,
                 time_shift=sampling.time_shift, device="cpu", dtype=torch.float32, sigma_min=SIGMA_MIN)
    cases["alpha"] = []
    for shape in ALPHA_SHAPES:
        ns = dict(scope, x_0=torch.empty(shape, device="meta"))
        exec(alpha_code, ns)
        cases["alpha"].append({"shape": list(shape), "alpha": ns["shift_alpha"]})
    gen = torch.Generator().manual_seed(20)
    x0 = torch.randn(3, 4, 3, 8, 6, generator=gen)
    noise = torch.randn(x0.shape, generator=gen)
    seed = 77
    ns = dict(scope, x_0=x0, bs=x0.shape[0])
    exec(alpha_code, ns)                           # on the latents, as train.py (before packing)
    ns.update(x_0=sampling.pack(x0), x_1=sampling.pack(noise))
    torch.manual_seed(seed)
    exec(draw_code, ns)
    unpack = lambda z: sampling.unpack(z, x0.shape[-2] * 8, x0.shape[-1] * 8, x0.shape[2])   # noqa: E731
    tensors.update({"objective.x0": x0, "objective.noise": noise, "objective.t": ns["t"],
                    "objective.x_t": unpack(ns["x_t"]), "objective.target": unpack(ns["v_t"])})
    cases["objective"] = {"seed": seed, "sigma_min": SIGMA_MIN, "alpha": ns["shift_alpha"]}
    cases["schedules"] = [{"steps": s, "latent_hw": [h, w], "frames": t, "patch": p,
                           "times": sampling.get_schedule(s, (h * w) // p ** 2, t)} for s, h, w, t, p in SCHEDULES]


def conditions(train, inference, tensors: dict, cases: dict) -> None:
    from opensora2_fake_vae import FakeVAE

    out = []
    for causal in (True, False):
        vae = FakeVAE(causal)
        prepare = train.prepare_visual_condition_causal if causal else train.prepare_visual_condition_uncausal
        frames = 69 if causal else 68            # 18 / 17 latent frames: every v2v mode fits
        gen = torch.Generator().manual_seed(30 + causal)
        video = torch.rand(2, 3, frames, 8, 16, generator=gen) * 2 - 1
        tag = "causal" if causal else "uncausal"
        tensors[f"cond.{tag}.video"] = video
        for mode in CONDITION_MODES + ["mixed"]:
            weights = dict(MIXED) if mode == "mixed" else {mode: 1}
            random.seed(5)
            uniforms = [random.random() for _ in range(video.shape[0])]
            random.seed(5)
            x0, cond = prepare(video, weights, vae)
            tensors[f"cond.{tag}.{mode}"] = cond
            tensors[f"cond.{tag}.x0"] = x0
            out.append({"vae": tag, "mode": mode, "weights": MIXED if mode == "mixed" else {mode: 1},
                        "uniforms": uniforms})
        # sampling: a reference clip's encodes placed by prepare_inference_condition
        reference = torch.rand(3, 65 + causal, 8, 8, generator=gen) * 2 - 1
        tensors[f"ref.{tag}.video"] = reference
        z = torch.zeros(1, 4, 20, 1, 1)
        for mode in CONDITION_MODES[1:]:
            if mode.startswith("v2v"):
                need = (64 if "easy" in mode else 32) + causal
                clip = reference[:, :need] if "head" in mode else reference[:, -need:]
                refs = [vae.encode(clip[None])[0]]
            else:
                refs = [vae.encode(reference[None, :, :1])[0]] if mode != "i2v_tail" else []
                if mode in ("i2v_tail", "i2v_loop"):
                    refs.append(vae.encode(reference[None, :, -1:])[0])
            masks, masked = inference.prepare_inference_condition(z, mode, ref_list=[refs], causal=causal)
            tensors[f"ref.{tag}.{mode}"] = torch.cat([masks, masked], dim=1)
    cases["conditions"] = out


def loops(sampling, inference, mmdit, tensors: dict, cases: dict) -> dict:
    gen = torch.Generator().manual_seed(40)
    model = mmdit.MMDiTModel(mmdit.MMDiTConfig(from_pretrained=None, cache_dir=None, **TINY)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():   # every weight random: zero-initialised layers hide mistakes
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("scale"):               # RMSNorm scales around 1
                p.copy_(1 + 0.2 * noise)
            else:
                p.copy_(noise * (0.1 if p.dim() == 1 else 1 / math.sqrt(p.shape[-1])))
    weights = {k: v.contiguous() for k, v in model.state_dict().items()}
    embeds = {"a red fox runs": torch.randn(1, TEXT_TOKENS, TINY["context_in_dim"], generator=gen),
              "": torch.randn(1, TEXT_TOKENS, TINY["context_in_dim"], generator=gen)}
    pooled = {k: torch.randn(1, TINY["vec_in_dim"], generator=gen) for k in embeds}
    t5 = lambda prompts, **kw: torch.cat([embeds[p] for p in prompts])            # noqa: E731
    clip = lambda prompts, **kw: torch.cat([pooled[p] for p in prompts])          # noqa: E731
    for key in embeds:
        name = "prompt" if key else "empty"
        tensors[f"loop.text.{name}"], tensors[f"loop.pooled.{name}"] = embeds[key][0], pooled[key][0]

    class IdentityAE(torch.nn.Module):   # decode hands back the latents
        def __init__(self):
            super().__init__()
            self.dummy = torch.nn.Parameter(torch.zeros(1))

        def decode(self, x):
            return x

    out = []
    for name, mode, frames, steps, osci, ramp in LOOPS:
        opt = sampling.SamplingOption(width=32, height=32, num_frames=frames, num_steps=steps, guidance=7.5,
                                      guidance_img=3.0, text_osci=osci, image_osci=osci, scale_temporal_osci=ramp,
                                      seed=11, shift=True, method=inference.SamplingMethod.I2V, temporal_reduction=4,
                                      is_causal_vae=True)
        latent_frames = (frames - 1) // 4 + 1
        refs = []
        if mode.startswith("i2v"):
            refs = [torch.randn(4, 1, 4, 4, generator=gen)] + ([torch.randn(4, 1, 4, 4, generator=gen)]
                                                               if mode == "i2v_loop" else [])
        elif mode.startswith("v2v"):
            refs = [torch.randn(4, 9, 4, 4, generator=gen)]
        sampling.collect_references_batch = lambda *a, **k: [refs]   # the encoded reference, as it would return
        api = sampling.prepare_api(model, IdentityAE(), t5, clip, {})
        kwargs = {"ref": ["given"]} if refs else {}
        x = api(opt, mode, seed=11, text=["a red fox runs"], patch_size=2, channel=TINY["in_channels"], **kwargs)
        tensors[f"loop.{name}.noise"] = sampling.get_noise(1, 32, 32, latent_frames, "cpu", torch.float32, 11,
                                                           patch_size=2, channel=4)
        tensors[f"loop.{name}.x"] = x
        for i, r in enumerate(refs):
            tensors[f"loop.{name}.ref{i}"] = r
        out.append({"name": name, "mode": mode, "steps": steps, "oscillation": osci, "ramp": ramp,
                    "latent_frames": latent_frames,
                    "times": sampling.get_schedule(steps, (4 * 4) // 4, latent_frames)})
    cases["loops"] = out
    cases["model"] = {k: v for k, v in TINY.items()}
    return weights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkout", type=Path, required=True, help="hpcaitech/Open-Sora checkout (main, 7ad6a96)")
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "opensora2")
    args = ap.parse_args()
    torch.set_num_threads(1)
    sampling, train, inference, mmdit = import_reference(args.checkout.resolve())
    tensors, cases = {}, {"opensora_commit": "7ad6a96"}
    objective(args.checkout.resolve(), sampling, tensors, cases)
    conditions(train, inference, tensors, cases)
    weights = loops(sampling, inference, mmdit, tensors, cases)
    args.out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(args.out / "sampler_tensors.safetensors"))
    save_file(weights, str(args.out / "sampler_model.safetensors"))
    (args.out / "sampler_cases.json").write_text(json.dumps(cases, indent=1) + "\n")
    print(f"wrote {len(tensors)} tensors, {len(weights)} weights to {args.out}")


if __name__ == "__main__":
    main()
