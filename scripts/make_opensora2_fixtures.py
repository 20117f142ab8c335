"""Write the golden Open-Sora 2.0 MMDiT fixtures of tests/fixtures/opensora2/ with Open-Sora's own code.

    python scripts/make_opensora2_fixtures.py --checkout /work/refs/opensora2 [--out tests/fixtures/opensora2]

The checkout is hpcaitech/Open-Sora main (commit 7ad6a96); ``scripts/opensora2_reference.py``
imports its ``opensora/models/mmdit`` on CPU (flash_attn as SDPA, Liger's rotate-half RoPE and
llama RMSNorm as plain torch). What it writes into ``--out`` (about 2.6 MB):

- ``mmdit/Open_Sora_v2.safetensors``: a tiny ``MMDiTModel`` (2 double + 2 single blocks, hidden
  64, 2 heads of 32 channels, RoPE axes (4, 14, 14), mlp_ratio 2, 4 latent channels x 2x2 patch,
  vec_in 16, context 32, qkv_bias, cond_embed, ``fused_qkv=False``, ``use_liger_rope=True``: the
  released configuration at a tiny size) as its ``state_dict()``: the released key names and the
  liger RoPE layout. Every weight seeded random (``cond_in`` is zero-initialised by Open-Sora,
  which would hide a wrong cond packing).
- ``mmdit_flux/Open_Sora_v2.safetensors``: another tiny model (1 double + 1 single block) built
  with ``use_liger_rope=False`` (Flux's interleaved RoPE layout, to prove its import) and patch 1
  on 8 latent channels (the shape of the high-compression model, ``opensora-v2-hc``).
- ``mmdit_cases.safetensors`` (``{case}.{name}``) + ``mmdit_cases.json``: for every case, the
  model inputs (latents ``x`` [B, C, T, H, W], ``t``, caption ``y``, its ``y_mask`` where the case
  has one, ``pooled``, ``cond`` [B, 1 + C, T, H, W] or none) and Open-Sora's fp32 output ``out``
  unpacked to [B, C, T, H, W]. ``grad.*`` adds the target of an MSE loss, ``loss``, the input
  gradients ``dx``, ``dy``, ``dpooled``, ``dcond`` and ``param.<name>`` for a few parameters;
  ``flux.*`` is a case of the Flux-layout model.

"Padded" captions: Open-Sora runs T5 without an attention mask and the MMDiT attends every one
of the 512 tokens, pads included (``padded_nomask``: the caption's trailing pad embeddings are
inputs like any other, no mask). With a mask (``padded_mask``: two captions of 5 and 3 real
tokens padded to 8), videodit masks the pad keys; the reference has no mask, so the expected
output is Open-Sora's on each caption cut to its real tokens, sample by sample: pad keys masked
everywhere means the image never sees them.

Deterministic for the same checkout and library versions. Afterwards it prints videodit's
largest deviations (``--no-check`` skips that; it needs videodit importable).
tests/models/test_mmdit.py reads the fixtures; it never needs Open-Sora's code.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from opensora2_reference import import_opensora2  # noqa: E402

SEED = 2026
PATCH = 2
TINY = dict(in_channels=4 * PATCH ** 2, vec_in_dim=16, context_in_dim=32, hidden_size=64, mlp_ratio=2.0, num_heads=2,
            depth=2, depth_single_blocks=2, axes_dim=[4, 14, 14], theta=10000, qkv_bias=True, guidance_embed=False,
            cond_embed=True, fused_qkv=False, use_liger_rope=True, patch_size=PATCH)
# Flux's RoPE layout, and the high-compression model's patch 1 (8 latent channels here).
FLUX = {**TINY, "depth": 1, "depth_single_blocks": 1, "use_liger_rope": False, "in_channels": 8, "patch_size": 1}
# name: (latent shape [B, C, T, H, W], caption tokens, t per sample, cond kind)
CASES = {
    "t2v": ((2, 4, 3, 8, 8), 6, [0.75, 0.2], "zeros"),
    "i2v": ((2, 4, 3, 8, 8), 6, [0.5, 0.9], "head"),
    "one_frame": ((1, 4, 1, 8, 8), 5, [0.6], "zeros"),
    "nonsquare": ((1, 4, 2, 6, 12), 7, [0.3], "head"),
    "padded_nomask": ((2, 4, 2, 8, 8), 8, [0.4, 0.8], "zeros"),
    "padded_mask": ((2, 4, 2, 8, 8), 8, [0.4, 0.8], "zeros"),
    "random_cond": ((2, 4, 2, 4, 6), 4, [0.35, 0.65], "random"),
}
MASK_LENGTHS = [5, 3]   # padded_mask: real tokens per caption
GRAD_CASE = ((2, 4, 2, 4, 6), 5, [0.4, 0.8])
GRAD_PARAMS = ("img_in.weight", "cond_in.weight", "txt_in.bias", "time_in.in_layer.weight",
               "double_blocks.0.img_attn.q_proj.weight", "double_blocks.1.txt_attn.norm.key_norm.scale",
               "double_blocks.0.txt_mlp.2.weight", "single_blocks.0.v_mlp.weight",
               "single_blocks.1.norm.query_norm.scale", "single_blocks.1.linear2.bias",
               "final_layer.adaLN_modulation.1.weight", "final_layer.linear.weight")


def build(module, options: dict, seed: int):
    config = module.MMDiTConfig(from_pretrained=None, cache_dir=None, **options)
    model = module.MMDiTModel(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 1.0 if name.endswith("norm.scale") else 0.15
            offset = 1.0 if name.endswith("norm.scale") else 0.0   # norm scales near 1, not near 0
            p.copy_(offset + scale * torch.randn(p.shape, generator=generator))
    return model.eval()


def pack(x: torch.Tensor, p: int = PATCH) -> torch.Tensor:
    """Open-Sora's pack: b c t (h ph) (w pw) -> b (t h w) (c ph pw)."""
    b, c, t, h, w = x.shape
    x = x.reshape(b, c, t, h // p, p, w // p, p).permute(0, 2, 3, 5, 1, 4, 6)
    return x.reshape(b, t * (h // p) * (w // p), c * p * p)


def unpack(tokens: torch.Tensor, shape, p: int = PATCH) -> torch.Tensor:
    b, c, t, h, w = shape
    x = tokens.reshape(b, t, h // p, w // p, c, p, p).permute(0, 4, 1, 2, 5, 3, 6)
    return x.reshape(shape)


def image_ids(batch: int, t: int, h: int, w: int, p: int = PATCH) -> torch.Tensor:
    """Open-Sora's ``prepare``: (frame, row, column) of every token."""
    ids = torch.zeros(t, h // p, w // p, 3)
    ids[..., 0] += torch.arange(t)[:, None, None]
    ids[..., 1] += torch.arange(h // p)[None, :, None]
    ids[..., 2] += torch.arange(w // p)[None, None, :]
    return ids.reshape(1, -1, 3).expand(batch, -1, -1).clone()


def run(model, x, t, y, pooled, cond) -> torch.Tensor:
    """Open-Sora's forward on unpacked latents; text positions 0 as in ``prepare``."""
    b, _, frames, h, w = x.shape
    p = model.patch_size
    out = model(img=pack(x, p), img_ids=image_ids(b, frames, h, w, p), txt=y, txt_ids=torch.zeros(b, y.shape[1], 3),
                timesteps=t, y_vec=pooled, cond=pack(cond, p))
    return unpack(out, x.shape, p)


def make_cond(kind: str, x0: torch.Tensor, generator) -> torch.Tensor:
    """[B, 1 + C, T, H, W]: the given frames' mask then the masked latents (Open-Sora's
    ``prepare_visual_condition``): t2v none given (all zero), i2v_head frame 0, or random values."""
    b, c, frames, h, w = x0.shape
    if kind == "random":
        return torch.randn(b, c + 1, frames, h, w, generator=generator)
    mask = torch.zeros(b, 1, frames, h, w)
    if kind == "head":
        mask[:, :, 0] = 1
    return torch.cat([mask, x0 * mask], dim=1)


def inputs(shape, tokens: int, times, cond_kind: str, generator) -> dict[str, torch.Tensor]:
    x0 = torch.randn(shape, generator=generator)
    case = {"x": torch.randn(shape, generator=generator), "t": torch.tensor(times, dtype=torch.float32),
            "y": torch.randn(shape[0], tokens, TINY["context_in_dim"], generator=generator),
            "pooled": torch.randn(shape[0], TINY["vec_in_dim"], generator=generator)}
    case["cond"] = make_cond(cond_kind, x0, generator)
    return case


def write_cases(model, generator) -> tuple[dict, dict]:
    tensors, meta = {}, {}
    with torch.no_grad():
        for name, (shape, tokens, times, cond_kind) in CASES.items():
            case = inputs(shape, tokens, times, cond_kind, generator)
            if name == "padded_mask":
                mask = torch.zeros(shape[0], tokens, dtype=torch.bool)
                for i, length in enumerate(MASK_LENGTHS):
                    mask[i, :length] = True
                case["y_mask"] = mask
                case["out"] = torch.cat([run(model, case["x"][i:i + 1], case["t"][i:i + 1],
                                             case["y"][i:i + 1, :length], case["pooled"][i:i + 1],
                                             case["cond"][i:i + 1]) for i, length in enumerate(MASK_LENGTHS)])
            else:
                case["out"] = run(model, case["x"], case["t"], case["y"], case["pooled"], case["cond"])
            meta[name] = {"shape": list(shape), "caption_tokens": tokens, "t": times, "cond": cond_kind,
                          "mask_lengths": MASK_LENGTHS if name == "padded_mask" else None}
            tensors.update({f"{name}.{k}": v.contiguous() for k, v in case.items()})
    shape, tokens, times = GRAD_CASE
    case = inputs(shape, tokens, times, "random", generator)
    case["target"] = torch.randn(shape, generator=generator)
    leaves = {k: case[k].clone().requires_grad_() for k in ("x", "y", "pooled", "cond")}
    model.zero_grad()
    loss = F.mse_loss(run(model, leaves["x"], case["t"], leaves["y"], leaves["pooled"], leaves["cond"]),
                      case["target"])
    loss.backward()
    case["loss"] = loss.detach()
    case.update({f"d{k}": v.grad for k, v in leaves.items()})
    params = dict(model.named_parameters())
    case.update({f"param.{n}": params[n].grad for n in GRAD_PARAMS})
    tensors.update({f"grad.{k}": v.detach().contiguous() for k, v in case.items()})
    meta["grad"] = {"shape": list(shape), "caption_tokens": tokens, "t": times, "params": list(GRAD_PARAMS)}
    return tensors, meta


def save_weights(model, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "Open_Sora_v2.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", required=True, help="an Open-Sora (hpcaitech/Open-Sora main) checkout")
    parser.add_argument("--out", default=str(REPO / "tests" / "fixtures" / "opensora2"))
    parser.add_argument("--no-check", action="store_true", help="do not compare videodit's model afterwards")
    args = parser.parse_args()
    out = Path(args.out)
    (module,) = import_opensora2(args.checkout, "models.mmdit.model")
    torch.manual_seed(SEED)
    model = build(module, TINY, SEED)
    flux = build(module, FLUX, SEED + 1)
    generator = torch.Generator().manual_seed(SEED + 2)
    tensors, meta = write_cases(model, generator)
    flux_case = inputs((2, 8, 2, 4, 6), 5, [0.3, 0.7], "head", generator)
    with torch.no_grad():
        flux_case["out"] = run(flux, flux_case["x"], flux_case["t"], flux_case["y"], flux_case["pooled"],
                               flux_case["cond"])
    tensors.update({f"flux.{k}": v.contiguous() for k, v in flux_case.items()})
    meta["flux"] = {"shape": [2, 8, 2, 4, 6], "caption_tokens": 5, "t": [0.3, 0.7], "cond": "head"}
    save_weights(model, out / "mmdit")
    save_weights(flux, out / "mmdit_flux")
    save_file(tensors, str(out / "mmdit_cases.safetensors"))
    (out / "mmdit_cases.json").write_text(json.dumps({"tiny": TINY, "flux": FLUX, "cases": meta}, indent=1) + "\n")
    print(f"wrote {out}")
    if not args.no_check:
        check(out)


def check(out: Path) -> None:
    """videodit's deviations from the fixtures (relative to each output's largest value)."""
    from safetensors.torch import load_file

    from videodit.models.mmdit.layouts import load_opensora2
    model = load_opensora2(out / "mmdit" / "Open_Sora_v2.safetensors").eval()
    cases = load_file(str(out / "mmdit_cases.safetensors"))
    for name in CASES:
        c = {k.split(".", 1)[1]: v for k, v in cases.items() if k.startswith(name + ".")}
        with torch.no_grad():
            ours = model(c["x"], c["t"], c["y"], c["pooled"], c["cond"], c.get("y_mask"))
        print(f"{name:14s} {((ours - c['out']).abs().max() / c['out'].abs().max()).item():.2e}")


if __name__ == "__main__":
    main()
