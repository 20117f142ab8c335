"""Try videodit as a careless user and an adversary would, and report how each case ends.

    python scripts/abuse_test.py [--only SUBSTRING] [--keep DIR]

Every case runs the real command line in a fresh process and prints one line: the case, the
exit code, the first line of what it printed, whether files that existed before are intact,
and whether the case held (the expected exit code, one ``error:`` line and no traceback,
outputs intact). The exit status is the number of cases that did not hold.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

TINY = ["model.depth=1", "model.hidden_size=32", "model.num_heads=2", "model.patch_size=[1,4,4]",
        "data.num_frames=4", "data.height=16", "data.width=16", "data.frame_interval=1",
        "data.make_toy_if_missing=false", "train.batch_size=4", "train.log_every=1", "train.warmup_steps=1",
        "sample.steps=2", "sample.prompts=[a red circle moving right]", "validation.csv=null",
        "diffusion.shift_base_pixels=256", "diffusion.shift_base_frames=4"]


@dataclass
class Case:
    name: str
    args: list[str]
    expect: int = 2                          # the exit code that means "handled"
    watch: list[Path] = field(default_factory=list)   # files and folders that must stay as they were
    cwd: Path | None = None
    check: object = None                     # an extra check: a function returning (ok, note)
    timeout: float = 180


def digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for root in paths:
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        for p in files:
            h.update(str(p).encode())
            h.update(p.read_bytes() if p.exists() and not p.is_symlink() else b"-")
        h.update(b"exists" if root.exists() else b"absent")
    return h.hexdigest()


def videodit(*args: str, cwd: Path | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "videodit", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)


def run_case(case: Case) -> dict:
    before = digest(case.watch)
    try:
        result = videodit(*case.args, cwd=case.cwd, timeout=case.timeout)
        code, out = result.returncode, (result.stderr + "\n" + result.stdout)
    except subprocess.TimeoutExpired:
        code, out = "timeout", ""
    lines = [line for line in out.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(("error", "note:"))] or \
        [line for line in lines if "rror" in line]
    first = (errors or lines or [""])[0][:160]
    intact = digest(case.watch) == before
    clean = "Traceback" not in out
    ok, note = (True, "")
    if case.check is not None:
        ok, note = case.check()
    held = code == case.expect and intact and clean and ok
    return {"case": case.name, "exit": code, "first line": first, "intact": intact, "no traceback": clean,
            "held": held, "note": note}


def build_cases(tmp: Path) -> list[Case]:
    toy = tmp / "toy"
    run = tmp / "run"
    base = ["train", "--out"]

    def tiny(out: Path, *extra: str) -> list[str]:
        return [*base, str(out), f"data.csv={toy / 'train.csv'}", *TINY, *extra]

    # One finished run to abuse: two steps, a checkpoint at each.
    result = videodit(*tiny(run, "train.max_steps=2", "checkpoint.every_steps=1"))
    assert result.returncode == 0, result.stderr[-2000:]

    def copy_run(name: str) -> Path:
        target = tmp / name
        shutil.copytree(run, target)
        return target

    cases: list[Case] = []
    add = cases.append

    # --- config
    add(Case("unknown config key", ["config", "show", "train.lrr=0.1"]))
    add(Case("wrong type", ["config", "show", "train.max_steps=many"]))
    evil_yaml = tmp / "evil.yaml"
    evil_yaml.write_text("name: !!python/object/apply:os.system ['touch " + str(tmp / "pwned-yaml") + "']\n")
    add(Case("!!python YAML tag", ["config", "show", str(evil_yaml)],
             check=lambda: (not (tmp / "pwned-yaml").exists(), "no code ran")))
    for key in ("train.lr=nan", "train.lr=inf", "diffusion.logit_std=nan"):
        add(Case(f"non-finite {key}", ["config", "show", key]))
    dup = tmp / "dup.yaml"
    dup.write_text("train:\n  lr: 0.1\ntrain:\n  lr: 0.2\n")
    add(Case("duplicate YAML keys", ["config", "show", str(dup)]))
    deep = tmp / "deep.yaml"
    deep.write_text("a: " + "[" * 100000 + "]" * 100000)
    add(Case("deeply nested YAML", ["config", "show", str(deep)]))
    latin = tmp / "latin1.yaml"
    latin.write_bytes("name: caf\xe9\n".encode("latin-1"))
    add(Case("YAML not UTF-8", ["config", "show", str(latin)]))
    empty = tmp / "empty.yaml"
    empty.write_text("")
    add(Case("empty YAML (defaults, said)", ["config", "show", str(empty)], expect=0))
    add(Case("sample.prompts=[]", ["config", "show", "sample.prompts=[]"]))
    add(Case("data.height=1", ["config", "show", "data.height=1"]))

    # --- metadata
    no_cols = tmp / "nocols.csv"
    no_cols.write_text("file,caption\na.mp4,x\n")
    add(Case("CSV missing columns", ["buckets", str(no_cols)]))
    bom = tmp / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbf" + (toy / "train.csv").read_bytes())
    shutil.copytree(toy / "videos", tmp / "videos")
    add(Case("CSV with a UTF-8 BOM (accepted)", ["buckets", str(bom)], expect=0))
    latin_csv = tmp / "latin1.csv"
    latin_csv.write_bytes((toy / "train.csv").read_bytes().replace(b"a red", "\xe9 red".encode("latin-1")))
    add(Case("CSV not UTF-8", ["buckets", str(latin_csv)]))
    add(Case("mistyped data.csv (no toy made)", ["train", "tiny", "data.csv=videodit-toi/train.csv",
                                                 "--out", str(tmp / "typo-run")], cwd=tmp,
             check=lambda: (not (tmp / "videodit-toi").exists(), "no toy data generated")))
    add(Case("data filter -o onto its input", ["data", "filter", str(toy / "train.csv"), "-o", str(toy / "train.csv"),
                                               "--min-frames", "100"], watch=[toy / "train.csv"]))
    add(Case("toy make over a user's train.csv", ["toy", "make", str(toy)], watch=[toy / "train.csv"]))
    add(Case("buckets META --config C key=value", ["buckets", str(toy / "train.csv"), "--config", "tiny",
                                                   "train.batch_size=2"], expect=0))

    # --- run folders
    a_file = tmp / "a-file.txt"
    a_file.write_text("mine")
    add(Case("--out is a file", tiny(a_file), watch=[a_file]))
    users = tmp / "users-folder"
    users.mkdir()
    (users / "config.yaml").write_text("my own notes")
    add(Case("--out holds a user's files", tiny(users), watch=[users]))
    add(Case("resume=nowhere (no folder made)", tiny(tmp / "new-run", f"resume={tmp / 'nowhere'}"),
             check=lambda: (not (tmp / "new-run").exists(), "folder not created")))
    add(Case("resume with a changed config", tiny(run, "resume=auto", "train.max_steps=4", "train.lr=0.01"),
             watch=[run]))
    locked = copy_run("locked-run")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    import socket
    (locked / ".lock").write_text(json.dumps({"pid": sleeper.pid, "host": socket.gethostname(), "started": "-"}))
    add(Case("second writer on one run folder", tiny(locked, "resume=auto", "train.max_steps=4"), watch=[locked]))
    damaged = copy_run("all-damaged")
    for ckpt in (damaged / "checkpoints").iterdir():
        (ckpt / "optimizer.pt").write_bytes((ckpt / "optimizer.pt").read_bytes()[:64])
    add(Case("every checkpoint damaged", tiny(damaged, "resume=auto", "train.max_steps=4"), watch=[damaged]))
    add(Case("weights from a damaged run (init_from)",
             tiny(tmp / "from-damaged", f"model.init_from={damaged / 'checkpoints' / 'step-0000002'}",
                  "train.max_steps=1"), expect=0))
    width = copy_run("width-change")
    add(Case("continue across a model width change",
             tiny(width, "resume=auto", "train.max_steps=4", "checkpoint.on_config_change=continue",
                  "model.hidden_size=64"), watch=[width / "checkpoints"]))

    # --- checkpoint files
    crafted = copy_run("crafted")
    newest = crafted / "checkpoints" / "step-0000002"
    marker = tmp / "pwned-dcp"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (newest / "dcp").mkdir()
    blob = pickle.dumps(Payload())
    (newest / "dcp" / ".metadata").write_bytes(blob)
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["files"]["dcp/.metadata"] = {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    (newest / "manifest.json").write_text(json.dumps(manifest))
    add(Case("crafted dcp/.metadata pickle", tiny(crafted, "resume=auto", "train.max_steps=4"),
             check=lambda: (not marker.exists(), "payload not run")))
    bad_manifest = copy_run("bad-manifest")
    for ckpt in (bad_manifest / "checkpoints").iterdir():
        (ckpt / "manifest.json").write_text("{not json")
    target = bad_manifest / "checkpoints" / "step-0000002"
    add(Case("malformed manifest: train resume=PATH", tiny(bad_manifest, f"resume={target}", "train.max_steps=4"),
             watch=[target]))
    add(Case("malformed manifest: sample", ["sample", "--ckpt", str(target), "--prompt", "a red circle",
                                            "--out", str(tmp / "s.mp4")]))
    add(Case("malformed manifest: ckpt inspect", ["ckpt", "inspect", str(target)]))
    add(Case("malformed manifest: ckpt list", ["ckpt", "list", str(bad_manifest)], expect=0))
    zero = copy_run("dev-zero")
    weights = zero / "checkpoints" / "step-0000002" / "ema.safetensors"   # what sampling reads
    weights.unlink()
    weights.symlink_to("/dev/zero")
    add(Case("checkpoint file is /dev/zero", ["sample", "--ckpt", str(zero / "checkpoints" / "step-0000002"),
                                              "--prompt", "x", "--out", str(tmp / "z.mp4")], timeout=60))

    # --- sampling options
    for flag, value in (("--num-frames", "-1"), ("--steps", "0"), ("--cfg", "nan")):
        add(Case(f"sample {flag} {value}", ["sample", "--ckpt", str(run), "--prompt", "x", flag, value]))
    two = tmp / "two-prompts.txt"
    two.write_text("a red circle moving right\na blue square moving up\n")
    add(Case("sample --out is a file", ["sample", "--ckpt", str(run), "--prompts", str(two), "--out", str(a_file)],
             watch=[a_file]))

    # --- disks
    readonly = readonly_folder(tmp)
    add(Case("read-only out: train", tiny(readonly / "run", "train.max_steps=1")))
    add(Case("read-only out: sample", ["sample", "--ckpt", str(run), "--prompt", "x", "--out",
                                       str(readonly / "s")]))
    add(Case("read-only out: data scan -o", ["data", "scan", str(toy / "videos"), "-o", str(readonly / "m.csv")]))
    add(Case("read-only out: toy make", ["toy", "make", str(readonly / "toy")]))
    full = copy_run("full-disk")
    (full / "metrics.jsonl").unlink()
    (full / "metrics.jsonl").symlink_to("/dev/full")
    add(Case("full disk while logging", tiny(full, "resume=auto", "train.max_steps=4"), watch=[full / "checkpoints"
                                                                                               / "step-0000002"],
             check=lambda: ((full / "checkpoints" / "step-0000003" / "manifest.json").is_file(),
                            "the step's checkpoint was saved")))
    # --- round 3 (#22, #28): crafted descriptions, released weights, plans
    add_round_three(add, tmp)
    cases.append(Case("(cleanup)", ["config", "keys"], expect=0, check=lambda: (sleeper.kill() or True, "")))
    return cases


def add_round_three(add, tmp: Path) -> None:
    """Descriptions that ask for too much, answered in one line before any work."""
    levels = ['&a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    levels += [f"&a{i} [{','.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    bomb = tmp / "bomb.yaml"
    bomb.write_text(f"diffusion:\n  mask_ratios: [{', '.join(levels)}]\n")
    add(Case("YAML alias bomb: config show", ["config", "show", str(bomb)], timeout=60))
    add(Case("YAML alias bomb: override", ["config", "show", "tiny", f"train.max_steps=[{', '.join(levels)}]"],
             timeout=60))
    add(Case("plan --gpu-mem 1e300GiB", ["plan", "tiny", "--gpu-mem", "1e300GiB"], timeout=60))
    add(Case("plan --world-size 0", ["plan", "tiny", "--gpu-mem", "80GiB", "--world-size", "0"], timeout=60))
    fixtures = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
    for family, source, key in (("stdit", fixtures / "opensora" / "stdit3", "depth"),
                                ("wan", fixtures / "wan" / "wan", "num_layers")):
        crafted = tmp / f"{family}-huge"
        shutil.copytree(source, crafted)
        config = json.loads((crafted / "config.json").read_text())
        (crafted / "config.json").write_text(json.dumps({**config, key: 10**6}))
        add(Case(f"ckpt import: {family} config.json with {key}=10**6",
                 ["ckpt", "import", str(crafted), str(tmp / f"{family}-imported")], watch=[crafted], timeout=60))


def readonly_folder(tmp: Path) -> Path:
    """A folder nothing can be written into: a read-only tmpfs where mounting is allowed,
    else one without write permission (root ignores that, so then /sys)."""
    folder = tmp / "readonly"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)],
                             capture_output=True).returncode == 0
    if mounted:
        return folder
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return folder
    return Path("/sys/videodit-readonly")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run the cases whose name contains this")
    parser.add_argument("--keep", help="work in this folder and keep it")
    args = parser.parse_args()
    tmp = Path(args.keep or tempfile.mkdtemp(prefix="videodit-abuse-"))
    tmp.mkdir(parents=True, exist_ok=True)
    made = videodit("toy", "make", str(tmp / "toy"), "--clips-per-combination", "1", "--num-frames", "8",
                    "--height", "16", "--width", "16")
    assert made.returncode == 0, made.stderr
    failures = 0
    try:
        for case in build_cases(tmp):
            if args.only and args.only not in case.name and case.name != "(cleanup)":
                continue
            row = run_case(case)
            failures += not row["held"]
            if case.name == "(cleanup)":
                continue
            mark = "held" if row["held"] else "NOT HELD"
            print(f"{mark:8} | {row['case']:<42} | exit {row['exit']!s:<7} | intact {str(row['intact']).lower():<5} | "
                  f"{row['first line']}{' | ' + row['note'] if row['note'] else ''}", flush=True)
    finally:
        subprocess.run(["umount", str(tmp / "readonly")], capture_output=True)
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"{failures} case(s) did not hold")
    return failures


if __name__ == "__main__":
    raise SystemExit(main())
