"""``videodit train`` and ``videodit sample``."""

from __future__ import annotations

import argparse
import math
import signal
import sys
import time
from pathlib import Path

from videodit.cli.args import first_line, out_of_memory, split_config_args
from videodit.errors import UserError, os_error_message
from videodit.user_files import read_user_text


def cmd_train(ns) -> int:
    from videodit.config import load_config
    from videodit.parallel.distributed import launched_world_size
    from videodit.train.trainer import Trainer

    config, overrides = split_config_args(ns.args)
    cfg = load_config(config, overrides)
    if ns.out:
        run_dir = Path(ns.out)
    elif launched_world_size() > 1:   # clocks differ: ranks would pick different folders
        raise UserError("under torchrun pass --out DIR, so that every rank writes the same run folder")
    else:
        run_dir = Path("runs") / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    trainer = Trainer(cfg, run_dir)
    ctx = trainer.ctx
    try:
        say = print if trainer.is_main else (lambda *a, **k: None)
        say(f"run folder: {run_dir}  |  model: {cfg.model.preset}, {trainer.num_params:,} parameters  |  "
            f"data: {len(trainer.meta)} clips, device: {trainer.device}  |  {trainer.ctx.dims.describe()}, "
            f"global batch {cfg.train.batch_size} x {trainer.ctx.dp_size} rank(s) x {cfg.train.grad_accum}",
            flush=True)
        if trainer.meta.read_report is not None:
            say(trainer.meta.read_report.describe(), flush=True)
        if trainer.meta.bad_rows:
            kind = "CSV " if trainer.meta.unit == "line" else ""
            say(f"skipped {len(trainer.meta.bad_rows)} bad {kind}row(s), first: {trainer.meta.unit} "
                f"{trainer.meta.bad_rows[0][0]}: {trainer.meta.bad_rows[0][1]}", flush=True)
        result = trainer.fit()
        say(f"done: step {result['step']}, loss {result.get('loss', float('nan')):.4f}; samples in "
            f"{run_dir / 'samples'}, checkpoints in {run_dir / 'checkpoints'}", flush=True)
    finally:
        del trainer   # see DistContext.close
        ctx.close()
    return 0


def cmd_sample(ns) -> int:
    from videodit.data.video_write import write_video
    from videodit.sample import Pipeline

    prompts = _read_prompts(ns)
    out = Path(ns.out)
    one_file = len(prompts) == 1 and out.suffix in (".mp4", ".gif")
    if not one_file and out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a folder for {len(prompts)} prompt(s) (or a .mp4/.gif file "
                        "for one prompt)")
    pipeline = Pipeline(ns.ckpt, device=ns.device, low_noise=ns.low_noise_ckpt, audio=not ns.no_audio)
    size = pipeline.resolve(num_frames=ns.num_frames, height=ns.height, width=ns.width)
    if not ns.gif and out.suffix != ".gif" and (size["height"] % 2 or size["width"] % 2):
        raise UserError(f"mp4 needs an even height and width, got {size['height']}x{size['width']}; pass even "
                        "--height/--width, or --gif")
    options = dict(**size, steps=ns.steps, guidance=ns.cfg, seed=ns.seed, reference=ns.ref,
                   reference_frames=ns.ref_frames, ref_mode=ns.ref_mode, reference_end=ns.ref_end,
                   image_guidance=ns.image_cfg)
    if pipeline.soundtrack is not None:   # a run that trained its audio stream: each clip with its soundtrack
        if ns.gif or out.suffix == ".gif":
            raise UserError("a gif cannot hold this model's soundtrack; write mp4, or pass --no-audio with --gif")
        options["audio"] = True   # recorded: a resumed folder keeps clips sampled with sound only
    fps = pipeline.cfg.sample.fps
    try:
        if one_file:
            for _, clips, *sounds in pipeline.batches(prompts, **_batch_options(options)):
                write_video(out, clips[0], fps, audio=sounds[0][0] if sounds else None)
                print(out, flush=True)
            return 0
        _sample_into_folder(pipeline, prompts, out, options, fps, ".gif" if ns.gif else ".mp4", ns.low_noise_ckpt)
    except (MemoryError, RuntimeError) as exc:   # CUDA's OutOfMemoryError is a RuntimeError
        if not out_of_memory(exc):
            raise
        raise UserError(f"sampling clip(s) of {size['num_frames']} frames at {size['height']}x"
                        f"{size['width']} needs more memory than {pipeline.device} has ({first_line(exc)}); lower "
                        "--num-frames, --height or --width") from None
    return 0


SAMPLE_RECORD = ".videodit-sample.json"   # in a --out folder: the settings its clips were sampled with


def _sample_into_folder(pipeline, prompts: list[str], out: Path, options: dict, fps: float, suffix: str,
                        low_noise: str | None) -> None:
    """Each clip written as soon as it is made (``NN-prompt.mp4``), with a progress bar; clips
    already in ``out`` (a run that was stopped, sampled with the same settings) are kept, not made
    again. Prompt k's noise depends on (seed, k) alone, so a resumed folder equals one run."""
    import json

    from tqdm import tqdm

    from videodit.data.video_write import write_video
    from videodit.sample import clip_name
    from videodit.train.run_folder import replace_file

    names = [clip_name(k, len(prompts), prompt, suffix) for k, prompt in enumerate(prompts)]
    settings = {"checkpoint": str(Path(pipeline.checkpoint).resolve()), "weights": pipeline.weights,
                "low_noise": _resolved(low_noise),
                **{key: value for key, value in options.items() if key not in ("reference", "reference_end")},
                "reference": _resolved(options["reference"]), "reference_end": _resolved(options["reference_end"]),
                "format": suffix}
    record = out / SAMPLE_RECORD
    if record.exists():
        try:
            before = json.loads(read_user_text(record, max_bytes=1 << 20))
        except (OSError, ValueError):
            before = None
        if not isinstance(before, dict):
            raise UserError(f"{record} is damaged; delete it (clips in {out} are then kept as they are) or pick "
                            "another --out")
        changed = [key for key in sorted(set(before) | set(settings)) if before.get(key) != settings.get(key)]
        if changed:
            key = changed[0]
            raise UserError(f"--out {out} holds clips sampled with other settings ({key}: {before.get(key)!r} "
                            f"there, {settings.get(key)!r} now); pick another --out, or delete {out} to sample again")
    todo = [k for k, name in enumerate(names) if not (out / name).is_file()]
    if len(todo) < len(prompts):
        print(f"{out}: {len(prompts) - len(todo)} of {len(prompts)} clips are there already (kept); sampling the "
              f"other {len(todo)}", file=sys.stderr, flush=True)
    if not todo:
        return
    out.mkdir(parents=True, exist_ok=True)
    replace_file(record, json.dumps(settings, indent=1))
    bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc="sample", unit="clip", dynamic_ncols=True,
               disable=None, file=sys.stderr)
    before = signal.signal(signal.SIGTERM, _stop_on_sigterm)   # a stop removes the clip being written
    try:
        for indices, clips, *sounds in pipeline.batches(prompts, **_batch_options(options), indices=todo):
            for i, (k, clip) in enumerate(zip(indices, clips)):
                # whole or not at all: a stop leaves no half clip
                write_video(out / names[k], clip, fps, audio=sounds[0][i] if sounds else None)
                bar.write(str(out / names[k]), file=sys.stdout)
                bar.update(1)
    finally:
        signal.signal(signal.SIGTERM, before)
        bar.close()


def _batch_options(options: dict) -> dict:
    return {key: value for key, value in options.items() if key != "audio"}


def _stop_on_sigterm(signum, frame) -> None:
    """SIGTERM as Ctrl-C: unwinds (a half-written clip's temporary file is removed), exit 143."""
    stop = KeyboardInterrupt()
    stop.exit_status = 128 + signum
    raise stop


def _resolved(path: str | None) -> str | None:
    return None if path is None else str(Path(path).resolve())


def _read_prompts(ns) -> list[str]:
    if ns.prompt is not None:
        return [ns.prompt]
    path = Path(ns.prompts)
    if not path.exists():
        raise UserError(f"prompt file {ns.prompts!r} does not exist; pass --prompts FILE with one prompt a line")
    try:
        text = read_user_text(path, max_bytes=64 << 20)
    except OSError as exc:
        raise UserError(f"prompt file: {os_error_message(exc)}") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"prompt file {ns.prompts!r} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise UserError(f"prompt file {ns.prompts!r} holds no prompts; write one prompt a line")
    return prompts


def _bounded(kind: str, limit: str, low: float = 1):
    """An argparse type: a whole number (``kind="int"``) or a finite number from ``low`` to
    ``videodit.sample.<limit>``, the bounds ``Pipeline.batches`` checks too."""
    def parse(text: str):
        import videodit.sample as sample
        high = getattr(sample, limit)
        try:
            value = int(text) if kind == "int" else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {'whole number' if kind == 'int' else 'number'}") \
                from None
        if not (math.isfinite(value) and low <= value <= high):
            raise argparse.ArgumentTypeError(f"{text} is out of range: give {low:g} to {high:g}")
        return value
    return parse


def _seed(text: str) -> int:
    """A 64-bit seed: larger ones would give the noise of another seed (it is taken modulo 2^64)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not -(2**63) <= value < 2**64:
        raise argparse.ArgumentTypeError(f"{text} is out of range: give a 64-bit seed, 0 to 2^64 - 1")
    return value


def register(sub) -> None:
    p = sub.add_parser("train", help="train a model", description="Train. CONFIG is a YAML file or a preset "
                       "name (default: tiny, on the toy dataset); key.sub=value overrides follow it. "
                       "'videodit config keys' lists every key.")
    p.add_argument("args", nargs="*", metavar="[CONFIG] [key=value ...]")
    p.add_argument("--out", help="run folder (default: runs/NAME-TIMESTAMP)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("sample", help="sample videos from a checkpoint", description="Sample videos.")
    p.add_argument("--ckpt", required=True, help="run folder (newest checkpoint) or checkpoint folder")
    p.add_argument("--low-noise-ckpt", metavar="CKPT", help="two experts (Wan 2.2 A14B): --ckpt is the high-noise "
                   "expert's run, this the low-noise one's; they switch where their diffusion.timestep_range "
                   "meet, each guided by its own sample.cfg (unless --cfg)")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", help="one prompt")
    group.add_argument("--prompts", help="file with one prompt a line")
    p.add_argument("--num-frames", type=_bounded("int", "MAX_FRAMES"),
                   help="frames, 1 to 1024 (default: the training config's)")
    p.add_argument("--height", type=_bounded("int", "MAX_SIDE"),
                   help="height in pixels, 1 to 8192 (default: the training config's)")
    p.add_argument("--width", type=_bounded("int", "MAX_SIDE"),
                   help="width in pixels, 1 to 8192 (default: the training config's)")
    p.add_argument("--steps", type=_bounded("int", "MAX_STEPS"), help="sampling steps, 1 to 1000 (default: sample.steps)")
    p.add_argument("--cfg", type=_bounded("float", "MAX_GUIDANCE", 0),
                   help="classifier-free guidance scale, 0 to 100, 1 = none (default: sample.cfg)")
    p.add_argument("--seed", type=_seed, default=0, help="noise seed (prompt k starts from the noise of (seed, k))")
    p.add_argument("--ref", metavar="IMAGE_OR_CLIP", help="frames that open every clip: an image (image-to-video) "
                   "or a video (continuation); needs a model trained with diffusion.mask_ratios or Open-Sora 1.2's")
    p.add_argument("--ref-frames", type=_bounded("int", "MAX_FRAMES"), help="frames of --ref to use (default: all of an image, the "
                   "first half of the clip's frames of a video)")
    p.add_argument("--ref-mode", choices=("i2v_head", "i2v_tail", "i2v_loop", "v2v_head", "v2v_tail", "v2v_head_easy",
                                          "v2v_tail_easy"),
                   help="Open-Sora 2.0 models: what --ref gives (default: sample.ref_mode): its first frame opens the "
                        "clip (i2v_head), its last ends it (i2v_tail), both (i2v_loop), its first / last 32 frames, "
                        "33 with a causal VAE (v2v_head / v2v_tail), 64 / 65 (the _easy modes)")
    p.add_argument("--ref-end", metavar="IMAGE_OR_CLIP", help="--ref-mode i2v_loop: the file whose last frame ends "
                   "the clip (default: --ref's last frame)")
    p.add_argument("--image-cfg", type=_bounded("float", "MAX_GUIDANCE", 0), help="Open-Sora 2.0 models: the image "
                   "scale of the three-way guidance, 0 to 100 (default: sample.image_cfg)")
    p.add_argument("--out", default="samples", help="output folder, or a .mp4/.gif file for one prompt. A folder "
                   "gets each clip as it is made (NN-prompt.mp4) and resumes: clips already there, sampled with the "
                   "same settings, are kept")
    p.add_argument("--gif", action="store_true", help="write gif instead of mp4")
    p.add_argument("--no-audio", action="store_true", help="a model whose run trained its audio stream "
                   "(model.train_audio): write the video alone (default: each mp4 with its generated soundtrack)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.set_defaults(func=cmd_sample)
