"""Write tests/fixtures/distill/ from the public few-step distillation code itself: Self-Forcing's
DMD gradient and generator loss, FastVideo's DMD2 loss, lightx2v's step-distilled Wan sampler.

    python scripts/make_distill_fixtures.py --self-forcing GITDIR --fastvideo GITDIR --lightx2v GITDIR \
        [--out tests/fixtures/distill] [--no-check]

Each GITDIR is a git directory (a bare mirror, or a checkout's ``.git``; a work tree is taken to
mean its ``.git``) of guandeh17/Self-Forcing (33593df), hao-ai-lab/FastVideo (2f3d407) and
ModelTC/lightx2v (0591c35); the file versions are read from HEAD with ``git show``, no work tree
and none of their dependencies are needed (torch, safetensors and PyYAML only).

Nothing of theirs is copied into this repository: the script reads each reference function's
source at run time, cuts it out with ``ast`` and executes it in a namespace of stand-ins:

- Self-Forcing ``model/dmd.py``: ``DMD._compute_kl_grad`` and ``DMD.compute_distribution_matching_loss``
  (which draws the score timestep with ``model/base.py``'s ``BaseModel._get_timestep``, noises the
  sample with ``utils/scheduler.py``'s ``FlowMatchScheduler`` built as ``utils/wan_wrapper.py`` does,
  calls ``_compute_kl_grad`` and forms ``0.5 * mse`` in double), on an object carrying the
  attributes ``DMD.__init__`` derives from ``configs/self_forcing_dmd.yaml`` (guidance_scale 3,
  DMD2 form ``cond + w (cond - uncond)``, per-sample normaliser);
- FastVideo ``fastvideo/train/methods/distribution_matching/dmd2.py``: ``DMD2Method._dmd_loss``
  (Ho-Salimans guidance ``uncond + w (cond - uncond)``, w = ``real_score_guidance_scale`` 4.5 of
  ``examples/train/configs/distribution_matching/wan/dmd2_t2v.yaml``, normaliser a mean over the
  whole batch), with ``fastvideo/train/utils/config.py``'s ``get_optional_float``;
- lightx2v ``lightx2v/models/schedulers/wan/step_distill/scheduler.py``: the whole
  ``WanStepDistillScheduler`` class on a stand-in ``WanScheduler`` base (which only stores the
  config), configured from ``configs/distill/wan_t2v_distill_4step_cfg_lora.json`` (steps
  [1000, 750, 500, 250], sample_shift 5): ``set_denoising_timesteps`` and ``step_post``.

The score networks (Self-Forcing's ``fake_score``/``real_score``, FastVideo's ``critic``/``teacher``
``predict_x0``) are stand-ins returning fixed tensors: the critic's x0, the teacher's conditional
and unconditional x0. Their randomness is pinned: ``torch.randn_like`` answers the stored noise.

Everything runs in float64: the default dtype is float64 while a reference runs (their
``torch.linspace``), lightx2v's ``torch.float32`` casts resolve to float64 (its ``torch`` in the
namespace is torch with that one name changed) and FastVideo's ``Tensor.float()`` casts return
float64 while ``_dmd_loss`` runs. The native float32 runs are made as well; how far they land from
the float64 ones goes into cases.json (``native_fp32``) and nowhere else.

What it writes (about 58 KB):

- ``reference.safetensors`` (float64; shapes [2, 4, 3, 4, 4] = Self-Forcing's [B, F, C, H, W],
  lightx2v's [4 steps, C=4, F=3, H=4, W=4]); ``cases.json`` says what each tensor is;
- ``cases.json``: the commits read, the sha256 of every file read (the ``git show`` bytes), the
  settings taken from their configs and the tensor index.

After writing it runs videodit's ``distill.dmd`` / ``distill.schedule`` on the same inputs and
prints the largest relative difference of each comparison (``--no-check`` skips);
tests/distill/test_reference_parity.py reads the fixture and never needs the checkouts.
"""

from __future__ import annotations

import __future__
import argparse
import ast
import contextlib
import hashlib
import json
import math
import subprocess
import sys
import textwrap
import types
import typing
from pathlib import Path

import numpy as np
import torch
import yaml
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
SEED = 2025
SHAPE = (2, 4, 3, 4, 4)            # [B, F, C, H, W]
LATENT = (4, 3, 4, 4)              # lightx2v's latents [C, F, H, W]
SAMPLE_SCALES = (1.0, 3.0)         # the two samples' magnitudes: per-sample and batch normalisers differ
SCORE_T = 700                      # FastVideo's score timestep (the stand-ins ignore it)

SF_DMD, SF_BASE, SF_SCHED = "model/dmd.py", "model/base.py", "utils/scheduler.py"
SF_CONFIG = "configs/self_forcing_dmd.yaml"
FV_DMD2 = "fastvideo/train/methods/distribution_matching/dmd2.py"
FV_UTIL = "fastvideo/train/utils/config.py"
FV_CONFIG = "examples/train/configs/distribution_matching/wan/dmd2_t2v.yaml"
LX_SCHED = "lightx2v/models/schedulers/wan/step_distill/scheduler.py"
LX_CONFIG = "configs/distill/wan_t2v_distill_4step_cfg_lora.json"


class Checkout:
    """One reference repository's HEAD, read with ``git show``; remembers what it read."""

    def __init__(self, name: str, gitdir: Path):
        gitdir = gitdir.resolve()
        if (gitdir / ".git").exists():
            gitdir = gitdir / ".git"
        self.name, self.gitdir = name, gitdir
        self.commit = self._git("rev-parse", "HEAD").decode().strip()
        self.sha256: dict[str, str] = {}

    def _git(self, *args: str) -> bytes:
        return subprocess.run(["git", "--git-dir", str(self.gitdir), *args], check=True, capture_output=True).stdout

    def show(self, path: str) -> str:
        data = self._git("show", f"{self.commit}:{path}")
        self.sha256[path] = hashlib.sha256(data).hexdigest()
        return data.decode()

    def record(self) -> dict:
        return {"commit": self.commit, "sha256": self.sha256}


def definition(source: str, *names: str) -> str:
    """The source of the class or def reached by ``names`` (a class, then one of its methods),
    dedented so that it executes on its own."""
    body, node = ast.parse(source).body, None
    for name in names:
        node = next(n for n in body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == name)
        body = node.body
    return textwrap.dedent(ast.get_source_segment(source, node, padded=True))


def load(checkout: Checkout, path: str, names: tuple[str, ...], namespace: dict, source: str | None = None):
    """Execute the definition ``names`` of ``path`` in ``namespace`` (annotations left unevaluated,
    as ``from __future__ import annotations`` would); returns the object it defines."""
    source = checkout.show(path) if source is None else source
    code = compile(definition(source, *names), f"<{checkout.name}:{path}:{'.'.join(names)}>", "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    exec(code, namespace)
    return namespace[names[-1]]


class TorchShim(types.ModuleType):
    """``torch`` as a reference's namespace sees it: the module, with the names in ``overrides``
    answered otherwise (the dtype of its casts, its draws of noise)."""

    def __init__(self, **overrides):
        super().__init__("torch")
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@contextlib.contextmanager
def tensor_float_is_double():
    """``Tensor.float()`` returns float64 (FastVideo's loss casts): the fp64 run of the same code."""
    original = torch.Tensor.float
    torch.Tensor.float = lambda self, *args, **kwargs: self.to(torch.float64)
    try:
        yield
    finally:
        torch.Tensor.float = original


def inputs() -> dict:
    """The student's sample, the critic's and the teacher's x0 predictions, the score noise."""
    gen = torch.Generator().manual_seed(SEED)
    scale = torch.tensor(SAMPLE_SCALES, dtype=torch.float64).view(-1, 1, 1, 1, 1)

    def draw(spread: float) -> torch.Tensor:
        return torch.randn(SHAPE, generator=gen, dtype=torch.float64) * spread * scale

    x0 = draw(1.0)
    return {"inputs.x0": x0, "inputs.x0_fake": x0 + draw(0.4), "inputs.x0_real_cond": x0 + draw(0.5),
            "inputs.x0_real_uncond": x0 + draw(0.8), "inputs.noise": draw(1.0) / scale}


class Score:
    """A stand-in score network: the fixed x0 prediction for each conditioning it is asked with."""

    def __init__(self, **outputs: torch.Tensor):
        self.outputs, self.calls = outputs, []

    def __call__(self, key: str, noisy: torch.Tensor) -> torch.Tensor:
        assert noisy.shape == SHAPE, noisy.shape
        self.calls.append(key)
        return self.outputs[key].to(noisy.dtype)


def critic_and_teacher(t: dict) -> tuple[Score, Score]:
    """The critic's stand-in (its x0 for the conditional call) and the teacher's (both branches)."""
    return (Score(cond=t["inputs.x0_fake"]),
            Score(cond=t["inputs.x0_real_cond"], uncond=t["inputs.x0_real_uncond"]))


# ---------------------------------------------------------------------------------- Self-Forcing


def self_forcing(co: Checkout, t: dict, tensors: dict, cases: dict) -> None:
    cfg = yaml.safe_load(co.show(SF_CONFIG))
    shift = float(cfg.get("timestep_shift", 1.0))
    fake, real = critic_and_teacher(t)

    def network(score):   # WanDiffusionWrapper's call: (flow_pred, x0_pred)
        return lambda noisy_image_or_video, conditional_dict, timestep: (
            None, score(conditional_dict["prompt"], noisy_image_or_video))

    ns = {"torch": torch, "Optional": typing.Optional, "Tuple": typing.Tuple}
    scheduler_cls = load(co, SF_SCHED, ("FlowMatchScheduler",), dict(ns))
    get_timestep = load(co, SF_BASE, ("BaseModel", "_get_timestep"), dict(ns))
    noise_calls = []

    def randn_like(x, *args, **kwargs):
        noise_calls.append(tuple(x.shape))
        return t["inputs.noise"].clone().to(x.dtype)

    dmd_ns = dict(ns, torch=TorchShim(randn_like=randn_like), F=torch.nn.functional)
    source = co.show(SF_DMD)
    kl_grad = load(co, SF_DMD, ("DMD", "_compute_kl_grad"), dmd_ns, source)
    dm_loss = load(co, SF_DMD, ("DMD", "compute_distribution_matching_loss"), dmd_ns, source)

    num_train = int(cfg.get("num_train_timestep", 1000))
    model = types.SimpleNamespace(   # what DMD.__init__ derives from the config (no real/fake_guidance_scale there)
        device="cpu", independent_first_frame=False, num_frame_per_block=cfg.get("num_frame_per_block", 1),
        num_train_timestep=num_train, min_step=int(0.02 * num_train), max_step=int(0.98 * num_train),
        real_guidance_scale=float(cfg["guidance_scale"]), fake_guidance_scale=0.0, timestep_shift=shift,
        ts_schedule=cfg.get("ts_schedule", True), ts_schedule_max=cfg.get("ts_schedule_max", False),
        min_score_timestep=cfg.get("min_score_timestep", 0), fake_score=network(fake), real_score=network(real))
    captured = {}

    def recorded_kl_grad(**kwargs):
        grad, log = kl_grad(model, **kwargs)
        captured["grad"] = grad
        return grad, log

    model._compute_kl_grad = recorded_kl_grad
    model._get_timestep = types.MethodType(get_timestep, model)

    def run(dtype: torch.dtype):
        captured.clear()
        for calls in (fake.calls, real.calls, noise_calls):
            calls.clear()
        with default_dtype(dtype):
            model.scheduler = scheduler_cls(shift=shift, sigma_min=0.0, extra_one_step=True)   # as utils/wan_wrapper.py
            model.scheduler.set_timesteps(1000, training=True)
            x0 = t["inputs.x0"].to(dtype).clone().requires_grad_(True)
            torch.manual_seed(SEED)
            loss, log = dm_loss(model, image_or_video=x0, conditional_dict={"prompt": "cond"},
                                unconditional_dict={"prompt": "uncond"})
            loss.backward()
        return loss.detach(), captured["grad"], x0.grad, log["timestep"], model.scheduler.timesteps

    loss, grad, loss_grad, score_t, grid = run(torch.float64)
    assert fake.calls == ["cond"] and real.calls == ["cond", "uncond"] and noise_calls == [SHAPE]
    steps = torch.tensor(cfg["denoising_step_list"])
    tensors.update({"self_forcing.grad": grad, "self_forcing.loss": loss, "self_forcing.loss_grad": loss_grad,
                    "self_forcing.score_timestep": score_t.double(),
                    # model/base.py's warp_denoising_step: cat(scheduler.timesteps, [0])[1000 - step]
                    "self_forcing.denoising_steps": torch.cat((grid, grid.new_zeros(1)))[1000 - steps]})
    native = run(torch.float32)
    cases["self_forcing"] = {
        **co.record(), "guidance_form": "dmd2: cond + w * (cond - uncond)", "guidance_scale": model.real_guidance_scale,
        "fake_guidance_scale": 0.0, "normaliser": "per sample: mean |x0 - x0_real| over dims [1, 2, 3, 4]",
        "timestep_shift": shift, "denoising_step_list": steps.tolist(), "score_timestep_range": [0, num_train],
        "score_timestep_clamp": [model.min_step, model.max_step], "warp_denoising_step": cfg.get("warp_denoising_step"),
        "native_fp32": deviations(native, (loss, grad, loss_grad), ("loss", "grad", "loss_grad"))}


# ------------------------------------------------------------------------------------- FastVideo


def fastvideo(co: Checkout, t: dict, tensors: dict, cases: dict) -> None:
    cfg = yaml.safe_load(co.show(FV_CONFIG))["method"]
    scale = float(cfg["real_score_guidance_scale"])
    get_optional_float = load(co, FV_UTIL, ("get_optional_float",), {"Any": typing.Any})
    captured = {}

    def nan_to_num(x, *args, **kwargs):
        captured["grad"] = torch.nan_to_num(x, *args, **kwargs)
        return captured["grad"]

    ns = {"torch": TorchShim(nan_to_num=nan_to_num), "F": torch.nn.functional, "Any": typing.Any,
          "get_optional_float": get_optional_float}
    dmd_loss = load(co, FV_DMD2, ("DMD2Method", "_dmd_loss"), ns)
    critic, teacher = critic_and_teacher(t)

    def predict_x0(score):
        return lambda noisy, timestep, batch, conditional, cfg_uncond, attn_kind: (
            score("cond" if conditional else "uncond", noisy))

    method = types.SimpleNamespace(
        method_config={"real_score_guidance_scale": cfg["real_score_guidance_scale"]}, _cfg_uncond=None,
        _sample_score_timestep=lambda device: torch.tensor([SCORE_T], device=device),
        student=types.SimpleNamespace(add_noise=lambda x, noise, t: (1 - t / 1000) * x + t / 1000 * noise),
        critic=types.SimpleNamespace(predict_x0=predict_x0(critic)),
        teacher=types.SimpleNamespace(predict_x0=predict_x0(teacher)))

    def run(dtype: torch.dtype):
        for calls in (captured, critic.calls, teacher.calls):
            calls.clear()
        method.cuda_generator = torch.Generator().manual_seed(SEED)
        lift = tensor_float_is_double() if dtype == torch.float64 else contextlib.nullcontext()
        with default_dtype(dtype), lift:
            x0 = t["inputs.x0"].to(dtype).clone().requires_grad_(True)
            loss = dmd_loss(method, x0, batch=None)
            loss.backward()
        return loss.detach(), captured["grad"], x0.grad

    loss, grad, loss_grad = run(torch.float64)
    assert loss.dtype == torch.float64 and critic.calls == ["cond"] and teacher.calls == ["cond", "uncond"]
    tensors.update({"fastvideo.grad": grad, "fastvideo.loss": loss, "fastvideo.loss_grad": loss_grad})
    native = run(torch.float32)
    cases["fastvideo"] = {
        **co.record(), "guidance_form": "ho-salimans: uncond + w * (cond - uncond)", "guidance_scale": scale,
        "normaliser": "batch: mean |x0 - x0_real| over every element", "score_timestep": SCORE_T,
        "fp64_lift": "Tensor.float() returned float64 while _dmd_loss ran (its loss is cast with .float())",
        "native_fp32": deviations(native, (loss, grad, loss_grad), ("loss", "grad", "loss_grad"))}


# -------------------------------------------------------------------------------------- lightx2v


class WanScheduler:
    """Stand-in for lightx2v's ``WanScheduler`` base: only what ``WanStepDistillScheduler`` reads."""

    def __init__(self, config):
        self.config, self.step_index, self.latents, self.noise_pred = config, 0, None, None


def lightx2v(co: Checkout, tensors: dict, cases: dict) -> None:
    cfg = json.loads(co.show(LX_CONFIG))
    steps, shift = cfg["denoising_step_list"], cfg["sample_shift"]
    n = len(steps)
    gen = torch.Generator().manual_seed(SEED + 1)
    latents, velocity, noise = (torch.randn(n, *LATENT, generator=gen, dtype=torch.float64) for _ in range(3))
    pending = []

    def randn_like(x, *args, **kwargs):
        assert x.shape == LATENT and pending, x.shape
        return pending.pop().to(x.dtype)

    source = co.show(LX_SCHED)

    def run(dtype: torch.dtype):
        shim = {"randn_like": randn_like} | ({"float32": torch.float64} if dtype == torch.float64 else {})
        ns = {"torch": TorchShim(**shim), "math": math, "np": np, "WanScheduler": WanScheduler,
              "List": typing.List, "Optional": typing.Optional, "Tuple": typing.Tuple, "Union": typing.Union}
        cls = load(co, LX_SCHED, ("WanStepDistillScheduler",), ns, source)
        outputs, draws = [], []
        with default_dtype(dtype):
            sched = cls(types.SimpleNamespace(denoising_step_list=steps, sample_shift=shift, infer_steps=n))
            sched.set_denoising_timesteps(device="cpu")
            for i in range(n):
                sched.step_index, sched.latents, sched.noise_pred = i, latents[i].to(dtype), velocity[i].to(dtype)
                pending[:] = [noise[i]]
                sched.step_post()
                draws.append(not pending)
                outputs.append(sched.latents)
        return sched.sigmas, sched.timesteps, torch.stack(outputs), draws

    sigmas, timesteps, out, draws = run(torch.float64)
    assert out.dtype == sigmas.dtype == torch.float64 and draws == [True] * (n - 1) + [False], draws
    tensors.update({"lightx2v.sigmas": sigmas, "lightx2v.timesteps": timesteps, "lightx2v.latents": latents,
                    "lightx2v.velocity": velocity, "lightx2v.noise": noise, "lightx2v.step_post": out})
    native = run(torch.float32)
    cases["lightx2v"] = {
        **co.record(), "denoising_step_list": steps, "sample_shift": shift,
        "noise_drawn_at_index": draws, "fp64_lift": "torch.float32 in the scheduler's namespace named float64",
        "native_fp32": deviations(native, (sigmas, timesteps, out), ("sigmas", "timesteps", "step_post"))}


# ---------------------------------------------------------------------------------------- common


def deviations(native: tuple, fp64: tuple, names: tuple) -> dict:
    """How far the native float32 run of a reference lands from its float64 run, per output."""
    return {name: rel(got, want) for name, got, want in zip(names, native, fp64)}


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| in float64."""
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max() / want.abs().max())


TENSORS = {
    "inputs.x0": "the student's sample x0 [B, F, C, H, W] (sample 1 three times sample 0's magnitude)",
    "inputs.x0_fake": "the critic's (fake score's) x0 prediction, returned by the stand-in",
    "inputs.x0_real_cond": "the teacher's conditional x0 prediction",
    "inputs.x0_real_uncond": "the teacher's unconditional x0 prediction",
    "inputs.noise": "Self-Forcing's score noise (its torch.randn_like answered with it)",
    "self_forcing.grad": "DMD._compute_kl_grad's gradient (normalization=True, per sample)",
    "self_forcing.loss": "DMD.compute_distribution_matching_loss's loss (0-d, 0.5 * mse in double)",
    "self_forcing.loss_grad": "d loss / d inputs.x0 by autograd",
    "self_forcing.score_timestep": "the score timesteps it drew ([B, F], 1000-grid, shifted and clamped; "
                                   "torch.manual_seed(SEED) first)",
    "self_forcing.denoising_steps": "its warped denoising_step_list (1000-grid), base.py's indexing of the "
                                    "FlowMatchScheduler grid",
    "fastvideo.grad": "DMD2Method._dmd_loss's gradient (its nan_to_num result; batch normaliser)",
    "fastvideo.loss": "DMD2Method._dmd_loss's loss (0-d)",
    "fastvideo.loss_grad": "d loss / d inputs.x0 by autograd",
    "lightx2v.sigmas": "WanStepDistillScheduler.sigmas after set_denoising_timesteps",
    "lightx2v.timesteps": "WanStepDistillScheduler.timesteps (1000-grid)",
    "lightx2v.latents": "[step index, C, F, H, W]: the latents given to step_post at each index",
    "lightx2v.velocity": "the noise_pred (flow velocity, noise - x0) given at each index",
    "lightx2v.noise": "the noise its torch.randn_like answers at each index (the last index draws none)",
    "lightx2v.step_post": "the latents after step_post at each index",
}


def check(out: Path) -> None:
    """videodit's distill.dmd / distill.schedule on the stored inputs: the largest relative difference."""
    from videodit.distill import dmd, schedule

    t = load_file(str(out / "reference.safetensors"))
    cases = json.loads((out / "cases.json").read_text())
    x0, fake, cond, uncond = (t[f"inputs.{k}"] for k in ("x0", "x0_fake", "x0_real_cond", "x0_real_uncond"))
    for name, normaliser, scale in (("self_forcing", "sample", cases["self_forcing"]["guidance_scale"] + 1),
                                    ("fastvideo", "batch", cases["fastvideo"]["guidance_scale"])):
        g = dmd.dmd_gradient(x0, fake, dmd.guided(cond, uncond, scale), normaliser)
        x = x0.clone().requires_grad_(True)
        loss = dmd.generator_loss(x, g)
        loss.backward()
        for what, got in (("grad", g), ("loss", loss.detach()), ("loss_grad", x.grad)):
            print(f"  {name + '.' + what:28s} relative difference {rel(got, t[f'{name}.{what}']):.3g}")
    sigmas = schedule.warp(cases["lightx2v"]["denoising_step_list"], cases["lightx2v"]["sample_shift"])
    print(f"  {'lightx2v.sigmas':28s} relative difference {rel(sigmas, t['lightx2v.sigmas']):.3g}")
    levels = sigmas.tolist() + [0.0]
    got = torch.stack([schedule.step(t["lightx2v.latents"][i], t["lightx2v.velocity"][i], levels[i], levels[i + 1],
                                     t["lightx2v.noise"][i]) for i in range(len(sigmas))])
    print(f"  {'lightx2v.step_post':28s} relative difference {rel(got, t['lightx2v.step_post']):.3g}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--self-forcing", type=Path, required=True, help="git dir of guandeh17/Self-Forcing")
    ap.add_argument("--fastvideo", type=Path, required=True, help="git dir of hao-ai-lab/FastVideo")
    ap.add_argument("--lightx2v", type=Path, required=True, help="git dir of ModelTC/lightx2v")
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "distill")
    ap.add_argument("--no-check", action="store_true", help="do not compare videodit's implementation after writing")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tensors = inputs()
    cases = {"torch": torch.__version__, "seed": SEED, "shape": list(SHAPE), "latent": list(LATENT),
             "dtype": "float64", "tensors": TENSORS}
    self_forcing(Checkout("Self-Forcing", args.self_forcing), tensors, tensors, cases)
    fastvideo(Checkout("FastVideo", args.fastvideo), tensors, tensors, cases)
    lightx2v(Checkout("lightx2v", args.lightx2v), tensors, cases)
    assert set(tensors) == set(TENSORS) and all(v.dtype == torch.float64 for v in tensors.values())
    args.out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(args.out / "reference.safetensors"))
    (args.out / "cases.json").write_text(json.dumps(cases, indent=1) + "\n")
    print(f"wrote {len(tensors)} tensors to {args.out}")
    if not args.no_check:
        sys.path.insert(0, str(REPO))
        check(args.out)


if __name__ == "__main__":
    main()
