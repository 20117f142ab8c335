"""``videodit buckets``: where the samples of one epoch go, and how many steps that makes."""

from __future__ import annotations

import numpy as np

from videodit.data.buckets.assign import DROP_REASON_TEXT, DropReason
from videodit.data.buckets.plan import BucketPlan
from videodit.data.sampler import BucketBatchSampler


def bucket_report(plan: BucketPlan, *, dp_size: int = 1, epoch: int = 0) -> dict:
    """Samples and batches per (resolution, num_frames), drops by reason, steps per epoch."""
    assignment = plan.assignment(epoch)
    sampler = BucketBatchSampler(plan.assign, [b.batch_size for b in plan.buckets], seed=plan.seed,
                                 dp_size=dp_size, fingerprint=plan.fingerprint, share=plan.meta.shared,
                                 share_key=plan.assign_key)
    epoch_plan = sampler.global_batches(epoch)
    batches_per_bucket = np.bincount(epoch_plan.bucket, minlength=len(plan.buckets))
    counts = assignment.bucket_counts()

    rows: dict[tuple[str, int], dict] = {}
    for index, bucket in enumerate(plan.buckets):
        row = rows.setdefault((bucket.resolution, bucket.num_frames), {
            "resolution": bucket.resolution, "num_frames": bucket.num_frames,
            "batch_size": bucket.batch_size, "samples": 0, "batches": 0, "aspect_ratios": {}})
        row["samples"] += int(counts[index])
        row["batches"] += int(batches_per_bucket[index])
        if counts[index]:
            row["aspect_ratios"][bucket.ratio] = {"height": bucket.height, "width": bucket.width,
                                                  "samples": int(counts[index])}
    dropped = {DROP_REASON_TEXT[reason]: count for reason, count in assignment.reason_counts().items()
               if reason != DropReason.KEPT}
    global_batches = len(epoch_plan)
    warnings = [f"{r['resolution']} x {r['num_frames']} frames receives no batch ({r['samples']} samples, "
                f"batch size {r['batch_size']})" for r in rows.values() if r["batches"] == 0]
    return {
        "epoch": epoch, "dp_size": dp_size, "samples": len(assignment.bucket),
        "kept": int(assignment.kept.sum()), "buckets": list(rows.values()), "dropped": dropped,
        "global_batches": global_batches, "steps_per_epoch": global_batches // dp_size,
        "samples_per_epoch": int(sum(b.batch_size * int(n) for b, n in zip(plan.buckets, batches_per_bucket))),
        "warnings": warnings,
    }


def format_report(report: dict) -> str:
    lines = [f"{'resolution':<11}{'frames':>7}{'batch':>7}{'samples':>9}{'batches':>9}  aspect ratios (samples)"]
    for row in report["buckets"]:
        ratios = ", ".join(f"{key} {v['height']}x{v['width']} ({v['samples']})"
                           for key, v in sorted(row["aspect_ratios"].items()))
        lines.append(f"{row['resolution']:<11}{row['num_frames']:>7}{row['batch_size']:>7}{row['samples']:>9}"
                     f"{row['batches']:>9}  {ratios or '-'}")
    lines.append(f"kept {report['kept']:,} of {report['samples']:,} samples; "
                 f"{report['global_batches']} global batches -> {report['steps_per_epoch']} steps per epoch "
                 f"at dp_size={report['dp_size']} ({report['samples_per_epoch']:,} samples trained per epoch)")
    for reason, count in report["dropped"].items():
        lines.append(f"dropped {count:,}: {reason}")
    for warning in report["warnings"]:
        lines.append(f"warning: {warning}")
    return "\n".join(lines)
