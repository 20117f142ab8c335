"""The model presets (``model.preset``): each family's released sizes and test sizes, as data.
A leaf, like the schema that reads it."""

from __future__ import annotations

from typing import Any

# Model geometry presets, each of one family (``model.family``). STDiT's "depth" counts
# spatial+temporal block pairs, as STDiT3 does: XL is Open-Sora 1.2's STDiT3-XL/2 (28 pairs,
# hidden 1152, 16 heads, patch (1,2,2)). Wan's "depth" counts its blocks and ``ffn_dim`` is its
# FFN width: the sizes of Wan 2.1's released T2V models (wan/configs/wan_t2v_*.py).
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(depth=4, hidden_size=128, num_heads=4, mlp_ratio=4.0, patch_size=[1, 4, 4]),
    "S": dict(depth=12, hidden_size=384, num_heads=6, mlp_ratio=4.0, patch_size=[1, 2, 2]),
    "B": dict(depth=12, hidden_size=768, num_heads=12, mlp_ratio=4.0, patch_size=[1, 2, 2]),
    "XL": dict(depth=28, hidden_size=1152, num_heads=16, mlp_ratio=4.0, patch_size=[1, 2, 2]),
    # XL computing exactly what Open-Sora 1.2's STDiT3 computes: for its released weights.
    "opensora-v1.2": dict(depth=28, hidden_size=1152, num_heads=16, mlp_ratio=4.0, patch_size=[1, 2, 2],
                          position_embedding="opensora", null_caption_mask="prompt", bf16_timesteps=True,
                          freeze_null_caption=True),
    "wan-tiny": dict(family="wan", depth=2, hidden_size=64, num_heads=4, ffn_dim=128, patch_size=[1, 2, 2]),
    "wan2.1-t2v-1.3b": dict(family="wan", depth=30, hidden_size=1536, num_heads=12, ffn_dim=8960,
                            patch_size=[1, 2, 2]),
    "wan2.1-t2v-14b": dict(family="wan", depth=40, hidden_size=5120, num_heads=40, ffn_dim=13824,
                           patch_size=[1, 2, 2]),
    # Wan 2.1 I2V-14B: the 14B with 36 input channels and CLIP ViT-H/14's features (1280 wide).
    "wan2.1-i2v-14b": dict(family="wan", depth=40, hidden_size=5120, num_heads=40, ffn_dim=13824,
                           patch_size=[1, 2, 2], task="i2v", image_dim=1280),
    # Wan 2.2 (wan/configs/wan_*.py at 42bf4cf): TI2V-5B on its 48-channel VAE; each A14B expert is
    # a 14B (T2V: 16 channels in; I2V: 36, no CLIP), split at its recipe's boundary (model.expert).
    "wan2.2-ti2v-5b": dict(family="wan", depth=30, hidden_size=3072, num_heads=24, ffn_dim=14336,
                           patch_size=[1, 2, 2], task="ti2v"),
    "wan2.2-t2v-a14b": dict(family="wan", depth=40, hidden_size=5120, num_heads=40, ffn_dim=13824,
                            patch_size=[1, 2, 2], expert_boundary=0.875),
    "wan2.2-i2v-a14b": dict(family="wan", depth=40, hidden_size=5120, num_heads=40, ffn_dim=13824,
                            patch_size=[1, 2, 2], task="i2v", expert_boundary=0.900),
    # Open-Sora 2.0's MMDiT (configs/diffusion/inference/256px.py): "depth" counts the double-stream
    # blocks, depth_single the single-stream ones; 11,891,390,528 parameters. -hc is the
    # high-compression model on the 128-channel Video DC-AE (patch 1, also 11.89B).
    "opensora-v2": dict(family="mmdit", depth=19, depth_single=38, hidden_size=3072, num_heads=24, mlp_ratio=4.0,
                        patch_size=[1, 2, 2], axes_dim=[16, 56, 56], bf16_timesteps=True),
    "opensora-v2-hc": dict(family="mmdit", depth=19, depth_single=38, hidden_size=3072, num_heads=24, mlp_ratio=4.0,
                           patch_size=[1, 1, 1], axes_dim=[16, 56, 56], bf16_timesteps=True),
    "mmdit-tiny": dict(family="mmdit", depth=2, depth_single=2, hidden_size=64, num_heads=2, mlp_ratio=4.0,
                       patch_size=[1, 2, 2], axes_dim=[4, 14, 14]),
    "mmdit-S": dict(family="mmdit", depth=6, depth_single=12, hidden_size=384, num_heads=6, mlp_ratio=4.0,
                    patch_size=[1, 2, 2], axes_dim=[8, 28, 28]),
    # Lightricks' LTX-2 (models/ltx2/): the video stream's depth, width and heads; the release each preset
    # is (2.0: 18,876,174,592 parameters; 2.3: 18,988,838,144; the audio stream included) lives in
    # models/ltx2/spec.py. ltx2-tiny is LTX-2.3's shape at test size.
    "ltx2-19b": dict(family="ltx2", depth=48, hidden_size=4096, num_heads=32, mlp_ratio=4.0, patch_size=[1, 1, 1]),
    "ltx2.3-22b": dict(family="ltx2", depth=48, hidden_size=4096, num_heads=32, mlp_ratio=4.0, patch_size=[1, 1, 1]),
    "ltx2-tiny": dict(family="ltx2", depth=2, hidden_size=32, num_heads=2, mlp_ratio=4.0, patch_size=[1, 1, 1]),
}
# The model options a preset may set, where it does not: videodit's own behaviour.
MODEL_OPTION_DEFAULTS: dict[str, Any] = dict(family="stdit", position_embedding="videodit", null_caption_mask="full",
                                             bf16_timesteps=False, freeze_null_caption=False, task="t2v",
                                             depth_single=0, vec_in_dim=768, cond_embed=True)
