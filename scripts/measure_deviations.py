"""Measure how far the tests' floating-point comparisons move between environments.

Every test comparing computed floats with a fixture goes through ``tests/tolerance.py``'s
``assert_close``. ``run`` executes those tests once as a measuring run (``VIDEODIT_DEVIATIONS``:
each comparison records its deviation, none fails) with a given Python and thread count;
``report`` takes the records of several environments and prints, per comparison, the worst
deviation, its bound and their ratio, flagging bounds less than ``--factor`` (10) above it.

    python scripts/measure_deviations.py run --out /tmp/dev-a.jsonl [--python PY] [--threads 1] [--isa avx2]
    python scripts/measure_deviations.py report /tmp/dev-*.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Other CPUs on this one: torch's vectorised kernels, MKL's and oneDNN's code paths capped at an
# older instruction set (an AVX2-only machine; a machine with neither AVX2 nor AVX-512).
ISAS = {"native": {},
        "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
        "default": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
                    "ONEDNN_MAX_CPU_ISA": "SSE41"}}


def instrumented_tests() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                  if "from tolerance import" in p.read_text())


def run(args) -> None:
    out = Path(args.out).resolve()
    out.unlink(missing_ok=True)
    env = {**os.environ, **ISAS[args.isa], "VIDEODIT_DEVIATIONS": str(out), "OMP_NUM_THREADS": str(args.threads)}
    probe = "import torch, importlib.metadata as m; print(torch.__version__, m.version('transformers'), torch.get_num_threads())"
    version = subprocess.run([args.python, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout.split()
    tests = instrumented_tests()
    print(f"torch {version[0]}, transformers {version[1]}, {version[2]} threads: {len(tests)} files", flush=True)
    subprocess.run([args.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=ROOT, env=env)
    environment = f"torch {version[0]} / transformers {version[1]} / {args.threads} thr / {args.isa}"
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    out.write_text("".join(json.dumps({**r, "env": environment}) + "\n" for r in lines))
    print(f"{len(lines)} comparisons -> {out}")


def report(args) -> None:
    worst: dict[tuple[str, str], dict] = defaultdict(lambda: {"deviation": 0.0, "envs": {}})
    for path in args.files:
        for line in Path(path).read_text().splitlines():
            r = json.loads(line)
            key = (r["test"], str(r["what"]))
            entry = worst[key]
            entry["bound"] = r["bound"]
            entry["deviation"] = max(entry["deviation"], r["deviation"])
            entry["envs"][r.get("env", path)] = max(entry["envs"].get(r.get("env", path), 0.0), r["deviation"])
    envs = sorted({e for entry in worst.values() for e in entry["envs"]})
    print("environments:", *(f"  [{i}] {e}" for i, e in enumerate(envs)), sep="\n")
    weak = 0
    for (test, what), entry in sorted(worst.items()):
        ratio = entry["bound"] / entry["deviation"] if entry["deviation"] else float("inf")
        flag = "  <-- bound under factor" if ratio < args.factor else ""
        weak += bool(flag)
        per_env = " ".join(f"{entry['envs'].get(e, float('nan')):.1e}" for e in envs)
        print(f"{test} [{what}]: worst {entry['deviation']:.2e} bound {entry['bound']:.0e} "
              f"({ratio:.0f}x) | {per_env}{flag}")
    print(f"{len(worst)} comparisons, {weak} with a bound under {args.factor}x their worst deviation")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--python", default=sys.executable)
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--isa", choices=sorted(ISAS), default="native", help="emulate a CPU with fewer instructions")
    p = sub.add_parser("report")
    p.add_argument("files", nargs="+")
    p.add_argument("--factor", type=float, default=10.0)
    args = parser.parse_args()
    run(args) if args.command == "run" else report(args)


if __name__ == "__main__":
    main()
