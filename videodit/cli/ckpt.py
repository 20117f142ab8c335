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


# ``ckpt export --format`` values besides videodit's own, and what loads each ({model}: the diffusers
# class config.json names).
EXPORT_LOADERS = {"opensora": "Open-Sora's STDiT3.from_pretrained", "wan": "Wan's WanModel.from_pretrained",
                  "diffusers": "diffusers' {model}.from_pretrained",
                  "comfyui": "ComfyUI's Load Diffusion Model node, from ComfyUI/models/diffusion_models/",
                  "opensora-v2": "Open-Sora 2.0's MMDiTModel with fused_qkv=False and use_liger_rope=True",
                  "ltx2": "ltx-core's LTX-2 model builder (the config in the file's metadata)"}


def export_loader(fmt: str, out: Path) -> str:
    """What loads an export in ``fmt`` at ``out`` (diffusers: the class its config.json names)."""
    if fmt != "diffusers":
        return EXPORT_LOADERS[fmt]
    model = "the transformer class config.json names"
    for config in (out / "config.json", out / "transformer" / "config.json"):
        if config.is_file():
            model = str(json.loads(config.read_text()).get("_class_name", model))
            break
    return EXPORT_LOADERS[fmt].format(model=model)


def cmd_ckpt_export(ns) -> int:
    from videodit.checkpoint import export, export_released

    if ns.extract_lora is not None:   # a LoRA extracted from a whole-weight run (checkpoint/lora_extract.py)
        return cmd_extract_lora(ns)
    if ns.min_params is not None:
        raise UserError("--min-params sets which weights --extract-lora factors: add --extract-lora RANK")
    if ns.lora_format is not None:   # the adapters alone: cli/ckpt_lora.py
        from videodit.cli.ckpt_lora import cmd_export_lora
        return cmd_export_lora(ns)
    if ns.format != "videodit":
        if ns.merge_lora:
            raise UserError("--merge-lora writes a videodit model folder: export it without --format, then export "
                            f"that folder with --format {ns.format}")
        if ns.low_noise_ckpt is not None:
            out = _export_experts(ns)
        else:
            out = export_released(ns.ckpt, ns.out, ns.format, use_ema=ns.ema, dtype=ns.dtype)
        print(f"exported to {out} ({export_loader(ns.format, Path(out))} loads it)")
    elif ns.low_noise_ckpt is not None:
        raise UserError("--low-noise-ckpt writes the two experts in a released layout: add --format wan or diffusers")
    else:
        out = export(ns.ckpt, ns.out, use_ema=ns.ema, dtype=ns.dtype, merge_lora=ns.merge_lora)
        print(f"exported to {out} (videodit sample --ckpt {out} loads it)")
    return 0


def cmd_extract_lora(ns) -> int:
    """``--extract-lora RANK``: student minus base, factored, in lightx2v's layout; what it took, how
    much of the change the rank holds, and a distilled run's sampling (also in OUT/SAMPLING.md)."""
    from videodit.checkpoint.lora_extract import MIN_PARAMS, SAMPLING_NOTE, extract_lora

    other = [flag for flag, given in (("--lora-format", ns.lora_format is not None), ("--merge-lora", ns.merge_lora),
                                      ("--format", ns.format != "videodit"),
                                      ("--low-noise-ckpt", ns.low_noise_ckpt is not None)) if given]
    if other:
        raise UserError(f"--extract-lora writes one LoRA file from one whole-weight run: leave out {other[0]}")
    done = extract_lora(ns.ckpt, ns.out, ns.extract_lora, MIN_PARAMS if ns.min_params is None else ns.min_params,
                        dtype=ns.dtype)
    ranks = sorted(set(done.ranks.values()))
    shown = f"rank {done.rank}" if ranks in ([done.rank], []) else \
        f"rank {done.rank}, capped at a weight's smaller side: {', '.join(map(str, ranks))}"
    print(f"extracted from the {done.weights} weights of {done.source} (step {done.step}) minus the base "
          f"{done.base} ({done.base_option}): {done.factored} weights as lora_up/lora_down ({shown}; "
          f"{100 * done.kept:.2f}% of their change, relative error {done.relative_error:.2e}), {done.whole} tensors "
          f"whole as .diff/.diff_b, {done.unchanged} unchanged left out")
    print(f"exported to {done.out / done.file} (copy it into ComfyUI/models/loras/ for LoraLoaderModelOnly at "
          "strength 1, on the base's weights)")
    if done.sampling is None:
        print("not a distilled run: no sampler note; sample as the base samples")
    else:
        print(f"sample it as distilled ({done.out / SAMPLING_NOTE}):\n{done.sampling.rstrip()}")
    return 0


def _export_experts(ns) -> Path:
    """A two-expert model from two expert runs, in the release's two-folder layout (Wan 2.2 A14B:
    high_noise_model/ + low_noise_model/, or diffusers' transformer/ + transformer_2/); a refusal
    of either expert leaves nothing."""
    from videodit.checkpoint import LoadedCheckpoint
    from videodit.checkpoint.convert import export_released_pair
    from videodit.checkpoint.tools import check_new_folder
    from videodit.config import from_yaml
    from videodit.models.families import get_spec
    from videodit.sample import expert_boundary

    check_new_folder(ns.out)
    runs = [LoadedCheckpoint(path) for path in (ns.ckpt, ns.low_noise_ckpt)]
    high_cfg, low_cfg = (from_yaml(run.config_yaml(), f"the config of {run.path}") for run in runs)
    expert_boundary(high_cfg, low_cfg, runs[0].path, runs[1].path)   # a pair trained together, or one line
    folders = get_spec(high_cfg.model.family).expert_folders.get(ns.format)
    if folders is None:
        raise UserError(f"the {high_cfg.model.family} family has no two-expert layout for --format {ns.format}")
    return export_released_pair((ns.ckpt, ns.low_noise_ckpt), ns.out, ns.format, folders, use_ema=ns.ema,
                                dtype=ns.dtype)


def cmd_ckpt_import(ns) -> int:
    """The config recorded with the weights is --config, or the family's recipe for them (a config
    of another family is refused); every check runs before anything is written."""
    from videodit.checkpoint.convert import import_hints, read_released, write_imported
    from videodit.checkpoint.tools import check_new_folder, export_dtype
    from videodit.config import load_config, to_yaml
    from videodit.models.families import released_spec

    export_dtype(ns.dtype)
    check_new_folder(ns.out, "import")
    spec = released_spec(ns.src)
    name = ns.config or spec and spec.released_config(None) or "opensora-v1.2-stage3"
    cfg = load_config(name, ns.overrides)
    if spec is not None and cfg.model.family != spec.family:
        raise UserError(f"--config {name} describes a {cfg.model.family} model, but {ns.src} holds "
                        f"{spec.released_name} weights ({spec.family}); pass a {spec.family} config (e.g. --config "
                        f"{spec.released_config(None)}) or leave --config out")
    released = read_released(ns.src, ns.ema, import_hints(cfg.model))
    if ns.config is None:   # the recipe of this release (its encoders, its sampling)
        name = spec.released_config(released.geometry, released.experts)
        if name is None:
            raise UserError(f"no recipe of videodit's fits the {spec.released_short} model in {ns.src}; pass the "
                            f"config to record with it: --config CONFIG (a {spec.family} config)")
        cfg = load_config(name, ns.overrides)
    out = write_imported(released, ns.out, to_yaml(cfg), use_ema=ns.ema, dtype=ns.dtype)
    if released.experts:
        high, low = (spec.expert_source(out, expert) for expert in ("high", "low"))
        print(f"imported two experts to {out} (videodit sample --ckpt {high} --low-noise-ckpt {low} samples them "
              f"with {name}'s encoders; model.init_from={out} with model.expert=high, low or both fine-tunes them)")
    else:
        print(f"imported to {out} (videodit sample --ckpt {out} samples with {name}'s encoders; "
              f"model.init_from={out} fine-tunes it)")
    return 0


def cmd_model_info(ns) -> int:
    import torch

    from videodit.components import model_geometry
    from videodit.config import MODEL_PRESETS, ModelConfig, load_config
    from videodit.models.families import get_spec
    from videodit.models.spec import count_parameters

    cfg = load_config(ns.config, [])
    print(f"{'preset':<17}{'family':<7}{'depth':>6}{'hidden':>8}{'heads':>7}  {'patch':<10}{'parameters':>15}")
    scopes = {}   # family -> what its counts cover, where a release counts otherwise
    for name, preset in MODEL_PRESETS.items():
        cfg.model = ModelConfig(preset=name).resolved()
        spec = get_spec(cfg.model.family)
        latent, caption, length = spec.released_encoders_of(cfg.model)   # what the release is built for
        cfg.text.max_length = ns.caption_length or length
        geometry = model_geometry(cfg, ns.latent_channels or latent, ns.caption_channels or caption)
        with torch.device("meta"):   # count without allocating weights
            count = count_parameters(spec.build(geometry))
        print(f"{name:<17}{cfg.model.family:<7}{preset['depth']:>6}{preset['hidden_size']:>8}{preset['num_heads']:>7}  "
              f"{str(tuple(preset['patch_size'])):<10}{count:>15,}")
        if spec.parameter_scope():
            scopes[cfg.model.family] = spec.parameter_scope()
    for family, scope in scopes.items():
        print(f"{family}: counts {scope}")
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
    q.add_argument("--low-noise-ckpt", metavar="CKPT", help="two experts (Wan 2.2 A14B): CKPT is the high-noise "
                   "expert's run, this the low-noise one's; written in the release's two-folder layout (with "
                   "--format wan: high_noise_model/ + low_noise_model/; diffusers: transformer/ + transformer_2/)")
    q.add_argument("--merge-lora", action="store_true", help="a LoRA run's checkpoint: write its base with the "
                   "adapters merged in (a whole model)")
    q.add_argument("--lora-format", choices=("diffusers", "comfyui", "peft"), help="a LoRA run's adapters alone, "
                   "for diffusers' load_lora_weights, ComfyUI's LoRA loaders or peft's PeftModel (Wan, LTX-2: "
                   "comfyui is LTX's own LoRA file; an STDiT run: peft); with --low-noise-ckpt, the two experts' "
                   "files (..._high_noise, ..._low_noise)")
    q.add_argument("--extract-lora", type=int, metavar="RANK", help="a whole-weight run (a distilled student, a "
                   "fine-tune) as a LoRA on its base (distill.teacher, else model.init_from): the EMA weights (else "
                   "the model's) minus the base, each large 2-D weight's difference factored by SVD to RANK "
                   "(lora_up/lora_down, no alpha), the rest whole (.diff/.diff_b), in lightx2v's layout for ComfyUI: "
                   "OUT/<OUT's name>.safetensors, and OUT/SAMPLING.md with a distilled run's sampler")
    q.add_argument("--min-params", type=int, metavar="N", help="with --extract-lora: the values from which a 2-D "
                   "weight is factored (default 1000000, lightx2v's); smaller ones travel whole as .diff")
    q.add_argument("--format", default="videodit", choices=("videodit", *EXPORT_LOADERS), help="opensora: an "
                   "STDiT3 folder Open-Sora 1.2 loads (for models with model.position_embedding=opensora); wan / "
                   "diffusers: a Wan model as Wan's WanModel / diffusers' WanTransformer3DModel load it; "
                   "comfyui: a Wan model as one OUT/<OUT's name>.safetensors, Wan's names, for ComfyUI's Load "
                   "Diffusion Model; opensora-v2: an MMDiT as OUT/Open_Sora_v2.safetensors, Open-Sora 2.0's names "
                   "and RoPE layout; ltx2: an LTX-2 model as one OUT/<OUT's name>.safetensors in the release's "
                   "layout (model.diffusion_model.*, its config in the metadata) for ltx-core, with comfyui the "
                   "same file alone, diffusers an LTX2VideoTransformer3DModel folder")
    q.set_defaults(func=cmd_ckpt_export)
    q = ksub.add_parser("import", help="convert released weights (Open-Sora 1.2 STDiT3: its folder, a training "
                        "checkpoint or its ema.pt; Wan 2.1/2.2: its folder or a diffusers one, a two-expert one "
                        "becoming one folder per expert; Open-Sora 2.0: Open_Sora_v2.safetensors or a training "
                        "checkpoint; LTX-2: the release .safetensors or a diffusers transformer folder) into a "
                        "videodit model folder")
    q.add_argument("src")
    q.add_argument("out")
    q.add_argument("--ema", action="store_true", help="a training checkpoint's EMA weights (ema.pt)")
    q.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    q.add_argument("--config", help="config recorded with the weights: its encoders (vae.path, text.path) and "
                   "sample.* are what `videodit sample` uses (default: the recipe of the release: Open-Sora 1.2: "
                   "opensora-v1.2-stage3; Wan: wan2.1-t2v-1.3b-finetune, wan2.1-t2v-14b-lora, "
                   "wan2.1-i2v-14b-lora, wan2.2-ti2v-5b-finetune or, for two experts, wan2.2-t2v-a14b-lora; "
                   "Open-Sora 2.0: opensora-v2-stage1 or opensora-v2-hc; encoders in pretrained/ or ckpts/)")
    q.add_argument("overrides", nargs="*", metavar="key=value", help="overrides of --config, e.g. vae.path=DIR")
    q.set_defaults(func=cmd_ckpt_import)

    p = sub.add_parser("model", help="model presets")
    msub = p.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    q = msub.add_parser("info", help="print every preset's geometry and parameter count")
    q.add_argument("--config", default="tiny", help="config whose other model keys apply")
    q.add_argument("--latent-channels", type=int, help="VAE latent channels (default: the family's released "
                   "VAE: Open-Sora 1.2 4, Wan 2.1 16)")
    q.add_argument("--caption-channels", type=int, help="text embedding width (default: T5-XXL / umT5-XXL, 4096)")
    q.add_argument("--caption-length", type=int, help="caption tokens (default: Open-Sora 1.2 300, Wan 512)")
    q.set_defaults(func=cmd_model_info)
