"""Write the golden Wan 2.1 DiT fixtures of tests/fixtures/wan/ with Wan's own code.

    python scripts/make_wan_fixtures.py /path/to/Wan2.1 [--out tests/fixtures/wan]

``WAN_CHECKOUT`` is a checkout of Wan-Video/Wan2.1 (commit 9737cba). Only ``wan/modules/model.py``
is imported: stub ``wan`` / ``wan.modules`` packages skip the ``__init__``s that pull in the T5,
the VAE and the pipelines, and ``wan.modules.attention`` is replaced by a dense stand-in for
``flash_attention`` with the same semantics (keys beyond ``k_lens`` masked, queries beyond
``q_lens`` zero) computed in fp32 instead of bf16, on CPU. Needs torch and diffusers (WanModel is
a diffusers ModelMixin); no flash-attn, easydict or ftfy.

What it writes into ``--out`` (about 2 MB):

- ``wan/``: a tiny WanModel (2 layers, dim 64, 2 heads of 32 channels: RoPE split 12/10/10,
  ffn 128, freq_dim 256, text_dim 32, text_len 512, 16 channels in and out) as
  ``WanModel.save_pretrained`` writes it, every weight overwritten with seeded random values (Wan
  zero-initialises its head, which would hide a wrong unpatchify).
- ``diffusers/``: the same weights through diffusers' own converter
  (``convert_wan_transformer_to_diffusers``), loaded strictly into ``WanTransformer3DModel`` and
  written by its ``save_pretrained``.
- ``cases.safetensors`` (``{case}.{name}``) + ``cases.json``: inputs (latents ``x``, ``t`` in
  [0, 1], zero-padded text embeddings ``context`` with ``context_lens``) and Wan's fp32 output
  ``out`` for every case in ``CASES``; ``grad.*``: the inputs of a flow-matching MSE loss and
  ``grad.param.<name>``, its gradient w.r.t. every parameter.

Deterministic for the same checkout and library versions. Afterwards it prints videodit's and
diffusers' max deviations from Wan (``--no-check`` skips this; it needs videodit importable).
tests/models/test_wan_model.py reads the fixtures; it never needs Wan's code.
"""

from __future__ import annotations

import argparse
import warnings
import importlib.util
import json
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
SEED = 2025
TINY = dict(model_type="t2v", patch_size=(1, 2, 2), text_len=512, in_dim=16, dim=64, ffn_dim=128, freq_dim=256,
            text_dim=32, out_dim=16, num_heads=2, num_layers=2, window_size=(-1, -1), qk_norm=True,
            cross_attn_norm=True, eps=1e-6)
# name: (latent shape [B, C, F, H, W], caption lengths, extra tokens of Wan's seq_len padding, t per sample)
CASES = {
    "t2v": ((1, 16, 3, 8, 8), [7], 0, [0.75]),
    "padded": ((1, 16, 3, 8, 8), [12], 13, [0.3]),
    "nonsquare": ((1, 16, 2, 6, 10), [9], 0, [0.5]),
    "one_frame": ((1, 16, 1, 8, 8), [5], 0, [0.9]),
    "batch2": ((2, 16, 2, 8, 8), [5, 11], 0, [0.2, 0.95]),
}
GRAD_CASE = ((2, 16, 2, 4, 6), [6, 10], [0.4, 0.8])


# ------------------------------------------------------------------------------- Wan's code

def flash_attention(q, k, v, q_lens=None, k_lens=None, dropout_p=0.0, softmax_scale=None, q_scale=None,
                    causal=False, window_size=(-1, -1), deterministic=False, dtype=torch.bfloat16, version=None):
    """Dense stand-in for Wan's ``flash_attention`` on [B, L, heads, C] (varlen semantics, fp32)."""
    assert dropout_p == 0.0 and not causal and tuple(window_size) == (-1, -1)
    out_dtype, lq, lk = q.dtype, q.shape[1], k.shape[1]
    if q_scale is not None:
        q = q * q_scale
    mask = None
    if k_lens is not None:
        mask = (torch.arange(lk, device=k.device)[None] < k_lens.to(k.device)[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(q.transpose(1, 2).float(), k.transpose(1, 2).float(),
                                         v.transpose(1, 2).float(), attn_mask=mask, scale=softmax_scale)
    out = out.transpose(1, 2)
    if q_lens is not None:   # flash's varlen output holds no rows beyond a sequence's length
        out = out * (torch.arange(lq, device=q.device)[None] < q_lens.to(q.device)[:, None])[..., None, None]
    return out.type(out_dtype)


def import_wan(checkout: Path):
    """Wan's ``wan.modules.model`` without the package ``__init__``s."""
    modules = checkout / "wan" / "modules"
    for name, path in (("wan", checkout / "wan"), ("wan.modules", modules)):
        package = types.ModuleType(name)
        package.__path__ = [str(path)]
        sys.modules[name] = package
    attention = types.ModuleType("wan.modules.attention")
    attention.flash_attention = flash_attention
    sys.modules["wan.modules.attention"] = attention
    spec = importlib.util.spec_from_file_location("wan.modules.model", modules / "model.py")
    model = importlib.util.module_from_spec(spec)
    sys.modules["wan.modules.model"] = model
    spec.loader.exec_module(model)
    return model


def randomize(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Seeded values for every weight: matrices ~ N(0, 1/fan_in), biases and modulation tables
    ~ N(0, 0.2), norm scales ~ 1 + N(0, 0.2); nothing stays zero or one."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if p.dim() >= 2 and "modulation" not in name:
                p.copy_(noise / p[0].numel() ** 0.5)
            elif name.endswith("weight") and "norm" in name:
                p.copy_(1 + 0.2 * noise)
            else:
                p.copy_(0.2 * noise)


def run_wan(model, x, t, context, context_lens, pad_tokens=0):
    """Wan's forward on a batch: lists of samples and unpadded captions, as its pipeline calls it."""
    pt, ph, pw = TINY["patch_size"]
    tokens = x.shape[2] // pt * (x.shape[3] // ph) * (x.shape[4] // pw)
    out = model(list(x), t=t * 1000, context=[c[:n] for c, n in zip(context, context_lens.tolist())],
                seq_len=tokens + pad_tokens)
    return torch.stack(out)


def inputs(generator, shape, lengths, times):
    x = torch.randn(shape, generator=generator)
    context = torch.zeros(shape[0], max(lengths), TINY["text_dim"])
    for i, n in enumerate(lengths):
        context[i, :n] = torch.randn(n, TINY["text_dim"], generator=generator)
    return {"x": x, "t": torch.tensor(times, dtype=torch.float32), "context": context,
            "context_lens": torch.tensor(lengths, dtype=torch.int64)}


def write(wan_module, out: Path) -> dict:
    from diffusers import WanTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    torch.manual_seed(SEED)
    generator = torch.Generator().manual_seed(SEED)
    model = wan_module.WanModel(**TINY).eval()
    randomize(model, generator)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out / "wan")

    converted = convert_wan_transformer_to_diffusers({k: v.clone() for k, v in model.state_dict().items()})
    reference = WanTransformer3DModel(
        patch_size=TINY["patch_size"], num_attention_heads=TINY["num_heads"],
        attention_head_dim=TINY["dim"] // TINY["num_heads"], in_channels=TINY["in_dim"],
        out_channels=TINY["out_dim"], text_dim=TINY["text_dim"], freq_dim=TINY["freq_dim"], ffn_dim=TINY["ffn_dim"],
        num_layers=TINY["num_layers"], cross_attn_norm=TINY["cross_attn_norm"], eps=TINY["eps"])
    reference.load_state_dict(converted, strict=True)
    reference.save_pretrained(out / "diffusers")

    tensors, meta = {}, {"tiny": {k: list(v) if isinstance(v, tuple) else v for k, v in TINY.items()}, "cases": {}}
    for name, (shape, lengths, pad, times) in CASES.items():
        case = inputs(generator, shape, lengths, times)
        with torch.no_grad():
            case["out"] = run_wan(model, case["x"], case["t"], case["context"], case["context_lens"], pad)
        tensors.update({f"{name}.{k}": v.contiguous() for k, v in case.items()})
        meta["cases"][name] = {"shape": list(shape), "caption_lengths": lengths, "seq_len_padding": pad}

    shape, lengths, times = GRAD_CASE
    case = inputs(generator, shape, lengths, times)
    case["noise"] = torch.randn(shape, generator=generator)
    s = case["t"].view(-1, 1, 1, 1, 1)
    x_t = (1 - s) * case["x"] + s * case["noise"]   # x is the data x0; the target velocity is noise - x0
    loss = F.mse_loss(run_wan(model, x_t, case["t"], case["context"], case["context_lens"]),
                      case["noise"] - case["x"])
    loss.backward()
    case["loss"] = loss.detach().reshape(1)
    case.update({f"param.{n}": p.grad.detach().clone() for n, p in model.named_parameters()})
    tensors.update({f"grad.{k}": v.contiguous() for k, v in case.items()})
    meta["grad"] = {"shape": list(shape), "caption_lengths": lengths,
                    "loss": "mse(model((1-t) x + t noise, t, context), noise - x)"}

    save_file(tensors, str(out / "cases.safetensors"), metadata={"format": "pt"})
    (out / "cases.json").write_text(json.dumps(meta, indent=1) + "\n")
    return tensors


def check(wan_module, out: Path, tensors: dict) -> None:
    """videodit's and diffusers' deviations from Wan, and videodit's Wan export loaded by Wan."""
    import tempfile

    from diffusers import WanTransformer3DModel
    from safetensors.torch import load_file

    sys.path.insert(0, str(REPO))
    from videodit.models.wan.layouts import load_wan, write_wan_folder

    ours = load_wan(out / "wan").eval()
    theirs = WanTransformer3DModel.from_pretrained(out / "diffusers").eval()
    for name in CASES:
        x, t, context, expected = (tensors[f"{name}.{k}"] for k in ("x", "t", "context", "out"))
        padded = F.pad(context, (0, 0, 0, TINY["text_len"] - context.shape[1]))
        with torch.no_grad():
            mine = ours(x, t, context)
            dif = theirs(x, t * 1000, padded).sample
        scale = expected.abs().max()
        print(f"{name:10s} |out|max {scale:.3f}  videodit: max abs {(mine - expected).abs().max():.2e} "
              f"rel {(mine - expected).abs().max() / scale:.2e}  diffusers: max abs {(dif - expected).abs().max():.2e} "
              f"rel {(dif - expected).abs().max() / scale:.2e}  videodit-vs-diffusers rel "
              f"{(mine - dif).abs().max() / scale:.2e}")

    x, t, context, noise = (tensors[f"grad.{k}"] for k in ("x", "t", "context", "noise"))
    s = t.view(-1, 1, 1, 1, 1)
    F.mse_loss(ours((1 - s) * x + s * noise, t, context), noise - x).backward()
    worst = max(((p.grad - tensors[f"grad.param.{n}"]).abs().max() / tensors[f"grad.param.{n}"].abs().max()).item()
                for n, p in ours.named_parameters())
    print(f"gradients: worst relative deviation over {len(list(ours.parameters()))} parameters {worst:.2e}")

    with tempfile.TemporaryDirectory() as tmp:
        write_wan_folder(ours.state_dict(), ours.geometry, tmp, layout="wan")
        ours_config = json.loads((Path(tmp) / "config.json").read_text())
        wan_config = json.loads((out / "wan" / "config.json").read_text())
        differ = sorted(k for k in ours_config.keys() | wan_config.keys() if ours_config.get(k) != wan_config.get(k))
        print(f"videodit's config.json differs from WanModel.save_pretrained's in: {differ}")
        # WanModel.from_pretrained cannot rebuild a text_dim other than 4096 (Wan does not save it),
        # so the export's weights go strictly into WanModel(**TINY).
        again = wan_module.WanModel(**TINY).eval()
        again.load_state_dict(load_file(str(Path(tmp) / "diffusion_pytorch_model.safetensors")), strict=True)
        x, t, context, lens, expected = (tensors[f"t2v.{k}"] for k in ("x", "t", "context", "context_lens", "out"))
        with torch.no_grad():
            deviation = (run_wan(again, x, t, context, lens) - expected).abs().max()
        print(f"Wan on videodit's export: max abs {deviation:.2e}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wan_checkout", type=Path)
    parser.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "wan")
    parser.add_argument("--no-check", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    # Wan's torch.cuda.amp decorators warn on every call on a CPU-only machine.
    warnings.filterwarnings("ignore", message=".*autocast.*")
    wan_module = import_wan(args.wan_checkout.resolve())
    tensors = write(wan_module, args.out)
    if not args.no_check:
        check(wan_module, args.out, tensors)


if __name__ == "__main__":
    main()
