"""Which objective trains a family, and which sampler samples it: the family's spec names one
(``ModelSpec.objective``; "flow" where it names none), this maps the name.

An objective turns clean latents into a step's noisy latents and target, and a model output into
the loss; the trainer asks it for nothing else:

* ``noised(x0, size, generator, device, time_range) -> (x_t, t, target, x_mask or None)``: every
  draw from the batch's ``generator``; ``size`` the clip's pixel size; ``x_mask`` [B, F] the
  frames the objective gives (False) and generates (True), or None;
* ``loss(output, x_t, t, target, x_mask=None) -> the micro-batch's mean loss``.

"flow" is rectified flow (``RectifiedFlow``: Open-Sora 1.2's, Wan's and Open-Sora 2.0's rules,
chosen by ``diffusion.*``); "ltx2" is LTX-2's (``ltx2_objective.py``), which also brings its own
sampler and its clip-size rule.
"""

from __future__ import annotations

from videodit.diffusion import ltx2_objective
from videodit.diffusion.rectified_flow import RectifiedFlow
from videodit.errors import UserError

OBJECTIVES = ("flow", "ltx2")


def objective_name(spec) -> str:
    return getattr(spec, "objective", "flow")


def objective_of(spec, diffusion, flow: RectifiedFlow, vae=None, buckets=()):
    """The objective of ``spec``'s family under ``diffusion.*``: ``flow`` itself for flow matching,
    else the family's own, with its options and the run's ``buckets`` (their pixel sizes, against
    ``vae``'s grid) checked in one line each."""
    name = objective_name(spec)
    if name == "flow":
        if diffusion.first_frame_p:
            raise UserError(f"diffusion.first_frame_p is LTX-2's first-frame conditioning; the {spec.family} family "
                            "trains given frames with diffusion.mask_ratios (e.g. {image_head: 0.5}) instead")
        return flow
    if name == "ltx2":
        objective = ltx2_objective.LTX2Objective(diffusion)
        if vae is not None:
            ltx2_objective.check_clips(vae, buckets)
        return objective
    raise ValueError(f"unknown objective {name!r} (one of {', '.join(OBJECTIVES)})")


def family_sampler(spec):
    """The family's own sampler (``ltx2_objective.denoise``'s signature), or None: flow matching's."""
    return ltx2_objective.denoise if objective_name(spec) == "ltx2" else None
