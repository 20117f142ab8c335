"""Every LTX-2 recipe (``videodit/config/presets/ltx2*.yaml``) resolves, is one the LTX-2 objective
and VAE accept, and plans at 80 GiB (offline: nothing is loaded but the config; the models are
built on the meta device).

The planner does not yet know LTX-2's encoders (``vae.kind: ltx2``, ``text.kind: gemma3-ltx2``),
so the plan is given their geometry as ``videodit plan NAME --latent 128,8,32 --caption 4096,1024``
gives it; planning with the recipe alone is marked as the expected failure it is until the
planner's ``KNOWN_LATENTS`` / ``KNOWN_CAPTIONS`` learn them."""

from types import SimpleNamespace

import pytest

from videodit.config import builtin_presets, load_config
from videodit.config.schema import LORA_TARGETS
from videodit.diffusion import ltx2_objective
from videodit.planner.plan import LatentGeometry, bucket_rows, plan_buckets, planner_from_config

GIB = 2**30
RECIPES = sorted(name for name in builtin_presets() if name.startswith("ltx2"))
LTX2_VAE = SimpleNamespace(temporal_compression=8, spatial_compression=32)   # 8k+1 frames, sides of 32k
GEOMETRY = dict(latent=LatentGeometry(128, 8, 32), caption=(4096, 1024))


def test_the_recipes_are_there():
    assert RECIPES == ["ltx2.3-22b-finetune", "ltx2.3-22b-i2v-lora", "ltx2.3-22b-lora"]


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_resolves_to_ltx_settings(name):
    cfg = load_config(name, [])
    assert cfg.model.family == "ltx2" and cfg.model.preset == "ltx2.3-22b"
    assert (cfg.vae.kind, cfg.text.kind, cfg.text.max_length) == ("ltx2", "gemma3-ltx2", 1024)
    assert cfg.diffusion.caption_dropout == 0.0                      # LTX's trainer drops none
    assert cfg.diffusion.first_frame_p == (0.5 if "i2v" in name else 0.0)
    assert cfg.train.precision == "bf16" and cfg.memory.checkpointing == "full"
    ltx2_objective.check_options(cfg.diffusion)                      # velocity, no noise floor, no ranges
    rows = bucket_rows(cfg)
    ltx2_objective.check_clips(LTX2_VAE, [SimpleNamespace(num_frames=f, height=h, width=w)
                                          for _, f, _, h, w, _ in rows])
    assert (rows[0][1], rows[0][3], rows[0][4]) == (49, 544, 960)    # LTX's 960x544x49
    if "lora" in name:
        assert cfg.lora.rank == 32 and cfg.lora.alpha == 32 and cfg.train.lr == 1e-4
        assert cfg.lora.targets == LORA_TARGETS["ltx2"]
    else:
        assert cfg.lora.rank == 0 and cfg.parallel.dp_shard == -1


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_plans_at_80_gib(name):
    cfg = load_config(name, [])
    gpus = 1 if "lora" in name else 8
    planner = planner_from_config(cfg, 80 * GIB, world_size=gpus, encoder_bytes=0, **GEOMETRY)
    (plan,) = plan_buckets(planner, bucket_rows(cfg))
    assert plan.tokens == 7 * 17 * 30                                 # 3,570 video tokens
    assert plan.max_batch_size >= 1, plan


def test_recipe_plans_without_given_geometry():
    """vae.kind=ltx2 and text.kind=gemma3-ltx2 are known to the planner: no --latent/--caption."""
    planner = planner_from_config(load_config("ltx2.3-22b-lora", []), 80 * GIB, encoder_bytes=0)
    assert (planner.latent.channels, planner.latent.temporal, planner.latent.spatial) == (128, 8, 32)
    assert planner.caption_length == 1024   # Gemma's padded length; 2.3's embeddings are 4096 wide, unprojected
    given = planner_from_config(load_config("ltx2.3-22b-lora", []), 80 * GIB, encoder_bytes=0, **GEOMETRY)
    shape = (49, 544, 960)
    assert planner.max_batch(*shape) == given.max_batch(*shape)