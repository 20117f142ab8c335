"""``videodit ckpt`` (list, inspect, export, import) and ``videodit model info``."""

from __future__ import annotations

import json
from pathlib import Path

from videodit.errors import UserError


def cmd_ckpt_list(ns) -> int:
    from videodit.checkpoint import format_list, list_run

    run = Path(ns.run)
    if not run.is_dir():
        raise UserError(f"run folder {ns.run!r} does not exist")
    rows = list_run(run)
    print(json.dumps(rows, default=str) if ns.json else format_list(rows))
    return 0


def cmd_ckpt_inspect(ns) -> int:
    from videodit.checkpoint import format_inspect, inspect

    info = inspect(ns.ckpt)
    print(json.dumps(info, default=str) if ns.json else format_inspect(info))
    return 0


def cmd_ckpt_export(ns) -> int:
    from videodit.checkpoint import export, export_opensora

    if ns.format == "opensora":
        if ns.merge_lora:
            raise UserError("--merge-lora writes a videodit model folder: export it without --format, then export "
                            "that folder with --format opensora")
        out = export_opensora(ns.ckpt, ns.out, use_ema=ns.ema, dtype=ns.dtype)
        print(f"exported to {out} (Open-Sora's STDiT3.from_pretrained loads it)")
    else:
        out = export(ns.ckpt, ns.out, use_ema=ns.ema, dtype=ns.dtype, merge_lora=ns.merge_lora)
        print(f"exported to {out} (videodit sample --ckpt {out} loads it)")
    return 0


def cmd_ckpt_import(ns) -> int:
    from videodit.checkpoint import import_opensora

    from videodit.config import load_config, to_yaml

    run_config = to_yaml(load_config(ns.config, ns.overrides))   # checked before anything is written
    out = import_opensora(ns.src, ns.out, run_config, use_ema=ns.ema, dtype=ns.dtype)
    print(f"imported to {out} (videodit sample --ckpt {out} samples with {ns.config}'s encoders; "
          f"model.init_from={out} fine-tunes it)")
    return 0


def cmd_model_info(ns) -> int:
    import torch

    from videodit.components import model_geometry
    from videodit.config import MODEL_PRESETS, ModelConfig, load_config
    from videodit.models.stdit import STDiT, count_parameters

    cfg = load_config(ns.config, [])
    cfg.text.max_length = ns.caption_length
    print(f"{'preset':<14}{'depth':>6}{'hidden':>8}{'heads':>7}  {'patch':<10}{'parameters':>15}")
    for name, preset in MODEL_PRESETS.items():
        cfg.model = ModelConfig(preset=name).resolved()
        geometry = model_geometry(cfg, ns.latent_channels, ns.caption_channels)
        with torch.device("meta"):   # count without allocating weights
            count = count_parameters(STDiT(geometry))
        print(f"{name:<14}{preset['depth']:>6}{preset['hidden_size']:>8}{preset['num_heads']:>7}  "
              f"{str(tuple(preset['patch_size'])):<10}{count:>15,}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("ckpt", help="list, inspect, export and import checkpoints")
    ksub = p.add_subparsers(dest="ckpt_command", required=True, metavar="ACTION")
    q = ksub.add_parser("list", help="a run's checkpoints: step, time, metrics, size, best/resumed marks")
    q.add_argument("run")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_ckpt_list)
    q = ksub.add_parser("inspect", help="a checkpoint's manifest, state and tensors")
    q.add_argument("ckpt")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_ckpt_inspect)
    q = ksub.add_parser("export", help="write model weights + config.json for sampling or sharing")
    q.add_argument("ckpt")
    q.add_argument("out")
    q.add_argument("--ema", action="store_true", help="export the EMA weights")
    q.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    q.add_argument("--merge-lora", action="store_true", help="a LoRA run's checkpoint: write its base with the "
                   "adapters merged in (a whole model)")
    q.add_argument("--format", default="videodit", choices=("videodit", "opensora"), help="opensora: an STDiT3 "
                   "folder Open-Sora 1.2 loads (for models with model.position_embedding=opensora)")
    q.set_defaults(func=cmd_ckpt_export)
    q = ksub.add_parser("import", help="convert Open-Sora 1.2 STDiT3 weights (its folder, or a training checkpoint "
                        "or its ema.pt) into a videodit model folder")
    q.add_argument("src")
    q.add_argument("out")
    q.add_argument("--ema", action="store_true", help="a training checkpoint's EMA weights (ema.pt)")
    q.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    q.add_argument("--config", default="opensora-v1.2-stage3", help="config recorded with the weights: its "
                   "encoders (vae.path, text.path) and sample.* are what `videodit sample` uses (default: "
                   "opensora-v1.2-stage3, encoders in pretrained/)")
    q.add_argument("overrides", nargs="*", metavar="key=value", help="overrides of --config, e.g. vae.path=DIR")
    q.set_defaults(func=cmd_ckpt_import)

    p = sub.add_parser("model", help="model presets")
    msub = p.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    q = msub.add_parser("info", help="print every preset's geometry and parameter count")
    q.add_argument("--config", default="tiny", help="config whose other model keys apply")
    q.add_argument("--latent-channels", type=int, default=4, help="VAE latent channels (Open-Sora: 4)")
    q.add_argument("--caption-channels", type=int, default=4096, help="text embedding width (T5-XXL: 4096)")
    q.add_argument("--caption-length", type=int, default=300, help="caption tokens (Open-Sora: 300)")
    q.set_defaults(func=cmd_model_info)
