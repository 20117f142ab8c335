"""Import Open-Sora 2.0's own code (a checkout of hpcaitech/Open-Sora main) on a CPU machine,
for the fixture scripts ``scripts/make_opensora2_*.py``. Never imported by videodit or its tests.

Open-Sora 2.0 imports CUDA-only and training-only packages at module level. This module puts
stand-ins into ``sys.modules`` before the first import:

* ``flash_attn``: ``flash_attn_func`` as SDPA on its [B, L, H, D] layout (FA3's
  ``flash_attn_interface`` stays absent, so ``SUPPORT_FA3`` is False);
* ``liger_kernel``: ``LigerRopeFunction`` (rotate-half RoPE; cos/sin indexed by position only,
  the first half of the last dim used, as Liger v0.5.2's Triton kernel reads them) and
  ``LigerRMSNormFunction`` (llama casting: normalise in fp32, cast back, then multiply);
* shells for the import-only packages (colossalai, tensornvme, mmengine's registry); any
  attribute of a shell is a harmless placeholder class;
* ``opensora.models`` as a namespace package, so its ``__init__`` (which imports every VAE and
  text encoder) is skipped; ``import_opensora2`` then imports the submodules asked for.

``torch.compile`` on ``timestep_embedding`` is disabled (``TORCHDYNAMO_DISABLE=1``, set
before torch is imported where possible, and dynamo's config otherwise).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

torch._dynamo.config.disable = True


# ---------------------------------------------------------------------------- real stand-ins

def _flash_attn_func(q, k, v, *args, **kwargs):
    """flash_attn's layout: [B, L, H, D] in and out."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


def _rotate_half(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class LigerRopeFunction(torch.autograd.Function):
    """q, k [B, H, L, D]; cos, sin [b, L, D] of which the kernel reads row 0's first D/2."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        half = q.shape[-1] // 2
        cos, sin = cos[0, :, :half], sin[0, :, :half]          # position only, batch ignored
        ctx.save_for_backward(cos, sin)
        return _rotate_half(q, cos, sin), _rotate_half(k, cos, sin)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        return _rotate_half(dq, cos, -sin), _rotate_half(dk, cos, -sin), None, None, None, None


class LigerRMSNormFunction(torch.autograd.Function):
    """Liger's "llama" casting mode with offset 0, differentiable through autograd."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset=0.0, casting_mode="llama", in_place=False):
        with torch.enable_grad():
            x_ = x.detach().requires_grad_(x.requires_grad)
            w_ = weight.detach().requires_grad_(weight.requires_grad)
            y = _rms_llama(x_, w_, eps, offset)
        ctx.save_for_backward(x_, w_, y)
        return y.detach()

    @staticmethod
    def backward(ctx, dy):
        x_, w_, y = ctx.saved_tensors
        inputs = [t for t in (x_, w_) if t.requires_grad]
        grads = iter(torch.autograd.grad(y, inputs, dy)) if inputs else iter(())
        return (next(grads) if x_.requires_grad else None, next(grads) if w_.requires_grad else None,
                None, None, None, None)


def _rms_llama(x, weight, eps, offset):
    dtype = x.dtype
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return normed * (offset + weight)


# ---------------------------------------------------------------------------- shells

class _Placeholder:
    """Any name looked up in a shell: callable, subclassable, decorates as identity."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return args[0] if len(args) == 1 and callable(args[0]) else self

    def __getattr__(self, name):
        return _Placeholder()


class _Registry(_Placeholder):
    """mmengine's Registry: ``register_module()`` returns an identity decorator."""

    def register_module(self, *args, **kwargs):
        return (lambda cls: cls) if not args or not callable(args[0]) else args[0]

    def build(self, cfg):
        raise RuntimeError("the Open-Sora registry is a shell here: build models directly")


class _Shell(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "Registry":
            return _Registry
        if name == "get_current_device":
            return lambda: torch.device("cpu")
        return type(name, (_Placeholder,), {})


class _ShellFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers every import under the shelled top-level names with an empty shell module."""

    def __init__(self, roots: set[str]):
        self.roots = roots

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Shell(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


SHELLED = {"colossalai", "tensornvme", "mmengine", "wandb"}


def _module(name: str) -> types.ModuleType:
    """A stand-in module with a spec: libraries that probe ``importlib.util.find_spec`` (transformers
    does, for flash_attn) need one."""
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    return module


def install_stubs() -> None:
    """Put the stand-ins into ``sys.modules`` (idempotent)."""
    if "flash_attn" in sys.modules and getattr(sys.modules["flash_attn"], "_videodit_stub", False):
        return
    flash = _module("flash_attn")
    flash._videodit_stub = True
    flash.flash_attn_func = _flash_attn_func
    interface = _module("flash_attn.flash_attn_interface")
    for name in ("_flash_attn_forward", "_flash_attn_backward", "flash_attn_func"):
        setattr(interface, name, _flash_attn_func)
    flash.flash_attn_interface = interface
    sys.modules["flash_attn"], sys.modules["flash_attn.flash_attn_interface"] = flash, interface

    liger, ops = _module("liger_kernel"), _module("liger_kernel.ops")
    rope, rms = _module("liger_kernel.ops.rope"), _module("liger_kernel.ops.rms_norm")
    rope.LigerRopeFunction, rms.LigerRMSNormFunction = LigerRopeFunction, LigerRMSNormFunction
    liger.ops, ops.rope, ops.rms_norm = ops, rope, rms
    sys.modules.update({"liger_kernel": liger, "liger_kernel.ops": ops, "liger_kernel.ops.rope": rope,
                        "liger_kernel.ops.rms_norm": rms})
    sys.meta_path.insert(0, _ShellFinder(SHELLED))


def import_opensora2(checkout: str | Path, *modules: str) -> list[types.ModuleType]:
    """Import ``opensora.<module>`` for each name (e.g. ``"models.mmdit.model"``) from the
    checkout, skipping ``opensora/models/__init__.py``."""
    checkout = Path(checkout).resolve()
    if not (checkout / "opensora" / "models" / "mmdit").is_dir():
        raise SystemExit(f"{checkout} is not an Open-Sora 2.0 checkout (no opensora/models/mmdit)")
    install_stubs()
    if str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    if "opensora.models" not in sys.modules:
        import opensora  # noqa: F401  (its __init__ is light)
        namespace = types.ModuleType("opensora.models")
        namespace.__path__ = [str(checkout / "opensora" / "models")]
        sys.modules["opensora.models"] = namespace
    return [importlib.import_module(f"opensora.{name}") for name in modules]


if __name__ == "__main__":   # smoke check: python scripts/opensora2_reference.py CHECKOUT
    (mmdit,) = import_opensora2(sys.argv[1], "models.mmdit.model")
    print("imported", mmdit.MMDiTModel.__name__)
