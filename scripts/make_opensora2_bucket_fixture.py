"""Write tests/fixtures/opensora2/aspect_tables.json: Open-Sora 2.0's training resolution tables
as its own ``opensora/datasets/aspect.py`` builds them (the named ratio's H/W -> [H, W]).

    python scripts/make_opensora2_bucket_fixture.py --checkout /work/refs/opensora2 [--out tests/fixtures/opensora2]

``AE_SPATIAL_COMPRESSION`` (Open-Sora's ``ae_spatial_compression``) is 16 for the Hunyuan VAE x
the 2x2 patch and 32 for the high-compression DC-AE; videodit names the latter "768px-d32".
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from pathlib import Path

# videodit's name -> (Open-Sora's name, AE_SPATIAL_COMPRESSION)
TABLES = {"256px": ("256px", 16), "512px": ("512px", 16), "768px": ("768px", 16), "1024px": ("1024px", 16),
          "768px-d32": ("768px", 32)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", required=True, help="hpcaitech/Open-Sora main")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests/fixtures/opensora2"))
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location("aspect", Path(args.checkout) / "opensora/datasets/aspect.py")
    aspect = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(aspect)   # the file imports only math and os
    tables = {}
    for name, (theirs, compression) in TABLES.items():
        os.environ["AE_SPATIAL_COMPRESSION"] = str(compression)
        table = aspect.get_aspect_ratios_dict(aspect.get_num_pexels_from_name(theirs), training=True)
        tables[name] = {f"{aspect.get_ratio(key):.2f}": list(hw) for key, hw in table.items()}
    out = Path(args.out) / "aspect_tables.json"
    out.write_text(json.dumps(tables, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
