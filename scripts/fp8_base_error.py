"""How much an fp8 (e4m3) copy of a weight differs from the weight, per scale choice.

    python scripts/fp8_base_error.py [--json]

For each weight distribution it prints the relative error ||W' - W|| / ||W|| (Frobenius), whole
and of the worst row, of the weight W' that compute sees, dequantised to fp32 and to bf16, for four scale choices:
one scale per tensor or per output row, each either exact (amax / 448, fp32) or rounded up to a
power of two (videodit's choice, ``videodit/parallel/fp8_base.py``); bf16 itself is the yardstick.
The distributions: Xavier-uniform and normal(0, 0.02) 3072 x 3072 weights, the same normal weight
with row norms spread over 10^4x (a stress case: per-tensor scaling pushes the small rows
into e4m3's subnormals),
and every block Linear of a tiny Wan (wan-tiny preset's init), pooled. The last line is the
tiny Wan's whole output with its block weights in fp8 (per-row power-of-two), and for scale with
all its weights in bf16, against fp32.
"""

from __future__ import annotations

import argparse
import json

import torch

from videodit.parallel.fp8_base import FP8, FP8_MAX, dequantize, fp8_layer_paths, quantize, store_base_in_fp8

SIZE = 3072
SPREAD = 1e4   # row norms log-uniform over this ratio: where per-tensor scales lose rows to subnormals


def scales_of(weight: torch.Tensor, per_row: bool, power_of_two: bool) -> torch.Tensor:
    amax = weight.abs().amax(dim=1, keepdim=True) if per_row else weight.abs().amax().reshape(1, 1)
    scale = amax.float() / FP8_MAX
    return torch.exp2(torch.ceil(torch.log2(scale))) if power_of_two else scale


def seen_by_compute(weight: torch.Tensor, per_row: bool, power_of_two: bool, dtype: torch.dtype) -> torch.Tensor:
    scale = scales_of(weight, per_row, power_of_two)
    bits = (weight / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    # bf16 runs hold the scale in bf16 (exact for a power of two) and multiply in bf16
    return bits.to(dtype) * scale.to(dtype)


def relative(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return ((approx.double() - exact.double()).norm() / exact.double().norm()).item()


def errors(approx: list[torch.Tensor], exact: list[torch.Tensor]) -> list[float]:
    """[whole relative error, worst row's relative error]: the whole is dominated by the largest
    rows; the worst row shows what a scale choice does to the small ones."""
    whole = relative(torch.cat([a.flatten() for a in approx]), torch.cat([e.flatten() for e in exact]))
    rows = max(((a.double() - e.double()).norm(dim=1) / e.double().norm(dim=1).clamp_min(1e-30)).max().item()
               for a, e in zip(approx, exact))
    return [whole, rows]


def distributions(seed: int = 0) -> dict[str, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    xavier = (torch.rand(SIZE, SIZE, generator=gen) * 2 - 1) * (6 / (2 * SIZE)) ** 0.5
    normal = torch.randn(SIZE, SIZE, generator=gen) * 0.02
    spread = normal * torch.exp(torch.rand(SIZE, 1, generator=gen) * torch.log(torch.tensor(SPREAD)))
    return {"xavier-uniform 3072x3072": [xavier], "normal(0, 0.02) 3072x3072": [normal],
            f"normal, row norms over {SPREAD:g}x": [spread], "tiny Wan block linears": wan_tiny_weights(seed)}


def wan_tiny(seed: int):
    from videodit.components import model_geometry
    from videodit.config import load_config
    from videodit.models.families import get_spec

    cfg = load_config("tiny", ["model.preset=wan-tiny"])
    torch.manual_seed(seed)
    return get_spec("wan").build(model_geometry(cfg, 16, cfg.text.dim))


def wan_tiny_weights(seed: int) -> list[torch.Tensor]:
    model = wan_tiny(seed)
    return [model.get_submodule(path).weight.detach() for path in fp8_layer_paths(model)]


def table() -> dict:
    out = {}
    for name, weights in distributions().items():
        row = {"bf16": errors([w.to(torch.bfloat16) for w in weights], weights)}
        for per_row in (False, True):
            for power_of_two in (False, True):
                for dtype in (torch.float32, torch.bfloat16):
                    key = (f"{'row' if per_row else 'tensor'} {'pow2' if power_of_two else 'exact'} "
                           f"-> {str(dtype).removeprefix('torch.')}")
                    row[key] = errors([seen_by_compute(w, per_row, power_of_two, dtype) for w in weights], weights)
        out[name] = row
    # videodit's own path gives the row/pow2 figures above exactly
    w = distributions()["xavier-uniform 3072x3072"][0]
    bits, scales = quantize(w)
    assert torch.equal(dequantize(bits, scales, torch.float32), seen_by_compute(w, True, True, torch.float32))
    out["tiny Wan output, fp8 blocks vs fp32"] = wan_output_error("fp8")
    out["tiny Wan output, bf16 weights vs fp32"] = wan_output_error("bf16")
    return out


def wan_output_error(kind: str, seed: int = 0) -> float:
    exact, fp8 = wan_tiny(seed), wan_tiny(seed)
    with torch.no_grad():   # a trained head (the init's is zero) and random inputs
        for a, b in zip(exact.parameters(), fp8.parameters()):
            if a.abs().sum() == 0:
                a.normal_(std=0.02)
                b.copy_(a)
    fp8.requires_grad_(False)
    if kind == "fp8":
        store_base_in_fp8(fp8)
    else:   # every weight rounded to bf16, computed in fp32
        with torch.no_grad():
            for param in fp8.parameters():
                param.copy_(param.to(torch.bfloat16).float())
    geometry = exact.geometry
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, geometry.in_channels, 4, 16, 16, generator=gen)
    t = torch.tensor([0.3, 0.8])
    caption = torch.randn(2, 8, geometry.text_dim, generator=gen)
    with torch.no_grad():
        return relative(fp8(x, t, caption), exact(x, t, caption))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    results = table()
    if parser.parse_args().json:
        print(json.dumps(results, indent=1))
        return
    for name, row in results.items():
        if isinstance(row, float):
            print(f"{name}: {row:.3e}")
            continue
        print(f"{name}: relative error, whole / worst row")
        for key, (whole, worst) in row.items():
            print(f"  {key:<24} {whole:.3e} / {worst:.3e}")


if __name__ == "__main__":
    main()
