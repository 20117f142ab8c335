"""``videodit train`` and ``videodit sample``."""

from __future__ import annotations

import time
from pathlib import Path

from videodit.cli.args import first_line, guidance, out_of_memory, positive_int, split_config_args
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
    from videodit.sample import Pipeline, write_clips
    from videodit.data.video_write import write_video

    prompts = _read_prompts(ns)
    out = Path(ns.out)
    pipeline = Pipeline(ns.ckpt, device=ns.device, low_noise=ns.low_noise_ckpt)
    size = pipeline.resolve(num_frames=ns.num_frames, height=ns.height, width=ns.width)
    if not ns.gif and out.suffix != ".gif" and (size["height"] % 2 or size["width"] % 2):
        raise UserError(f"mp4 needs an even height and width, got {size['height']}x{size['width']}; pass even "
                        "--height/--width, or --gif")
    try:
        clips = pipeline(prompts, **size, steps=ns.steps, guidance=ns.cfg, seed=ns.seed, reference=ns.ref,
                         reference_frames=ns.ref_frames, ref_mode=ns.ref_mode, reference_end=ns.ref_end,
                         image_guidance=ns.image_cfg)
    except (MemoryError, RuntimeError) as exc:   # CUDA's OutOfMemoryError is a RuntimeError
        if not out_of_memory(exc):
            raise
        raise UserError(f"sampling {len(prompts)} clip(s) of {size['num_frames']} frames at {size['height']}x"
                        f"{size['width']} needs more memory than {pipeline.device} has ({first_line(exc)}); lower "
                        "--num-frames, --height or --width") from None
    fps = pipeline.cfg.sample.fps
    if len(prompts) == 1 and out.suffix in (".mp4", ".gif"):
        write_video(out, clips[0], fps)
        paths = [out]
    else:
        paths = write_clips(out, prompts, clips, fps, ".gif" if ns.gif else ".mp4")
    for path in paths:
        print(path)
    return 0


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
    p.add_argument("--num-frames", type=positive_int, help="frames (default: the training config's)")
    p.add_argument("--height", type=positive_int, help="height in pixels (default: the training config's)")
    p.add_argument("--width", type=positive_int, help="width in pixels (default: the training config's)")
    p.add_argument("--steps", type=positive_int, help="Euler steps (default: sample.steps)")
    p.add_argument("--cfg", type=guidance, help="classifier-free guidance scale, >= 0 (default: sample.cfg)")
    p.add_argument("--seed", type=int, default=0, help="noise seed")
    p.add_argument("--ref", metavar="IMAGE_OR_CLIP", help="frames that open every clip: an image (image-to-video) "
                   "or a video (continuation); needs a model trained with diffusion.mask_ratios or Open-Sora 1.2's")
    p.add_argument("--ref-frames", type=positive_int, help="frames of --ref to use (default: all of an image, the "
                   "first half of the clip's frames of a video)")
    p.add_argument("--ref-mode", choices=("i2v_head", "i2v_tail", "i2v_loop", "v2v_head", "v2v_tail", "v2v_head_easy",
                                          "v2v_tail_easy"),
                   help="Open-Sora 2.0 models: what --ref gives (default: sample.ref_mode): its first frame opens the "
                        "clip (i2v_head), its last ends it (i2v_tail), both (i2v_loop), its first / last 32 frames, "
                        "33 with a causal VAE (v2v_head / v2v_tail), 64 / 65 (the _easy modes)")
    p.add_argument("--ref-end", metavar="IMAGE_OR_CLIP", help="--ref-mode i2v_loop: the file whose last frame ends "
                   "the clip (default: --ref's last frame)")
    p.add_argument("--image-cfg", type=guidance, help="Open-Sora 2.0 models: the image scale of the three-way "
                   "guidance, >= 0 (default: sample.image_cfg)")
    p.add_argument("--out", default="samples", help="output folder, or a .mp4/.gif file for one prompt")
    p.add_argument("--gif", action="store_true", help="write gif instead of mp4")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.set_defaults(func=cmd_sample)
