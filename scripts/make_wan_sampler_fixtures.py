"""Write tests/fixtures/wan_sampler/ with Wan2.1's own flow UniPC scheduler.

    python scripts/make_wan_sampler_fixtures.py /path/to/Wan2.1 [--out DIR] [--no-check]

The checkout is Wan-Video/Wan2.1 (commit 9737cba). Only ``wan/utils/fm_solvers_unipc.py`` is
loaded, straight from its file (the ``wan`` package ``__init__`` would pull in the models, the
text encoder and flash-attention); it needs numpy, torch and diffusers (its base classes),
nothing to stub. diffusers also provides the Euler reference.

What it writes into ``--out`` (default tests/fixtures/wan_sampler, a few KB):

- ``fixtures.safetensors``:
  ``grid.{steps}x{shift}.sigmas`` / ``.timesteps``: ``FlowUniPCMultistepScheduler(shift=1)``
  after ``set_timesteps(steps, shift=shift)``, as ``wan/text2video.py`` builds it;
  ``model.*`` + ``noise``: a fixed fake velocity model (below) and the starting noise;
  ``unipc.{case}.x0``: the result of Wan's generation loop (``text2video.py``: int64 timestep to
  the model, ``uncond + guide_scale * (cond - uncond)``, ``scheduler.step``) with the fake model;
  ``euler.{case}.x0``: the same loop with diffusers' ``FlowMatchEulerDiscreteScheduler(shift=1)``
  handed Wan's sigmas and timesteps, begin index 0 as WanPipeline sets it.
- ``cases.json``: the cases, the fake model's formula, library versions and the sha256 of the
  scheduler file used.

The fake model: ``v(x, tau) = W x + 0.3 tanh(x) + b cos(pi tau / 1000) + 0.1 sin(3 tau / 1000)``,
``W`` mixing channels, ``tau`` the timestep the model is given; cond and uncond differ in
``W`` and ``b``. Deterministic (seeded, one thread, fp32 on CPU). After writing it checks that
``videodit.diffusion.flow_unipc`` / ``flow_euler`` reproduce the outputs (``--no-check`` skips).
tests/diffusion/test_flow_unipc.py reads the fixtures; it never needs Wan.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
SEED = 9737
SHAPE = (2, 4, 2, 3, 3)            # [B, C, T, H, W] latents
# (steps, shift, guidance). Wan's defaults: t2v 50 steps shift 5, i2v 480p shift 3; 1-3 steps
# exercise the order warm-up and lower_order_final; 40 x 12 is the grid diffusers gets wrong most.
UNIPC_CASES = [(10, 3.0, 5.0), (10, 5.0, 5.0), (10, 12.0, 5.0), (40, 12.0, 5.0), (50, 5.0, 5.0),
               (10, 5.0, 1.0), (1, 5.0, 5.0), (2, 5.0, 5.0), (3, 5.0, 5.0)]
EULER_CASES = [(10, 5.0, 5.0), (10, 12.0, 5.0), (40, 12.0, 5.0)]
# Grids only. 100 x 16 repeats int timesteps (999, 999, 998, 998, ...): Wan's scheduler finds its
# first step by timestep value, starts at index 1 and fails its order assertion on that grid.
EXTRA_GRIDS = [(50, 3.0), (40, 16.0), (100, 16.0)]
# Wan 2.2's two experts (text2video.py / image2video.py; the scheduler file is the same as 2.1's):
# (steps, shift, boundary, (low guidance, high guidance)); T2V-A14B's and I2V-A14B's recipes.
EXPERT_CASES = [(10, 12.0, 0.875, (3.0, 4.0)), (40, 12.0, 0.875, (3.0, 4.0)), (10, 5.0, 0.900, (3.5, 3.5))]


def case_name(steps: int, shift: float, guidance: float | None = None) -> str:
    return f"{steps}x{shift:g}" + ("" if guidance is None else f".g{guidance:g}")


def load_wan_unipc(checkout: Path):
    path = checkout / "wan/utils/fm_solvers_unipc.py"
    if not path.is_file():
        sys.exit(f"error: {path} not found; pass the root of a Wan2.1 checkout")
    spec = importlib.util.spec_from_file_location("wan_fm_solvers_unipc", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, hashlib.sha256(path.read_bytes()).hexdigest()


def fake_model(g: torch.Generator) -> dict[str, torch.Tensor]:
    c = SHAPE[1]
    eye = torch.eye(c)
    return {"model.w_cond": -0.6 * eye + 0.25 * torch.randn(c, c, generator=g),
            "model.w_uncond": -0.4 * eye + 0.25 * torch.randn(c, c, generator=g),
            "model.b_cond": torch.randn(c, generator=g),
            "model.b_uncond": 0.5 * torch.randn(c, generator=g)}


def velocity(params: dict, which: str, x: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """The fake model; ``tau`` [B] or [1] is the timestep it is given (Wan: int64 0..999)."""
    tau = tau.to(torch.float32).view(-1, 1, 1, 1, 1)
    w, b = params[f"model.w_{which}"], params[f"model.b_{which}"].view(1, -1, 1, 1, 1)
    return (torch.einsum("oc,bcthw->bothw", w, x) + 0.3 * torch.tanh(x)
            + b * torch.cos(math.pi * tau / 1000) + 0.1 * torch.sin(3 * tau / 1000))


def wan_grid(wan, steps: int, shift: float):
    scheduler = wan.FlowUniPCMultistepScheduler(num_train_timesteps=1000, shift=1, use_dynamic_shifting=False)
    scheduler.set_timesteps(steps, device="cpu", shift=shift)
    return scheduler


def run_loop(scheduler, params: dict, noise: torch.Tensor, guidance: float) -> torch.Tensor:
    """text2video.py's loop, model calls replaced by the fake model."""
    latents = noise.clone()
    for t in scheduler.timesteps:
        timestep = torch.stack([t])
        cond = velocity(params, "cond", latents, timestep)
        uncond = velocity(params, "uncond", latents, timestep)
        pred = uncond + guidance * (cond - uncond)
        latents = scheduler.step(pred, t, latents, return_dict=False)[0]
    return latents


def run_expert_loop(scheduler, params: dict, noise: torch.Tensor, boundary: float, guidance) -> torch.Tensor:
    """Wan 2.2's text2video.py loop: the high-noise expert (the fake model's ``*_high`` weights)
    while ``t >= boundary * 1000``, each expert with its own guidance (low, high)."""
    latents, boundary = noise.clone(), boundary * 1000
    for t in scheduler.timesteps:
        timestep = torch.stack([t])
        high = t.item() >= boundary
        suffix = "_high" if high else ""
        cond = velocity(params, "cond" + suffix, latents, timestep)
        uncond = velocity(params, "uncond" + suffix, latents, timestep)
        pred = uncond + (guidance[1] if high else guidance[0]) * (cond - uncond)
        latents = scheduler.step(pred, t, latents, return_dict=False)[0]
    return latents


def expert_name(steps: int, shift: float, boundary: float, guidance) -> str:
    return f"{steps}x{shift:g}.b{boundary:g}.g{guidance[0]:g}-{guidance[1]:g}"


def diffusers_euler_on_wan_grid(sigmas: torch.Tensor, timesteps: torch.Tensor):
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
    scheduler.set_timesteps(sigmas=sigmas[:-1].tolist(), timesteps=timesteps.tolist())
    scheduler.set_begin_index(0)
    assert torch.equal(scheduler.sigmas, sigmas) and torch.equal(scheduler.timesteps, timesteps.float())
    return scheduler


def write(wan, sha: str, out: Path) -> None:
    import diffusers
    import numpy

    g = torch.Generator().manual_seed(SEED)
    tensors = fake_model(g)
    tensors["noise"] = torch.randn(SHAPE, generator=g)
    grids = sorted({(s, k) for s, k, _ in UNIPC_CASES + EULER_CASES} | set(EXTRA_GRIDS))
    for steps, shift in grids:
        scheduler = wan_grid(wan, steps, shift)
        tensors[f"grid.{case_name(steps, shift)}.sigmas"] = scheduler.sigmas.clone()
        tensors[f"grid.{case_name(steps, shift)}.timesteps"] = scheduler.timesteps.clone()
    for steps, shift, guidance in UNIPC_CASES:
        x0 = run_loop(wan_grid(wan, steps, shift), tensors, tensors["noise"], guidance)
        tensors[f"unipc.{case_name(steps, shift, guidance)}.x0"] = x0
    for steps, shift, guidance in EULER_CASES:
        grid = case_name(steps, shift)
        scheduler = diffusers_euler_on_wan_grid(tensors[f"grid.{grid}.sigmas"], tensors[f"grid.{grid}.timesteps"])
        tensors[f"euler.{case_name(steps, shift, guidance)}.x0"] = run_loop(scheduler, tensors, tensors["noise"],
                                                                          guidance)
    # Drawn after everything above, so the earlier fixtures stay as they were.
    tensors.update({k.replace("_cond", "_cond_high").replace("_uncond", "_uncond_high"): v
                    for k, v in fake_model(g).items()})
    for steps, shift, boundary, guidance in EXPERT_CASES:
        x0 = run_expert_loop(wan_grid(wan, steps, shift), tensors, tensors["noise"], boundary, guidance)
        tensors[f"experts.{expert_name(steps, shift, boundary, guidance)}.x0"] = x0
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, out / "fixtures.safetensors")
    meta = {
        "source": "Wan-Video/Wan2.1 commit 9737cba, wan/utils/fm_solvers_unipc.py",
        "fm_solvers_unipc_sha256": sha,
        "versions": {"torch": torch.__version__, "diffusers": diffusers.__version__, "numpy": numpy.__version__},
        "seed": SEED, "shape": list(SHAPE),
        "model": "v(x, tau) = W x + 0.3 tanh(x) + b cos(pi tau/1000) + 0.1 sin(3 tau/1000); W mixes channels; "
                 "cond/uncond differ in W and b; tau = the timestep the model is given",
        "grids": [{"steps": s, "shift": k, "key": f"grid.{case_name(s, k)}"} for s, k in grids],
        "unipc": [{"steps": s, "shift": k, "guidance": w, "key": f"unipc.{case_name(s, k, w)}.x0"}
                  for s, k, w in UNIPC_CASES],
        "euler": [{"steps": s, "shift": k, "guidance": w, "key": f"euler.{case_name(s, k, w)}.x0",
                   "reference": "diffusers FlowMatchEulerDiscreteScheduler(shift=1) with Wan's sigmas and timesteps"}
                  for s, k, w in EULER_CASES],
        "experts": [{"steps": s, "shift": k, "boundary": b, "guidance": list(w),
                     "key": f"experts.{expert_name(s, k, b, w)}.x0",
                     "reference": "Wan2.2 text2video.py's loop (commit 42bf4cf): the *_high fake model while "
                                  "t >= boundary * 1000, guidance (low, high)"}
                    for s, k, b, w in EXPERT_CASES],
    }
    (out / "cases.json").write_text(json.dumps(meta, indent=1) + "\n")


def check(out: Path) -> None:
    sys.path.insert(0, str(REPO))
    from videodit.diffusion import flow_euler, flow_unipc

    tensors = load_file(out / "fixtures.safetensors")
    meta = json.loads((out / "cases.json").read_text())
    cond = lambda x, t: velocity(tensors, "cond", x, t * 1000)        # noqa: E731
    uncond = lambda x, t: velocity(tensors, "uncond", x, t * 1000)    # noqa: E731
    for grid in meta["grids"]:
        sigmas, timesteps = flow_unipc.grid(grid["steps"], grid["shift"])
        assert torch.equal(timesteps, tensors[grid["key"] + ".timesteps"]), grid
        assert torch.equal(sigmas, tensors[grid["key"] + ".sigmas"]), grid
    for name, module in (("unipc", flow_unipc), ("euler", flow_euler)):
        for case in meta[name]:
            want = tensors[case["key"]]
            got = module.sample(cond, tensors["noise"], case["steps"], case["shift"], case["guidance"], uncond)
            rel = ((got - want).abs().max() / want.abs().max()).item()
            print(f"{case['key']}: max |diff| / max |ref| = {rel:.2e}")
            assert rel < 1e-5, case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wan", type=Path, help="Wan2.1 checkout (commit 9737cba)")
    parser.add_argument("--out", type=Path, default=REPO / "tests/fixtures/wan_sampler")
    parser.add_argument("--no-check", action="store_true", help="skip the videodit comparison")
    args = parser.parse_args()
    torch.set_num_threads(1)   # the same reduction order everywhere
    wan, sha = load_wan_unipc(args.wan.resolve())
    write(wan, sha, args.out)
    if not args.no_check:
        check(args.out)


if __name__ == "__main__":
    main()
