"""``videodit plan``, ``videodit tune`` and ``videodit config``."""

from __future__ import annotations

import functools

from videodit.cli.args import split_config_args
from videodit.errors import UserError

MAX_WORLD_SIZE = 1_000_000   # GPUs in one job


def cmd_config_show(ns) -> int:
    from videodit.config import load_config, to_yaml
    from videodit.data.buckets.config import parse_bucket_config, resolve_bucket_config

    config, overrides = split_config_args(ns.args)
    cfg = load_config(config, overrides)
    # load_config leaves data.bucket_config to the data package; check it before printing.
    bucket_config = resolve_bucket_config(cfg.data)
    if bucket_config is not None:
        parse_bucket_config(bucket_config)
    print(to_yaml(cfg), end="")
    return 0


def cmd_config_keys(ns) -> int:
    from videodit.config import describe

    rows = describe()
    width = max(len(key) for key, _, _ in rows)
    for key, type_name, help_text in rows:
        print(f"{key:<{width}}  {help_text}  [{type_name}]")
    return 0


def _planner(ns, cfg):
    from videodit.planner.plan import LatentGeometry, planner_from_config
    from videodit.planner.report import parse_bytes

    gpu = parse_bytes(ns.gpu_mem)
    if ns.world_size is not None and not 1 <= ns.world_size <= MAX_WORLD_SIZE:
        raise UserError(f"--world-size {ns.world_size} is out of range; give 1 to {MAX_WORLD_SIZE:,} GPUs")
    latent = LatentGeometry.parse(ns.latent) if ns.latent else None
    caption = None
    if ns.caption:
        try:
            channels, length = (int(v) for v in ns.caption.split(","))
        except ValueError:
            raise UserError(f"--caption {ns.caption!r} must be two integers CHANNELS,LENGTH, e.g. 4096,300") from None
        caption = (channels, length)
    encoder_bytes = 0 if ns.encoders_cached else (parse_bytes(ns.encoder_mem) if ns.encoder_mem else None)
    if not 0 <= ns.margin < 1:
        raise UserError(f"--margin {ns.margin} must be in [0, 1), e.g. 0.1 for 10% of the GPU kept free")
    return planner_from_config(cfg, gpu, world_size=ns.world_size, margin=ns.margin, latent=latent, caption=caption,
                               encoder_bytes=encoder_bytes), gpu


def cmd_plan(ns) -> int:
    from videodit.config import load_config
    from videodit.planner.advice import advise
    from videodit.planner.plan import bucket_rows, plan_buckets, written_bucket_config
    from videodit.planner.report import advice_text, plan_json, plan_summary, plan_table, write_bucket_config

    config, overrides = split_config_args(ns.args)
    cfg = load_config(config, overrides)
    planner, gpu = _planner(ns, cfg)
    plans = plan_buckets(planner, bucket_rows(cfg), equal_step_time=ns.equal_step_time)
    advice = advise(planner, plans)   # what fits on these GPUs, then on more
    commands = functools.partial(_commands, ns, config, overrides, cfg.name)
    if ns.write_bucket_config:
        write_bucket_config(ns.write_bucket_config, written_bucket_config(cfg, plans),
                            f"videodit plan: {plan_summary(planner, gpu)}")
    if ns.json:
        print(plan_json(planner, plans, gpu, advice, commands))
    else:
        print(plan_summary(planner, gpu))
        print(plan_table(planner, plans))
        if advice is not None:
            print(advice_text(planner, advice, commands))
        if ns.write_bucket_config:
            print(f"bucket_config written to {ns.write_bucket_config} (data.bucket_config_file)")
    return 0


def _commands(ns, config: str | None, overrides: list[str], name: str, fix) -> list[str]:
    """The command lines of ``fix`` (``planner/advice.py``), to paste: ``videodit plan`` with it
    (the table it gives), then ``videodit train`` (under torchrun on more than one GPU). The
    user's overrides stay, but for the keys the fix sets."""
    import shlex

    keys = {setting.split("=", 1)[0] for setting in fix.settings}
    given = [o for o in overrides if o.split("=", 1)[0].strip() not in keys]
    head = [config] if config else []
    plan = ["videodit", "plan", *head, *given, *fix.settings, "--gpu-mem", ns.gpu_mem]
    if fix.world != 1 or ns.world_size:
        plan += ["--world-size", str(fix.world)]
    for flag, value in (("--latent", ns.latent), ("--caption", ns.caption), ("--encoder-mem", ns.encoder_mem)):
        if value and not (flag == "--encoder-mem" and ns.encoders_cached):
            plan += [flag, value]
    if ns.encoders_cached:
        plan.append("--encoders-cached")
    if ns.margin != 0.1:
        plan += ["--margin", str(ns.margin)]
    if fix.world == 1:
        launch = ["videodit", "train"]
    elif fix.world <= 8 or fix.world % 8:
        launch = ["torchrun", "--nproc-per-node", str(fix.world), "-m", "videodit", "train"]
    else:   # on each of the nodes, 8 GPUs each
        launch = ["torchrun", "--nnodes", str(fix.world // 8), "--nproc-per-node", "8", "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", "HOST:29500", "-m", "videodit", "train"]
    train = [*launch, *head, *(["--out", f"runs/{name}"] if fix.world > 1 else []), *given, *fix.settings]
    return [f"check: {shlex.join(plan)}", f"train: {shlex.join(train)}"]


def cmd_tune(ns) -> int:
    from videodit.config import load_config
    from videodit.planner.plan import bucket_rows, equalise_step_time, plan_buckets, written_bucket_config
    from videodit.planner.report import gib, plan_summary, write_bucket_config
    from videodit.planner.tune import require_gpu
    from videodit.train.tune import tune_buckets

    require_gpu()
    config, overrides = split_config_args(ns.args)
    cfg = load_config(config, overrides)
    if ns.gpu_mem is None:
        import torch
        ns.gpu_mem = str(torch.cuda.get_device_properties(0).total_memory)
    planner, gpu = _planner(ns, cfg)
    fits = plan_buckets(planner, bucket_rows(cfg))
    print(plan_summary(planner, gpu))
    print(f"{'resolution':<11}{'frames':>7}{'planned max':>12}{'tuned max':>10}{'peak GiB':>9}"
          f"{'predicted GiB':>14}{'step s':>8}")
    for tuned in tune_buckets(cfg, planner, fits, ns.steps):
        p, best = tuned.fit, tuned.best
        print(f"{p.resolution:<11}{p.num_frames:>7}{tuned.planned_max:>12}{p.max_batch_size:>10}"
              f"{gib(best.peak_bytes) if best else '-':>9}{gib(tuned.predicted_peak):>14}"
              f"{best.step_seconds if best else float('nan'):>8.3f}", flush=True)
    if ns.equal_step_time:
        equalise_step_time(planner, fits)
    if ns.write_bucket_config:
        write_bucket_config(ns.write_bucket_config, written_bucket_config(cfg, fits),
                            f"videodit tune: {plan_summary(planner, gpu)}")
        print(f"bucket_config written to {ns.write_bucket_config} (data.bucket_config_file)")
    return 0


def register(sub) -> None:
    p = sub.add_parser("config", help="show the resolved config or list its keys")
    csub = p.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    q = csub.add_parser("show", help="print the resolved config", description="Print the resolved config.")
    q.add_argument("args", nargs="*", metavar="[CONFIG] [key=value ...]")
    q.set_defaults(func=cmd_config_show)
    q = csub.add_parser("keys", help="list every config key with its description")
    q.set_defaults(func=cmd_config_keys)

    for name, func, text in (
            ("plan", cmd_plan, "predict per-bucket GPU memory and the largest batch sizes, without a GPU"),
            ("tune", cmd_tune, "find per-bucket batch sizes by trial steps on the GPU (out-of-memory safe)")):
        p = sub.add_parser(name, help=text, description=f"{text[0].upper()}{text[1:]}. CONFIG is a YAML file or "
                           "preset; key.sub=value overrides follow it. See docs/memory.md.")
        p.add_argument("args", nargs="*", metavar="[CONFIG] [key=value ...]")
        p.add_argument("--gpu-mem", required=name == "plan",
                       help="memory per GPU, e.g. 80GiB" + (" (default: this GPU's)" if name == "tune" else ""))
        p.add_argument("--world-size", type=int, help="GPUs in the job (default: the product of the parallel sizes)")
        p.add_argument("--margin", type=float, default=0.1, help="fraction of GPU memory kept free (default 0.1)")
        p.add_argument("--equal-step-time", action="store_true",
                       help="pick batch sizes with about equal FLOPs per step (capped by memory)")
        p.add_argument("--write-bucket-config", metavar="OUT.yaml", help="write the batch sizes as a bucket_config")
        p.add_argument("--latent", help="VAE geometry when the config's VAE is not known (vae.kind=opensora-v1.2, "
                       "wan2.1, wan2.2, hunyuan and opensora-dc-ae are): one of those names or C,FT,FS (channels, "
                       "frames per latent frame, pixels per latent)")
        p.add_argument("--caption", help="text encoder geometry when not known (text.kind=umt5 and t5-clip are: "
                       "4096 x text.max_length): CHANNELS,LENGTH (T5-XXL: 4096,300)")
        p.add_argument("--encoder-mem", help="GPU memory of the frozen encoders (default: counted from their "
                       "weight files at vae.dtype / text.dtype)")
        p.add_argument("--encoders-cached", action="store_true", help="features are precomputed: no encoders on GPU")
        if name == "plan":
            p.add_argument("--json", action="store_true", help="print a JSON object instead of the table")
        else:
            p.add_argument("--steps", type=int, default=3, help="training steps per trial (default 3)")
        p.set_defaults(func=func)
