"""The registry of model families: ``model.family`` -> its :class:`~videodit.models.spec.ModelSpec`.

The one place outside a family's folder that imports it. Everything else asks :func:`get_spec`
(by name) or :func:`spec_of` (by a model, a pipeline stage or a geometry).
"""

from __future__ import annotations

from functools import cache

from videodit.errors import UserError
from videodit.models.spec import ModelSpec


@cache
def families() -> dict[str, ModelSpec]:
    from videodit.models.ltx2.spec import LTX2Spec
    from videodit.models.mmdit.spec import MMDiTSpec
    from videodit.models.stdit.spec import StditSpec
    from videodit.models.wan.spec import WanSpec
    return {spec.family: spec for spec in (StditSpec(), WanSpec(), MMDiTSpec(), LTX2Spec())}


# Families whose released layout takes any weights file (Open-Sora 1.2's checkpoints: one .pt or
# .safetensors, a model/ folder): tried after the families that recognise theirs by its names.
FALLBACK_LAYOUTS = ("stdit",)


def get_spec(family: str) -> ModelSpec:
    try:
        return families()[family]
    except KeyError:
        raise UserError(f"model.family={family!r} is not a model family; choose one of: "
                        f"{', '.join(families())}") from None


def spec_of(thing) -> ModelSpec:
    """The spec of a geometry, or of a model or stage (by its ``geometry``)."""
    geometry = getattr(thing, "geometry", thing)
    for spec in families().values():
        if isinstance(geometry, spec.geometry_type):
            return spec
    raise TypeError(f"{type(thing).__name__} belongs to no model family")


def spec_for_model_type(model_type: str | None) -> ModelSpec | None:
    """The family whose videodit model folders carry ``model_type`` in their config.json."""
    return next((spec for spec in families().values() if spec.model_type == model_type), None)


def encoder_spec(field: str, kind: str) -> ModelSpec | None:
    """The family that brings ``vae.kind``/``text.kind`` = ``kind`` (``field``: ``vae_kinds`` or
    ``text_kinds``), or None for the kinds the encoder factories build themselves."""
    return next((spec for spec in families().values() if kind in getattr(spec, field)), None)


def encoder_kinds(field: str) -> tuple[str, ...]:
    return tuple(kind for spec in families().values() for kind in getattr(spec, field))


def released_spec(path) -> ModelSpec | None:
    """The family whose released weights ``path`` holds (Open-Sora's STDiT3, Wan's folders), or None."""
    ordered = sorted(families().values(), key=lambda spec: spec.family in FALLBACK_LAYOUTS)
    return next((spec for spec in ordered if spec.released_layout(path)), None)
