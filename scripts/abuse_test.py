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
import time
import zlib
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
    says: str | None = None                  # text the output must hold (a skipped file named, ...)


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
    """Run the CLI; the result's ``peak_mib`` is the process's peak resident memory (wait4's rusage)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([sys.executable, "-m", "videodit", *args], stdout=out, stderr=err, cwd=cwd, env=env)
        deadline = time.monotonic() + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                os.wait4(proc.pid, 0)
                raise subprocess.TimeoutExpired(proc.args, timeout)
            time.sleep(0.05)
        out.seek(0)
        err.seek(0)
        result = subprocess.CompletedProcess(proc.args, os.waitstatus_to_exitcode(status),
                                             out.read().decode(errors="replace"), err.read().decode(errors="replace"))
    result.peak_mib = usage.ru_maxrss / 1024   # KiB on Linux
    return result


def run_case(case: Case) -> dict:
    before = digest(case.watch)
    try:
        result = videodit(*case.args, cwd=case.cwd, timeout=case.timeout)
        code, out, peak = result.returncode, (result.stderr + "\n" + result.stdout), result.peak_mib
    except subprocess.TimeoutExpired:
        code, out, peak = "timeout", "", float("nan")
    lines = [line for line in out.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(("error", "note:"))] or \
        [line for line in lines if "rror" in line]
    first = (errors or lines or [""])[0][:160]
    intact = digest(case.watch) == before
    clean = "Traceback" not in out
    ok, note = (True, "")
    if case.check is not None:
        ok, note = case.check()
    if case.says is not None and case.says not in out:
        ok, note = False, f"does not say {case.says!r}"
    held = code == case.expect and intact and clean and ok
    return {"case": case.name, "exit": code, "first line": first, "intact": intact, "no traceback": clean,
            "held": held, "note": note, "peak MiB": peak}


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
    add_round_three_files(add, tmp, toy, run, tiny)
    # --- round 4 (#35): imports and exports
    add_round_four(add, tmp, run, tiny)
    add_round_four_runtime(add, tmp, toy, run)
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


def png_header(path: Path, width: int, height: int) -> Path:
    """A PNG whose header says ``width`` x ``height`` (its pixels are a few bytes): a decompression
    bomb to any reader that trusts the header."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")
    header = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))
    return path


def add_round_three_files(add, tmp: Path, toy: Path, run: Path, tiny) -> None:
    """Round 3 (#28): files that are not files, files that ask for too much, caches damaged or
    shared, and refusals that must leave nothing behind."""
    fifo = tmp / "fifo"
    os.mkfifo(fifo)
    for name, args in (("config", ["config", "show", str(fifo)]),
                       ("data.csv", tiny(tmp / "fifo-run", f"data.csv={fifo}")),
                       ("--prompts", ["sample", "--ckpt", str(run), "--prompts", str(fifo)]),
                       ("bucket_config_file", ["config", "show", "tiny", f"data.bucket_config_file={fifo}"]),
                       ("--ref", ["sample", "--ckpt", str(run), "--prompt", "x", "--ref", str(fifo),
                                  "--out", str(tmp / "ref.mp4")])):
        add(Case(f"FIFO as {name}", args, timeout=60, says="not a regular file but a FIFO",
                 check=lambda: (not (tmp / "fifo-run").exists(), "no run folder")))
    fixtures = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
    released = tmp / "wan-fifo"
    shutil.copytree(fixtures / "wan" / "wan", released)
    (released / "diffusion_pytorch_model.safetensors").unlink()
    os.mkfifo(released / "diffusion_pytorch_model.safetensors")
    add(Case("FIFO as released weights (ckpt import)", ["ckpt", "import", str(released), str(tmp / "fifo-import")],
             timeout=60, says="not a regular file but a FIFO"))
    add(Case("/dev/zero as data.csv", tiny(tmp / "zero-run", "data.csv=/dev/zero"), timeout=60,
             says="not a regular file but a character device"))

    # descriptions that ask for too much
    rows = (toy / "train.csv").read_text().splitlines()
    huge_csv = tmp / "huge-declared.csv"   # one row claims 16000x16000 frames: skipped, named, nothing decoded
    cells = rows[1].split(",")
    header = rows[0].split(",")
    cells[header.index("height")], cells[header.index("width")] = "16000", "16000"
    huge_csv.write_text("\n".join([rows[0], ",".join(cells), *rows[2:13]]) + "\n")   # 12 clips: one epoch
    add(Case("a clip declared 16000x16000 in the CSV (skipped)", tiny(tmp / "huge-run", f"data.csv={huge_csv}",
                                                                    "train.max_steps=3", "data.max_bad_fraction=0.5"),
             expect=0, says="data.max_pixels"))
    bomb = png_header(tmp / "bomb.png", 12000, 12000)
    add(Case("--ref: a 12000x12000 image", ["sample", "--ckpt", str(run), "--prompt", "x", "--ref", str(bomb),
                                            "--out", str(tmp / "bomb.mp4")], timeout=60, says="data.max_pixels"))
    import pyarrow as pa
    import pyarrow.parquet as pq
    strings = tmp / "strings.parquet"
    pq.write_table(pa.table({"path": ["a.mp4"], "text": ["a"], "num_frames": ["16"], "height": [32], "width": [32],
                             "aspect_ratio": [1.0], "fps": [8.0]}), strings)
    add(Case("Parquet num_frames of strings", ["buckets", str(strings), "--config", "tiny"], timeout=60))
    add(Case("bucket batch size 10**30", ["config", "show", "tiny",
                                          "data.bucket_config={'144p': {1: [1.0, " + str(10**30) + "]}}"], timeout=60))
    add(Case("train.batch_size=10**30", tiny(tmp / "batch-run", f"train.batch_size={10**30}"), timeout=60,
             check=lambda: (not (tmp / "batch-run").exists(), "no run folder")))
    add(Case("lora.rank=1e9", ["config", "show", "tiny", "lora.rank=1000000000"], timeout=60))
    add(Case("lora.alpha=0", ["config", "show", "tiny", "lora.rank=4", "lora.alpha=0"], timeout=60))

    # the feature cache
    cache = tmp / "cache"
    built = videodit("cache", "build", "tiny", f"data.csv={toy / 'train.csv'}", *TINY, "--out", str(cache),
                     "--shard-size", "16")
    assert built.returncode == 0, built.stderr[-2000:]

    def cache_copy(name: str) -> Path:
        shutil.copytree(cache, tmp / name)
        return tmp / name

    def train_on(folder: Path, name: str) -> list[str]:
        return tiny(tmp / name, f"data.cache={folder}", "train.max_steps=3")

    flipped = cache_copy("cache-flipped")
    shard = sorted((flipped / "shards").glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    add(Case("cache: a flipped byte in a shard (train)", train_on(flipped, "run-flipped"), watch=[flipped],
             says="is damaged"))
    add(Case("cache: a flipped byte in a shard (cache info)", ["cache", "info", str(flipped)], expect=1,
             watch=[flipped], says="DAMAGED"))
    swapped = cache_copy("cache-swapped")
    first, second = sorted((swapped / "shards").glob("*.safetensors"))[:2]
    a, b = first.read_bytes(), second.read_bytes()
    first.write_bytes(b)
    second.write_bytes(a)
    add(Case("cache: two shards swapped", train_on(swapped, "run-swapped"), watch=[swapped], says="is damaged"))
    fifo_shard = cache_copy("cache-fifo")
    victim = sorted((fifo_shard / "shards").glob("*.safetensors"))[0]
    victim.unlink()
    os.mkfifo(victim)
    add(Case("cache: a FIFO in place of a shard", train_on(fifo_shard, "run-fifo-shard"), timeout=60,
             says="not a regular file"))
    not_parquet = cache_copy("cache-not-parquet")
    (not_parquet / "index.parquet").write_text("not parquet\n")
    add(Case("cache: index.parquet is not Parquet (cache info)", ["cache", "info", str(not_parquet)],
             watch=[not_parquet]))
    deep = cache_copy("cache-deep-manifest")
    (deep / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    add(Case("cache: manifest nested 100,000 deep", ["cache", "info", str(deep)], watch=[deep]))
    busy = cache_copy("cache-busy")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    import socket
    (busy / ".lock").write_text(json.dumps({"pid": sleeper.pid, "host": socket.gethostname(), "started": "-"}))
    add(Case("cache: a second build into one being built", ["cache", "build", "tiny", f"data.csv={toy / 'train.csv'}",
                                                             *TINY, "--out", str(busy), "--shard-size", "16"],
             watch=[busy], check=lambda: (sleeper.kill() or True, "")))

    # a LoRA base changed in the middle, its mtime restored: resume, sample and merge refuse, write nothing
    base_run, base = tmp / "lora-base-run", tmp / "lora-base"
    for step in (videodit(*tiny(base_run, "train.max_steps=1")), videodit("ckpt", "export", str(base_run), str(base)),
                 videodit(*tiny(tmp / "lora-run", f"model.init_from={base}", "lora.rank=4", "train.max_steps=1",
                                "checkpoint.every_steps=1"))):
        assert step.returncode == 0, step.stderr[-2000:]
    weights = base / "model.safetensors"
    stat = weights.stat()
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    lora_run = tmp / "lora-run"
    add(Case("LoRA base edited in the middle: resume", tiny(lora_run, f"model.init_from={base}", "lora.rank=4",
                                                          "train.max_steps=2", "resume=auto"),
             watch=[lora_run], says="its weight files differ",
             check=lambda: (not (lora_run / ".lock").exists(), "no .lock left")))
    add(Case("LoRA base edited in the middle: export --merge-lora",
             ["ckpt", "export", str(lora_run), str(tmp / "merged"), "--merge-lora"], watch=[lora_run],
             check=lambda: (not (tmp / "merged").exists(), "nothing exported")))


def add_round_four(add, tmp: Path, run: Path, tiny) -> None:
    """Round 4 (#35), imports and exports: outputs where videodit deletes, headers that ask for
    unbounded work, config values, sharded folders, two experts, init_from's architecture, advice."""
    import torch
    from safetensors.torch import load_file, save_file

    fixtures = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
    wan, os2 = fixtures / "wan" / "wan", fixtures / "opensora2" / "mmdit" / "Open_Sora_v2.safetensors"
    gone = lambda path: (lambda: (not path.exists(), "nothing written"))   # noqa: E731
    step = run / "checkpoints" / "step-0000002"
    add(Case("ckpt export into a checkpoint", ["ckpt", "export", str(run), str(step / "sub")], watch=[run],
             check=gone(step / "sub"), says="may be deleted"))
    add(Case("ckpt import into a run's checkpoints/", ["ckpt", "import", str(wan), str(run / "checkpoints" / "x")],
             watch=[run], check=gone(run / "checkpoints" / "x"), says="may be deleted"))
    add(Case("cache build inside a checkpoint", ["cache", "build", "tiny", f"data.csv={tmp / 'toy' / 'train.csv'}",
                                                 *TINY, "--out", str(step / "cache")], watch=[run],
             check=gone(step / "cache"), says="may be deleted"))

    def crafted(name: str, source: Path, tensors: dict | None = None, config: dict | None = None) -> Path:
        """A copy of released weights with ``tensors`` added to its (only) weights file and ``config``
        merged into its config.json."""
        target = tmp / name
        if source.is_dir():
            shutil.copytree(source, target)
        else:
            target.mkdir()
            shutil.copy(source, target)
        if tensors:
            file = next(target.glob("*.safetensors"))
            save_file({**load_file(str(file)), **tensors}, str(file))
        if config:
            (target / "config.json").write_text(json.dumps({**json.loads((target / "config.json").read_text()),
                                                            **config}))
        return target

    def refused(name: str, src: Path, *extra: str, says: str | None = None, timeout: float = 60) -> None:
        out = tmp / ("out-" + "".join(c if c.isalnum() else "-" for c in name))
        add(Case(name, ["ckpt", "import", str(src), str(out), *extra], watch=[src], check=gone(out), says=says,
                 timeout=timeout))

    huge = {"double_blocks.1000000000000.img_attn.proj.bias": torch.zeros(1)}
    refused("import: Open-Sora 2.0 double_blocks.10^12", crafted("os2-huge", os2, huge) / os2.name, says="unexpected")
    stdit = fixtures / "opensora" / "stdit3"
    ckpt_file = tmp / "stdit-huge.safetensors"
    save_file({**load_file(str(stdit / "model.safetensors")), "spatial_blocks.1000000000000.attn.proj.bias":
               torch.zeros(1)}, str(ckpt_file))
    refused("import: STDiT spatial_blocks.10^12", ckpt_file, says="STDiT3 of this config lacks")
    for key, value in (("eps", float("nan")), ("patch_size", [0, 0, 0]), ("freq_dim", 10**12), ("eps", "abc"),
                       ("text_len", 10**9), ("text_len", 0)):
        refused(f"import: Wan config.json {key}={value!r}", crafted(f"wan-{key}-{value}", wan, config={key: value}),
                says=f"{key}=")
    shards = crafted("wan-shards", wan)
    state = load_file(str(shards / "diffusion_pytorch_model.safetensors"))
    (shards / "diffusion_pytorch_model.safetensors").unlink()
    names = sorted(state)
    save_file({k: state[k] for k in names[:20]}, str(shards / "a.safetensors"))
    save_file({k: (torch.zeros_like(state[k]) if k == names[0] else state[k]) for k in names[20:] + names[:1]},
              str(shards / "b.safetensors"))   # the first tensor again, zeros: the later shard would win
    (shards / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "a.safetensors" if i < 20 else "b.safetensors" for i, k in enumerate(names)}}))
    refused("import: one tensor in two shards", shards, says="is in two shards")
    experts = tmp / "wan22-experts"
    for folder in ("high_noise_model", "low_noise_model"):
        shutil.copytree(wan, experts / folder)
    out = tmp / "wan22-imported"
    add(Case("import: Wan 2.2 two experts (as the two-expert folder)", ["ckpt", "import", str(experts), str(out)],
             expect=0, check=lambda: ((out / "low_noise_model" / "run_config.yaml").is_file() and "expert: low" in
                                      (out / "low_noise_model" / "run_config.yaml").read_text(), "one folder each")))
    add(Case("import: Wan with --config of Open-Sora 1.2", ["ckpt", "import", str(wan), str(tmp / "wan-tiny-cfg"),
                                                            "--config", "tiny"], says="pass a wan config"))
    add(Case("import: Wan records Wan's encoders", ["ckpt", "import", str(wan), str(tmp / "wan-encoders")], expect=0,
             check=lambda: ("kind: umt5" in (tmp / "wan-encoders" / "run_config.yaml").read_text(), "umT5")))
    refused("import: Open-Sora 2.0 img_in 1-D", crafted("os2-1d", os2, {"img_in.weight": torch.zeros(64)}) / os2.name,
            says="has shape [64]")
    refused("import: Open-Sora 2.0 cond_in narrower", crafted("os2-cond", os2, {"cond_in.weight": torch.zeros(64, 10)})
            / os2.name, says="fit no square patch")
    no_txt = tmp / "os2-no-txt" / os2.name
    no_txt.parent.mkdir()
    save_file({k: v for k, v in load_file(str(os2)).items() if k != "txt_in.weight"}, str(no_txt))
    refused("import: Open-Sora 2.0 without txt_in", no_txt, says="every Open-Sora 2.0 MMDiT has")
    head24 = tmp / "os2-head24" / os2.name   # an MMDiT trained at another size: heads of 24 channels
    head24.parent.mkdir()
    subprocess.run([sys.executable, "-c", "import sys; from safetensors.torch import save_file; from videodit.models."
                    "mmdit.model import MMDiT, MMDiTGeometry as G; save_file(MMDiT(G(hidden_size=48, num_heads=2, "
                    "depth=1, depth_single_blocks=1, latent_channels=4, vec_in_dim=8, context_in_dim=16, "
                    "axes_dim=(4, 10, 10))).state_dict(), sys.argv[1])", str(head24)],
                   cwd=Path(__file__).resolve().parents[1], check=True)
    refused("import: Open-Sora 2.0 heads of 24", head24, says="model.axes_dim=[frames,rows,columns]")
    add(Case("import: ... with the advice (model.axes_dim)", ["ckpt", "import", str(head24), str(tmp / "os2-24-out"),
                                                              "model.axes_dim=[4,10,10]"], expect=0))
    # a Wan run of 2 heads, and a run of 4 heads of the same shapes starting from it
    wan_run = tmp / "wan-run"
    wan_tiny = ["model.preset=wan-tiny", "model.patch_size=[1,2,2]", "diffusion.prediction=velocity"]
    made = videodit(*tiny(wan_run, *wan_tiny, "train.max_steps=1"))
    assert made.returncode == 0, made.stderr[-2000:]
    add(Case("init_from: 2 heads into a 4-head run", tiny(tmp / "wan-4heads", *wan_tiny, "model.num_heads=4",
                                                         f"model.init_from={wan_run}", "train.max_steps=1"),
             says="num_heads=2 there, 4 here", check=gone(tmp / "wan-4heads" / "checkpoints")))
    # two expert runs; the low one damaged: a refused pair export leaves nothing
    pair = {}
    for expert, edges in (("high", "[0.75,1.0]"), ("low", "[0.0,0.75]")):
        pair[expert] = tmp / f"wan-{expert}"
        made = videodit(*tiny(pair[expert], *wan_tiny, f"model.expert={expert}", "model.expert_boundary=0.75",
                              f"diffusion.timestep_range={edges}", "train.max_steps=1", "text.max_length=8"))
        assert made.returncode == 0, made.stderr[-2000:]
    weights = pair["low"] / "checkpoints" / "step-0000001" / "model.safetensors"
    damaged = bytearray(weights.read_bytes())
    damaged[-1] ^= 0xFF
    weights.write_bytes(bytes(damaged))
    add(Case("export: a pair whose low expert is damaged", ["ckpt", "export", str(pair["high"]),
                                                            str(tmp / "pair-new" / "out"), "--low-noise-ckpt",
                                                            str(pair["low"]), "--format", "wan"],
             check=gone(tmp / "pair-new"), says="does not match its SHA-256"))


def add_round_four_runtime(add, tmp: Path, toy: Path, run: Path) -> None:
    """Round 4 (#35), runtime: non-finite latents, work bounded beyond bytes, plans, empty caches
    (W&B's disks and servers need an environment per case: tests/train/test_wandb_hardening.py)."""
    clip = tmp / "cfg-huge.mp4"
    add(Case("sample --cfg 1e308 (no black clip)", ["sample", "--ckpt", str(run), "--prompt", "x", "--cfg", "1e308",
                                                    "--out", str(clip)], check=lambda: (not clip.exists(), "no clip")))
    from videodit.data.buckets.tables import RESOLUTION_NAMES

    big = tmp / "buckets-13mb.yaml"   # every resolution with 26,000 frame counts: under 16 MiB, work unbounded
    big.write_text("bucket_config:\n" + "".join(f"  {name!r}:\n" + "".join(f"    {n}: [0.5, 4]\n"
                                                                          for n in range(1, 26_001))
                                                for name in RESOLUTION_NAMES))
    add(Case("bucket config of 13 MB", ["config", "show", "tiny", f"data.bucket_config_file={big}"], timeout=60,
             says="data.bucket_config_file"))
    add(Case("plan: a tp training refuses", ["plan", "tiny", "--gpu-mem", "80GiB", "parallel.tp=3"],
             says="does not divide"))
    empty = tmp / "header-only.csv"
    empty.write_text((toy / "train.csv").read_text().splitlines()[0] + "\n")
    add(Case("cache build of 0 samples", ["cache", "build", "tiny", f"data.csv={empty}", "--out",
                                          str(tmp / "empty-cache")], check=lambda: (
        not (tmp / "empty-cache" / "manifest.json").exists(), "no cache")))


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
                  f"{row['peak MiB']:5.0f} MiB | {row['first line']}{' | ' + row['note'] if row['note'] else ''}",
                  flush=True)
    finally:
        subprocess.run(["umount", str(tmp / "readonly")], capture_output=True)
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"{failures} case(s) did not hold")
    return failures


if __name__ == "__main__":
    raise SystemExit(main())
