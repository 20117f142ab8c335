"""Write the golden fixtures of Wan's image-conditioned DiTs (tests/fixtures/wan_variants/) with Wan's code.

    python scripts/make_wan_variant_fixtures.py /path/to/Wan2.1 /path/to/Wan2.2 [--out DIR]

Checkouts: Wan-Video/Wan2.1 at 9737cba and Wan-Video/Wan2.2 at 42bf4cf. As in
``make_wan_fixtures.py`` (whose helpers this reuses), only ``wan/modules/model.py`` of each is
imported, with flash-attention replaced by a dense fp32 stand-in of the same semantics.

Variants (each a tiny model: 2 layers, dim 64, 2 heads, text_dim 32, text_len 512, seeded random
weights), each written as Wan's folder (``WanModel.save_pretrained``) under ``{variant}/wan`` and,
through diffusers' own converter, as ``WanTransformer3DModel`` under ``{variant}/diffusers``:

- ``i2v21``: Wan 2.1 I2V (``model_type="i2v"``, in_dim 36 = latent 16 + mask 4 + given frames 16),
  with ``img_emb`` over 257 CLIP tokens. Wan hard-codes CLIP's width 1280 in ``MLPProj``; the tiny
  model's ``img_emb`` is Wan's own ``MLPProj`` built with width 32 instead, to keep the fixture
  small (the width is a config value in diffusers: ``image_dim``).
- ``i2v22``: a Wan 2.2 I2V-A14B expert (Wan 2.2's code, ``model_type="i2v"``, in_dim 36, no CLIP).
- ``ti2v``: Wan 2.2 TI2V-5B (Wan 2.2's code, ``model_type="ti2v"``, 48 channels in and out), with
  a time per sample (text to video) and per token (image to video: latent frame 0 is the image's
  and its tokens have time 0, as ``wan/textimage2video.py`` builds ``temp_ts``).

``cases.safetensors`` holds, per ``{variant}.{case}``: the inputs (``x`` with its conditioning
channels already concatenated for i2v, ``t`` in [0, 1] per sample or per token, zero-padded
``context`` + ``context_lens``, ``image`` CLIP features for i2v21) and Wan's fp32 ``out``.
``cases.json`` says which case is which. Tests read only these files, never Wan's code.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_wan_fixtures import import_wan, randomize  # noqa: E402  (the 2.1 fixtures' helpers)

REPO = Path(__file__).resolve().parents[1]
SEED = 2026
BASE = dict(patch_size=(1, 2, 2), text_len=512, dim=64, ffn_dim=128, freq_dim=256, text_dim=32, num_heads=2,
            num_layers=2, window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6)
TINY_IMAGE_DIM = 32
CLIP_TOKENS = 257
VARIANTS = {
    "i2v21": dict(BASE, model_type="i2v", in_dim=36, out_dim=16),
    "i2v22": dict(BASE, model_type="i2v", in_dim=36, out_dim=16),
    "ti2v": dict(BASE, model_type="ti2v", in_dim=48, out_dim=48),
}
# case: (latent shape [B, C_out, F, H, W], caption lengths, t per sample, per-token image mode)
CASES = {
    "i2v21": {"one": ((1, 16, 3, 8, 8), [7], [0.75], False), "batch2": ((2, 16, 2, 6, 10), [5, 11], [0.2, 0.9], False)},
    "i2v22": {"one": ((1, 16, 3, 8, 8), [7], [0.6], False), "batch2": ((2, 16, 2, 6, 10), [5, 11], [0.3, 0.95], False)},
    "ti2v": {"t2v": ((1, 48, 3, 8, 8), [7], [0.75], False), "i2v": ((1, 48, 3, 8, 8), [9], [0.5], True),
             "i2v_batch2": ((2, 48, 2, 6, 10), [5, 11], [0.3, 0.8], True)},
}


def build(module, config: dict, generator: torch.Generator, variant: str):
    model = module.WanModel(**config).eval()
    if variant == "i2v21":   # Wan's MLPProj at a tiny CLIP width (Wan's own class, its width argument)
        model.img_emb = module.MLPProj(TINY_IMAGE_DIM, config["dim"])
    randomize(model, generator)
    return model


def case_inputs(generator, config: dict, shape, lengths, times, per_token: bool, variant: str) -> dict:
    b, c, f, h, w = shape
    case = {"x": torch.randn(shape, generator=generator)}
    if config["model_type"] == "i2v":   # mask (frame 0 given) and the given frame's latents, after x
        mask = torch.zeros(b, 4, f, h, w)
        mask[:, :, 0] = 1
        given = torch.zeros(b, c, f, h, w)
        given[:, :, 0] = torch.randn(b, c, h, w, generator=generator)
        case["x"] = torch.cat([case["x"], mask, given], dim=1)
    context = torch.zeros(b, max(lengths), config["text_dim"])
    for i, n in enumerate(lengths):
        context[i, :n] = torch.randn(n, config["text_dim"], generator=generator)
    case.update(context=context, context_lens=torch.tensor(lengths, dtype=torch.int64))
    t = torch.tensor(times, dtype=torch.float32)
    if per_token:   # time 0 on latent frame 0's tokens (the image), t elsewhere
        tokens_per_frame = (h // 2) * (w // 2)
        t = t[:, None].expand(b, f * tokens_per_frame).clone()
        t[:, :tokens_per_frame] = 0
    case["t"] = t
    if variant == "i2v21":
        case["image"] = torch.randn(b, CLIP_TOKENS, TINY_IMAGE_DIM, generator=generator)
    return case


def run_wan(model, case: dict, variant: str) -> torch.Tensor:
    """Wan's forward as its pipelines call it: lists of samples, unpadded captions, t * 1000."""
    x, lens = case["x"], case["context_lens"].tolist()
    tokens = x.shape[2] * (x.shape[3] // 2) * (x.shape[4] // 2)
    kwargs = {}
    if variant.startswith("i2v"):   # Wan concatenates y after x itself
        kwargs["y"] = [u[16:] for u in x]
        x = x[:, :16]
    if variant == "i2v21":
        kwargs["clip_fea"] = case["image"]
    t = case["t"]
    if variant != "i2v21" and t.dim() == 1:   # Wan 2.2 expands a [1] t itself, not a [B] one
        t = t[:, None].expand(-1, tokens)
    out = model(list(x), t=t * 1000, context=[c[:n] for c, n in zip(case["context"], lens)],
                seq_len=tokens, **kwargs)
    return torch.stack(out)


def diffusers_twin(model, config: dict, variant: str):
    from diffusers import WanTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    converted = convert_wan_transformer_to_diffusers({k: v.clone() for k, v in model.state_dict().items()})
    twin = WanTransformer3DModel(
        patch_size=config["patch_size"], num_attention_heads=config["num_heads"],
        attention_head_dim=config["dim"] // config["num_heads"], in_channels=config["in_dim"],
        out_channels=config["out_dim"], text_dim=config["text_dim"], freq_dim=config["freq_dim"],
        ffn_dim=config["ffn_dim"], num_layers=config["num_layers"], cross_attn_norm=config["cross_attn_norm"],
        eps=config["eps"], image_dim=TINY_IMAGE_DIM if variant == "i2v21" else None,
        added_kv_proj_dim=config["dim"] if variant == "i2v21" else None)
    twin.load_state_dict(converted, strict=True)
    return twin.eval()


def write(modules: dict, out: Path) -> dict:
    generator = torch.Generator().manual_seed(SEED)
    tensors, meta = {}, {"clip_tokens": CLIP_TOKENS, "image_dim": TINY_IMAGE_DIM, "variants": {}}
    for variant, config in VARIANTS.items():
        module = modules["2.1" if variant == "i2v21" else "2.2"]
        model = build(module, config, generator, variant)
        model.save_pretrained(out / variant / "wan")
        twin = diffusers_twin(model, config, variant)
        twin.save_pretrained(out / variant / "diffusers")
        meta["variants"][variant] = {"config": {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()},
                                     "cases": {}}
        for name, (shape, lengths, times, per_token) in CASES[variant].items():
            case = case_inputs(generator, config, shape, lengths, times, per_token, variant)
            with torch.no_grad():
                case["out"] = run_wan(model, case, variant)
                padded = torch.nn.functional.pad(case["context"], (0, 0, 0, 512 - case["context"].shape[1]))
                dif = twin(case["x"], case["t"] * 1000, padded, encoder_hidden_states_image=case.get("image")).sample
            scale = case["out"].abs().max()
            meta["variants"][variant]["cases"][name] = {
                "shape": list(shape), "caption_lengths": lengths, "per_token_t": per_token,
                "diffusers_vs_wan_rel": float((dif - case["out"]).abs().max() / scale)}
            tensors.update({f"{variant}.{name}.{k}": v.contiguous() for k, v in case.items()})
            print(f"{variant}.{name}: diffusers vs Wan rel {meta['variants'][variant]['cases'][name]['diffusers_vs_wan_rel']:.2e}")
    save_file(tensors, str(out / "cases.safetensors"), metadata={"format": "pt"})
    (out / "cases.json").write_text(json.dumps(meta, indent=1) + "\n")
    return tensors


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wan21_checkout", type=Path)
    parser.add_argument("wan22_checkout", type=Path)
    parser.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "wan_variants")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    warnings.filterwarnings("ignore", message=".*autocast.*")
    modules = {}
    for version, checkout in (("2.1", args.wan21_checkout), ("2.2", args.wan22_checkout)):
        for name in [n for n in sys.modules if n == "wan" or n.startswith("wan.")]:
            del sys.modules[name]   # the two checkouts share module names
        modules[version] = import_wan(checkout.resolve())
    args.out.mkdir(parents=True, exist_ok=True)
    write(modules, args.out)


if __name__ == "__main__":
    main()
