"""Resolution tables: every resolution name, its pixel count and its aspect-ratio sizes.

Open-Sora 1.2's tables (some built from a formula, some hand-edited as shipped), PixArt's
tables that Open-Sora reuses, videodit's own small "Npx" tables for CPU and toy runs, and
Wan 2.1's sizes ("wan480p": 832x480, "wan720p": 1280x720, either way up), Open-Sora 2.0's
tables ("256px", "512px", "768px", "1024px"; "768px-d32" for its high-compression autoencoder),
and LTX-2's ("ltx544p": LTX's trainer's 960x544 bucket and its aspect variants).
Also Open-Sora 1.2's stage-1 ``bucket_config``, the reference workload.
"""

from __future__ import annotations

import math

# Open-Sora's own tables: ratio key (H/W, 2 decimals) -> the exact ratio they were built
# from. "0.54" is 1/1.85 (cinema 1.85:1), not 27/50, and "2.08" is 25/12: only these
# reproduce the shipped sizes.
_OPENSORA_RATIOS: dict[str, float] = {
    "0.38": 3 / 8, "0.43": 9 / 21, "0.48": 12 / 25, "0.50": 1 / 2, "0.53": 9 / 17,
    "0.54": 20 / 37, "0.56": 9 / 16, "0.62": 5 / 8, "0.67": 2 / 3, "0.75": 3 / 4,
    "1.00": 1.0, "1.33": 4 / 3, "1.50": 3 / 2, "1.78": 16 / 9, "1.89": 17 / 9,
    "2.00": 2.0, "2.08": 25 / 12,
}

# name -> pixel count, for the tables Open-Sora generated from a formula.
_OPENSORA_PIXELS: dict[str, int] = {
    "144p": 144 * 256, "240p": 102240, "360p": 360 * 640, "480p": 409920,
    "720p": 720 * 1280, "1080p": 1080 * 1920, "2k": 1440 * 2560, "4k": 2160 * 3840,
}

# Entries Open-Sora ships that differ from its own formula (hand edits); kept as shipped
# so assignments and target sizes match theirs.
_OPENSORA_OVERRIDES: dict[tuple[str, str], tuple[int, int]] = {
    ("240p", "0.67"): (262, 393),
    ("480p", "0.48"): (444, 925),
    ("480p", "1.33"): (740, 555),
}

# PixArt's 1024-pixel table (H, W), which Open-Sora reuses as "1024" and scales by 1/4,
# 1/2 and 2 for "256", "512" and "2048". Keys are f"{H/W:.2f}".
_PIXART_1024: tuple[tuple[int, int], ...] = (
    (512, 2048), (512, 1984), (512, 1920), (512, 1856), (576, 1792), (576, 1728),
    (576, 1664), (640, 1600), (640, 1536), (704, 1472), (704, 1408), (704, 1344),
    (768, 1344), (768, 1280), (832, 1216), (832, 1152), (896, 1152), (896, 1088),
    (960, 1088), (960, 1024), (1024, 1024), (1024, 960), (1088, 960), (1088, 896),
    (1152, 896), (1152, 832), (1216, 832), (1280, 768), (1344, 768), (1408, 704),
    (1472, 704), (1536, 640), (1600, 640), (1664, 576), (1728, 576), (1792, 576),
    (1856, 512), (1920, 512), (1984, 512), (2048, 512),
)
_PIXART_SCALES: dict[str, float] = {"256": 0.25, "512": 0.5, "1024": 1.0, "2048": 2.0}

# PixArt's 2880 table: its keys are not H/W rounded (e.g. "0.25" is 1408x5760 = 0.244),
# so it is data, not a formula.
_PIXART_2880: tuple[tuple[str, int, int], ...] = (
    ("0.25", 1408, 5760), ("0.26", 1408, 5568), ("0.27", 1408, 5376), ("0.28", 1408, 5184),
    ("0.32", 1600, 4992), ("0.33", 1600, 4800), ("0.34", 1600, 4672), ("0.40", 1792, 4480),
    ("0.42", 1792, 4288), ("0.47", 1920, 4096), ("0.49", 1920, 3904), ("0.51", 1920, 3776),
    ("0.55", 2112, 3840), ("0.59", 2112, 3584), ("0.68", 2304, 3392), ("0.72", 2304, 3200),
    ("0.78", 2496, 3200), ("0.83", 2496, 3008), ("0.89", 2688, 3008), ("0.93", 2688, 2880),
    ("1.00", 2880, 2880), ("1.07", 2880, 2688), ("1.12", 3008, 2688), ("1.21", 3008, 2496),
    ("1.28", 3200, 2496), ("1.39", 3200, 2304), ("1.47", 3392, 2304), ("1.70", 3584, 2112),
    ("1.82", 3840, 2112), ("2.03", 3904, 1920), ("2.13", 4096, 1920), ("2.39", 4288, 1792),
    ("2.50", 4480, 1792), ("2.92", 4672, 1600), ("3.00", 4800, 1600), ("3.12", 4992, 1600),
    ("3.68", 5184, 1408), ("3.82", 5376, 1408), ("3.95", 5568, 1408), ("4.00", 5760, 1408),
)

# Open-Sora 1.2's ASPECT_RATIOS order. The position of a name is also its code in the
# random stream, so new names must be appended, never inserted.
RESOLUTION_NAMES: tuple[str, ...] = (
    "144p", "256", "240p", "360p", "512", "480p", "720p", "1024", "1080p", "2k", "2048",
    "2880", "4k",
    # videodit's own small resolutions for CPU and toy runs (not in Open-Sora): "Npx" has
    # N*N pixels and sides that are multiples of 4.
    "16px", "24px", "32px", "48px", "64px", "96px", "128px",
    # Wan 2.1's sizes (not in Open-Sora; see _sized_table).
    "wan480p", "wan720p",
    # Open-Sora 2.0's (see _opensora2_table).
    "256px", "512px", "768px", "1024px", "768px-d32",
    # LTX-2's (see _sized_table).
    "ltx544p",
)

# Aspect ratios of the small "Npx" tables: the common video and photo shapes.
_SMALL_RATIOS: tuple[str, ...] = ("0.56", "0.75", "1.00", "1.33", "1.78")


def _even_side(x: float) -> int:
    """Round to the nearer even neighbour of x (Open-Sora's rule: ceil if even, else floor)."""
    x += 1e-4
    up = math.ceil(x)
    return up if up % 2 == 0 else math.floor(x)


def _even_size(pixels: int, ratio: float) -> tuple[int, int]:
    h = _even_side(math.sqrt(pixels * ratio))
    return h, _even_side(h / ratio)


def _floor_size(pixels: int, ratio: float) -> tuple[int, int]:
    # 144p alone was built by truncation (odd sides such as 117x312 appear).
    h = int(math.sqrt(pixels * ratio))
    return h, int(h / ratio)


def _opensora_table(name: str) -> dict[str, tuple[int, int]]:
    size = _floor_size if name == "144p" else _even_size
    table = {key: size(_OPENSORA_PIXELS[name], ratio) for key, ratio in _OPENSORA_RATIOS.items()}
    for (table_name, key), hw in _OPENSORA_OVERRIDES.items():
        if table_name == name:
            table[key] = hw
    return table


def _pixart_table(name: str) -> dict[str, tuple[int, int]]:
    if name == "2880":
        return {key: (h, w) for key, h, w in _PIXART_2880}
    scale = _PIXART_SCALES[name]
    return {f"{h / w:.2f}": (int(h * scale), int(w * scale)) for h, w in _PIXART_1024}


def _small_table(side: int) -> dict[str, tuple[int, int]]:
    """An "Npx" table: sides rounded to multiples of 4 (patchable in pixel space)."""
    def round4(x: float) -> int:
        return max(4, int(round(x / 4)) * 4)
    table = {}
    for key in _SMALL_RATIOS:
        ratio = _OPENSORA_RATIOS[key]
        h = round4(math.sqrt(side * side * ratio))
        table[key] = (h, round4(h / ratio))
    return table


# Wan 2.1's released sizes, (height, width): wan/configs SUPPORTED_SIZES, "832*480" and
# "1280*720" landscape plus their portrait turns. LTX-2's: ltx-trainer's typical bucket
# 960x544 (its --resolution-buckets "960x544x49").
# name -> ((height, width), D: sides are multiples of D, the VAE's spatial compression x the patch)
_SIZED: dict[str, tuple[tuple[int, int], int]] = {"wan480p": ((480, 832), 16), "wan720p": ((720, 1280), 16),
                                                  "ltx544p": ((544, 960), 32)}


def _sized_table(name: str) -> dict[str, tuple[int, int]]:
    """A released size in landscape and portrait, and 4:3, 1:1 and 3:4 shapes at about the same
    pixel count with sides that are multiples of D (Wan: 16, the VAE's 8 x the patch's 2; LTX-2:
    32, its VAE's 32 x patch 1)."""
    (h, w), step = _SIZED[name]
    side = int(round(math.sqrt(h * w) / step)) * step
    four_three = int(round(math.sqrt(h * w * 3 / 4) / step)) * step
    landscape_43 = (four_three, int(round(four_three * 4 / 3 / step)) * step)
    sizes = [(h, w), (w, h), (side, side), landscape_43, landscape_43[::-1]]
    return dict(sorted((f"{a / b:.2f}", (a, b)) for a, b in sizes))


# Open-Sora 2.0's width:height list (opensora/datasets/aspect.py ASPECT_RATIO_LD_LIST), in its order.
_OPENSORA2_RATIOS: tuple[str, ...] = ("2.39:1", "2:1", "16:9", "1.85:1", "9:16", "5:8", "3:2", "4:3", "1:1")
# name -> (side: the table has side x side pixels, D: sides are multiples of D, the autoencoder's
# spatial compression x the patch; Open-Sora sets D with ae_spatial_compression, 32 for the
# high-compression DC-AE).
_OPENSORA2_NAMES: dict[str, tuple[int, int]] = {"256px": (256, 16), "512px": (512, 16), "768px": (768, 16),
                                                "1024px": (1024, 16), "768px-d32": (768, 32)}


def _opensora2_table(name: str) -> dict[str, tuple[int, int]]:
    """Open-Sora 2.0's training table (``get_aspect_ratios_dict(training=True)``): per width:height,
    sides that are multiples of D near the pixel count, nudged one step of D where that comes
    closer to it, repeats dropped, then each shape turned upright. Keyed like the others by H/W,
    that of the *named* ratio (Open-Sora picks a clip's closest name, not its closest shape: "16:9"
    at 256px is 192x336); a turned shape whose name exists replaces it, as Open-Sora's dict update
    does."""
    side, step = _OPENSORA2_NAMES[name]
    total = side * side
    by_ratio: dict[str, tuple[int, int]] = {}
    upright: dict[str, tuple[int, int]] = {}
    for ratio in _OPENSORA2_RATIOS:
        width_part, height_part = map(float, ratio.split(":"))
        width = int(math.sqrt(total * (width_part / height_part)) // step) * step
        height = int((total / width) // step) * step
        best = abs(height * width - total)
        for h, w in ((height - step, width), (height + step, width), (height, width - step), (height, width + step)):
            if abs(h * w - total) < best:
                height, width, best = h, w, abs(h * w - total)
        if (height, width) not in by_ratio.values():
            by_ratio[ratio] = (height, width)
            upright[":".join(ratio.split(":")[::-1])] = (width, height)
    by_ratio.update(upright)
    named = {f"{float(ratio.split(':')[1]) / float(ratio.split(':')[0]):.2f}": hw for ratio, hw in by_ratio.items()}
    return dict(sorted(named.items(), key=lambda item: float(item[0])))


def _build_tables() -> tuple[dict[str, int], dict[str, dict[str, tuple[int, int]]]]:
    pixels: dict[str, int] = {}
    tables: dict[str, dict[str, tuple[int, int]]] = {}
    for name in RESOLUTION_NAMES:
        if name in _OPENSORA2_NAMES:
            side = _OPENSORA2_NAMES[name][0]
            pixels[name], tables[name] = side * side, _opensora2_table(name)
        elif name.endswith("px"):
            side = int(name[:-2])
            pixels[name], tables[name] = side * side, _small_table(side)
        elif name in _SIZED:
            pixels[name], tables[name] = math.prod(_SIZED[name][0]), _sized_table(name)
        elif name in _OPENSORA_PIXELS:
            pixels[name], tables[name] = _OPENSORA_PIXELS[name], _opensora_table(name)
        else:
            side = int(name)
            pixels[name], tables[name] = side * side, _pixart_table(name)
    return pixels, tables


#: name -> pixel count the 0.8 criterion compares against (e.g. "240p" -> 102240).
#: name -> {ratio key "H/W" with 2 decimals: (height, width)}, keys ascending.
RESOLUTION_PIXELS, ASPECT_RATIOS = _build_tables()

# Open-Sora 1.2's stage-1 bucket_config (configs/opensora-v1-2/train/stage1.py), as written
# there: the reference workload for benchmarks and the memory planner.
OPENSORA_V12_STAGE1: dict = {
    "144p": {1: (1.0, 475), 51: (1.0, 51), 102: ((1.0, 0.33), 27), 204: ((1.0, 0.1), 13), 408: ((1.0, 0.1), 6)},
    "256": {1: (0.4, 297), 51: (0.5, 20), 102: ((0.5, 0.33), 10), 204: ((0.5, 0.1), 5), 408: ((0.5, 0.1), 2)},
    "240p": {1: (0.3, 297), 51: (0.4, 20), 102: ((0.4, 0.33), 10), 204: ((0.4, 0.1), 5), 408: ((0.4, 0.1), 2)},
    "360p": {1: (0.2, 141), 51: (0.15, 8), 102: ((0.15, 0.33), 4), 204: ((0.15, 0.1), 2), 408: ((0.15, 0.1), 1)},
    "512": {1: (0.1, 141)},
    "480p": {1: (0.1, 89)},
    "720p": {1: (0.05, 36)},
    "1024": {1: (0.05, 36)},
    "1080p": {1: (0.1, 5)},
    "2048": {1: (0.1, 5)},
}
