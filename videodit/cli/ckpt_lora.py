"""``videodit ckpt export RUN OUT --lora-format diffusers|comfyui|peft``: a LoRA run's adapters
alone, for the tool that loads them (``checkpoint/lora_export.py`` writes them)."""

from __future__ import annotations

from videodit.errors import UserError

# What loads each --lora-format, in the line printed after an export.
LORA_LOADERS = {"diffusers": "diffusers' pipeline of the family (WanPipeline, LTX2Pipeline).load_lora_weights(OUT) "
                             "loads it",
                "comfyui": "copy the .safetensors into ComfyUI/models/loras/ for LoraLoaderModelOnly",
                "peft": "peft's PeftModel.from_pretrained(videodit model, OUT) loads it"}


def cmd_export_lora(ns) -> int:
    from videodit.checkpoint.lora_export import export_lora

    if ns.merge_lora:
        raise UserError("--lora-format writes the adapters alone and --merge-lora a whole model: pass one of them")
    if ns.format != "videodit":
        raise UserError(f"--lora-format writes the adapters alone and --format {ns.format} a whole model: pass one "
                        "of them (a LoRA run's whole model: --merge-lora first, then --format on that folder)")
    ckpts = [ns.ckpt]
    if ns.low_noise_ckpt is not None:
        _check_pair(ns.ckpt, ns.low_noise_ckpt)
        ckpts.append(ns.low_noise_ckpt)
    out = export_lora(ckpts, ns.out, ns.lora_format, use_ema=ns.ema, dtype=ns.dtype)
    print(f"exported to {out} ({LORA_LOADERS[ns.lora_format]})")
    return 0


def _check_pair(high: str, low: str) -> None:
    """Two expert runs trained together (the high-noise one first), or one line."""
    from videodit.checkpoint import LoadedCheckpoint
    from videodit.config import from_yaml
    from videodit.sample import expert_boundary

    runs = [LoadedCheckpoint(path) for path in (high, low)]
    configs = [from_yaml(run.config_yaml(), f"the config of {run.path}") for run in runs]
    expert_boundary(*configs, runs[0].path, runs[1].path)
