"""Print docs/ltx2.md's "Memory with audio" table: LTX-2.3 22B planned by `videodit plan` with its
audio stream off (the recipes) and on (``model.train_audio=true``).

    python scripts/ltx2_audio_plan_table.py

Rows: the LoRA recipe (ltx2.3-22b-lora, rank 32, 1 GPU) and the full fine-tune (ltx2.3-22b-finetune,
8 GPUs, FSDP2 over 8), each at the recipes' bucket (960x544 x 49: 3,570 video tokens) and at 768x512 x
121 (6,144 video tokens, 5 s at 24 fps), bf16, every block checkpointed, features cached
(``--encoders-cached``: no encoder on the GPU; on the fly the audio VAE's ~53M weights add 0.2 GiB in
fp32). With audio the clip's soundtrack adds its tokens (``LTX2Spec.audio_tokens``: 25 a second at
sample.fps=24, as training encodes them), every weight trains (the audio stream and the cross-modal
attentions, frozen without it) and the audio stream's activations count; the LoRA recipe keeps its
video-stream targets (its base is frozen either way). Each row: the audio tokens a clip, the model
TFLOP of one sample's step as the plan's table prints it, the batch-1 peak per GPU with its parts,
and the largest batch on 80 GiB (10% margin) with the peak the plan prints at it. Under the table,
the step FLOPs ratio audio on / off (model and hardware FLOPs) per row, and the commands.
Offline: nothing is loaded but the config.
"""

from __future__ import annotations

import shlex

from videodit.config import load_config
from videodit.planner.plan import planner_from_config

GIB = 2**30
GPU = 80
RECIPES = [("LoRA rank 32, 1 GPU", "ltx2.3-22b-lora", 1), ("full fine-tune, 8 GPUs (FSDP2)", "ltx2.3-22b-finetune", 8)]
SHAPES = [(49, 544, 960), (121, 512, 768)]
AUDIO = ["model.train_audio=true", "audio.kind=ltx2", "audio.path=pretrained/LTX-2.3/ltx-2.3-22b-dev.safetensors"]


def overrides(shape: tuple[int, int, int], audio: bool) -> list[str]:
    frames, height, width = shape
    sized = [] if shape == SHAPES[0] else [f"data.num_frames={frames}", f"data.height={height}", f"data.width={width}"]
    return sized + (AUDIO if audio else [])


def command(recipe: str, gpus: int, settings: list[str]) -> str:
    return shlex.join(["videodit", "plan", recipe, *settings, "--gpu-mem", f"{GPU}GiB", "--encoders-cached"]
                      + (["--world-size", str(gpus)] if gpus > 1 else []))


def row(recipe: str, gpus: int, shape: tuple[int, int, int], audio: bool):
    planner = planner_from_config(load_config(recipe, overrides(shape, audio)), GPU * GIB, world_size=gpus,
                                  encoder_bytes=0)
    one = planner.estimate(1, *shape)
    best = planner.max_batch(*shape)
    at_best = planner.estimate(max(best, 1), *shape).peak
    state = one.params + one.grads + one.optimizer + one.ema + one.ddp_buckets
    return planner.audio_tokens(shape[0]), planner.flops_per_sample(*shape), one, state, best, at_best


def main() -> None:
    print(f"| recipe | clip | audio | audio tokens | TFLOP/sample | batch-1 peak GiB (state + activations + "
          f"transients) | max batch on {GPU} GiB (peak GiB) |")
    print("|---|---|---|---:|---:|---|---|")
    ratios, commands = [], []
    for label, recipe, gpus in RECIPES:
        for shape in SHAPES:
            flops = []
            for audio in (False, True):
                tokens, step, one, state, best, at_best = row(recipe, gpus, shape, audio)
                flops.append(step)
                print(f"| {label} | {shape[2]}x{shape[1]} x {shape[0]} | {'on' if audio else 'off'} | {tokens} | "
                      f"{step.model / 1e12:.0f} | {one.peak / GIB:.1f} ({state / GIB:.1f} + "
                      f"{one.activations / GIB:.1f} + {one.temporaries / GIB:.1f}) | "
                      f"{best} ({at_best / GIB:.1f}) |")
                commands.append(command(recipe, gpus, overrides(shape, audio)))
            ratios.append(f"{label}, {shape[2]}x{shape[1]} x {shape[0]}: model {flops[1].model / flops[0].model:.3f}, "
                          f"hardware {flops[1].hardware / flops[0].hardware:.3f}")
    print("\nstep FLOPs, audio on / off:\n" + "\n".join(f"    {r}" for r in ratios))
    print("\nthe rows' commands:\n" + "\n".join(f"    {c}" for c in commands))


if __name__ == "__main__":
    main()
