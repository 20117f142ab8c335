"""What a cache holds beside latents and captions: the conditions some models take from each
clip's first frame (Wan i2v), encoded once like the rest.

* ``first_frame``: the VAE latents of the clip with every frame after the first set to zero
  (mid-grey), as ``components.first_frame_given`` encodes it on the fly. The same shape as the
  clip's latents; the 4-channel mask that goes with it is derived at training time
  (``spec.first_frame_condition``), not stored. The latent frames after the first are not zero
  (the VAE encodes the grey frames, and a causal VAE carries the given frame into them), so the
  whole tensor is stored.
* ``image``: the image encoder's features of the first frame (Wan 2.1 I2V's CLIP), ``[tokens,
  dim]`` per sample, as ``components.first_frame_features`` gives them.
* ``pooled``: not of the frame but of the caption: the pooled vector ``[dim]`` of a text encoder
  that has one (Open-Sora 2.0's CLIP-L beside T5), as ``encode_pooled`` gives it. Such a cache
  also holds ``empty_caption.safetensors``, the encoding of "" that caption dropout trains on.

The manifest lists the conditions a cache holds (``conditions``, written only when there are
any, so a text-to-video cache is byte for byte what it was before this key existed, and caches
built before it read as holding none), the image features' ``image_geometry``, the pooled
vector's ``pooled_geometry`` and, under ``encoders.image``, the image encoder's identity. This
module is a leaf: plain manifest logic.
"""

from __future__ import annotations

from videodit.errors import UserError

FIRST_FRAME, IMAGE, POOLED = "first_frame", "image", "pooled"
CONDITIONS = (FIRST_FRAME, IMAGE, POOLED)   # in this order in manifests and messages
EMPTY_CAPTION = "empty_caption.safetensors"   # beside the manifest of a cache holding pooled vectors
_WHAT = {FIRST_FRAME: "latents of the given first frames", IMAGE: "image features of the given first frames",
         POOLED: "pooled caption vectors"}


def wanted(first_frame: bool, image: bool, pooled: bool = False) -> tuple[str, ...]:
    """The conditions a model takes: the given first frame's latents and/or its image features,
    and the pooled caption vector of a text encoder with one."""
    return tuple(c for c, on in ((FIRST_FRAME, first_frame), (IMAGE, image), (POOLED, pooled)) if on)


def held(manifest: dict) -> tuple[str, ...]:
    """The conditions a cache holds (none for a cache of before the key)."""
    return tuple(manifest.get("conditions", ()))


def describe(conditions) -> str:
    return " and ".join(_WHAT[c] for c in conditions) or "no first-frame conditions"


def manifest_entries(conditions: tuple[str, ...], image_tokens: int | None = None,
                     image_dim: int | None = None, pooled_dim: int | None = None) -> dict:
    """The manifest keys of ``conditions``: none at all for a cache without any."""
    if not conditions:
        return {}
    entries = {"conditions": [c for c in CONDITIONS if c in conditions]}
    if IMAGE in conditions:
        entries["image_geometry"] = {"tokens": int(image_tokens), "dim": int(image_dim)}
    if POOLED in conditions:
        entries["pooled_geometry"] = {"dim": int(pooled_dim)}
    return entries


def conditions_problem(manifest: dict) -> str | None:
    """What makes the condition keys of a manifest unusable, or None."""
    if "conditions" not in manifest:
        return None
    conditions = manifest["conditions"]
    if not isinstance(conditions, list) or not conditions or len(set(map(str, conditions))) != len(conditions) \
            or not all(c in CONDITIONS for c in conditions):
        return f"conditions {str(conditions)[:60]} is not a list of distinct names among {', '.join(CONDITIONS)}"
    if IMAGE in conditions:
        geometry, identity = manifest.get("image_geometry"), manifest["encoders"].get("image")
        if not isinstance(geometry, dict) or not all(
                isinstance(geometry.get(k), int) and not isinstance(geometry.get(k), bool) and geometry[k] >= 1
                for k in ("tokens", "dim")):
            return "image_geometry is not {tokens, dim} of positive integers"
        if not isinstance(identity, dict) or not isinstance(identity.get("kind"), str):
            return "it holds image features but encoders.image names no image encoder"
    if POOLED in conditions:
        geometry = manifest.get("pooled_geometry")
        dim = geometry.get("dim") if isinstance(geometry, dict) else None
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
            return "pooled_geometry is not {dim} of a positive integer"
    return None


def tensor_shapes(manifest: dict, latent_shape: list[int]) -> dict[str, list[int]]:
    """Condition name -> shape of one sample's stored tensor, for a sample whose latent is
    ``latent_shape``."""
    shapes = {}
    for condition in held(manifest):
        if condition == FIRST_FRAME:
            shapes[condition] = list(latent_shape)
        elif condition == POOLED:
            shapes[condition] = [int(manifest["pooled_geometry"]["dim"])]
        else:
            geometry = manifest["image_geometry"]
            shapes[condition] = [int(geometry["tokens"]), int(geometry["dim"])]
    return shapes


def image_bytes(manifest: dict) -> int:
    """The bytes of one sample's stored image features (0 without them)."""
    if IMAGE not in held(manifest):
        return 0
    geometry = manifest["image_geometry"]
    return int(geometry["tokens"]) * int(geometry["dim"]) * (2 if manifest["dtype"] == "bf16" else 4)


def require(manifest: dict, needed: tuple[str, ...], where: str) -> None:
    """Refuse, in one line with the fix, a cache that lacks a condition the model takes."""
    missing = [c for c in needed if c not in held(manifest)]
    if missing:
        raise UserError(f"data.cache={where} holds no {describe(missing)}, which this model takes (it holds "
                        f"{describe(held(manifest))}): build a cache with this run's config, model.* included (it "
                        f"decides what is stored), `videodit cache build CONFIG --out NEW_DIR`, and train from that")
