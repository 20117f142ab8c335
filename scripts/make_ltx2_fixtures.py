"""Write the golden LTX-2 fixtures of tests/fixtures/ltx2/ with Lightricks' own code and diffusers'.

    python scripts/make_ltx2_fixtures.py --checkout /tmp/ltx2 [--out tests/fixtures/ltx2]

The checkout is Lightricks/LTX-2 (commit 400fd31); ``scripts/ltx2_reference.py`` imports its
ltx-core on CPU with SDPA's math kernel. diffusers is the installed one (0.42). What it writes into
``--out`` (about 1.5 MB), for each of ``ltx2.0`` and ``ltx2.3``:

- ``{version}/ltx-2-tiny.safetensors``: a tiny ``LTXModel`` (2 blocks; video 2 heads x 16, audio
  2 heads x 8; 8 latent and 8 audio channels; LTX-2.0: a 24-wide caption projection; LTX-2.3: gated
  attention and the modulated text attention) in the release's single-file layout: its config as
  JSON under ``config`` in the safetensors metadata, the DiT under ``model.diffusion_model.``, and
  beside it what a release file also holds: tiny text connectors built by ltx-core
  (``model.diffusion_model.{video,audio}_embeddings_connector.*``), ``text_embedding_projection.*``,
  and a few ``vae.*``, ``audio_vae.*``, ``vocoder.*`` tensors. Every DiT weight is seeded random,
  the ones ltx-core leaves uninitialised or zero too (tables, gates).
- ``{version}/diffusers/transformer/``: the same weights as diffusers' ``LTX2VideoTransformer3DModel``
  (renamed as diffusers' ``scripts/convert_ltx2_to_diffusers.py`` renames) written by its
  ``save_pretrained``.
- ``cases.safetensors`` (``{version}/{case}/{name}``) + ``cases.json``: each case's inputs in
  videodit's form (latents ``x`` [B, C, F, H, W], sigma ``t``, ``fps``, ``x_mask``, ``context``,
  and for audio cases ``audio`` tokens, ``audio_t``, ``audio_context``), ltx-core's fp32 outputs
  (``out`` [B, C, F, H, W], ``audio_out``) and, where diffusers computes the same thing,
  diffusers' (``diffusers_out``, ``diffusers_audio_out``). ``grad`` adds an MSE loss against a
  target, the loss and the gradients of the inputs and of every parameter, from both libraries.
  ``cases.json`` also records parameter counts of ltx-core's meta-device builds of the released
  configurations (as videodit writes them: ltx-core builds from videodit's config), and the
  checks of videodit's exports loaded strictly into ltx-core and diffusers.

Cases: ``t2v``; ``i2v`` (the first latent frame clean at time 0, per-token timesteps);
``batch`` (three samples with their own sigma, fps, first-frame conditioning and a padded text
mask: ltx-core has no ragged batch of token counts, one dense [B, T, D] tensor); ``odd`` (a 2 x 3 x 7
grid); ``one_frame``; ``av`` (audio tokens with their own sigma: the cross-modal gates read the
other stream's); ``av_i2v``; ``av_same`` (one sigma for both streams). diffusers cannot express
ltx-core's cross-modal timing when the streams' times differ (its ``use_cross_timestep`` takes
scale, shift and gate from one timestep), so ``av``, ``av_i2v`` have no diffusers output.

Deterministic for the same checkout and library versions. Afterwards it prints videodit's largest
deviations (``--no-check`` skips that). tests/models/test_ltx2_*.py read the fixtures; they never
need LTX-2's code.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, safe_open, save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import ltx2_reference as ref  # noqa: E402

SEED = 2026
SIZES = dict(num_attention_heads=2, attention_head_dim=16, audio_num_attention_heads=2, audio_attention_head_dim=8,
             in_channels=8, out_channels=8, audio_in_channels=8, audio_out_channels=8, num_layers=2,
             cross_attention_dim=32, audio_cross_attention_dim=16, norm_eps=1e-6, positional_embedding_theta=10000.0,
             positional_embedding_max_pos=[20, 2048, 2048], audio_positional_embedding_max_pos=[20],
             timestep_scale_multiplier=1000, av_ca_timestep_scale_multiplier=1000, rope_type="split",
             frequencies_precision="float64",
             # the text side (read by ltx-core's connector configurators, ignored by the DiT)
             connector_num_attention_heads=4, connector_attention_head_dim=8, connector_num_layers=1,
             audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=8,
             audio_connector_num_layers=1)
CAPTION = 24
VERSIONS = {
    "ltx2.0": dict(SIZES, caption_channels=CAPTION),
    "ltx2.3": dict(SIZES, caption_channels=CAPTION, caption_proj_before_connector=True, apply_gated_attention=True,
                   cross_attention_adaln=True, connector_apply_gated_attention=True, connector_num_layers=2),
}
# diffusers' LTX2VideoTransformer3DModel arguments of the same models (its converter's for the releases)
DIFFUSERS = dict(in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2,
                 attention_head_dim=16, cross_attention_dim=32, vae_scale_factors=(8, 32, 32), pos_embed_max_pos=20,
                 base_height=2048, base_width=2048, audio_in_channels=8, audio_out_channels=8,
                 audio_num_attention_heads=2, audio_attention_head_dim=8, audio_cross_attention_dim=16,
                 audio_scale_factor=4, audio_pos_embed_max_pos=20, audio_sampling_rate=16000, audio_hop_length=160,
                 num_layers=2, activation_fn="gelu-approximate", qk_norm="rms_norm_across_heads",
                 norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=CAPTION, attention_bias=True,
                 attention_out_bias=True, rope_theta=10000.0, rope_double_precision=True, causal_offset=1,
                 timestep_scale_multiplier=1000, cross_attn_timestep_scale_multiplier=1000, rope_type="split")
DIFFUSERS_VERSIONS = {
    "ltx2.0": dict(DIFFUSERS, gated_attn=False, cross_attn_mod=False, audio_gated_attn=False,
                   audio_cross_attn_mod=False, use_prompt_embeddings=True, perturbed_attn=False),
    "ltx2.3": dict(DIFFUSERS, gated_attn=True, cross_attn_mod=True, audio_gated_attn=True,
                   audio_cross_attn_mod=True, use_prompt_embeddings=False, perturbed_attn=True),
}
# diffusers' converter renames (scripts/convert_ltx2_to_diffusers.py), applied in order as it does
RENAMES = [("patchify_proj", "proj_in"), ("audio_patchify_proj", "audio_proj_in"),
           ("av_ca_video_scale_shift_adaln_single", "av_cross_attn_video_scale_shift"),
           ("av_ca_a2v_gate_adaln_single", "av_cross_attn_video_a2v_gate"),
           ("av_ca_audio_scale_shift_adaln_single", "av_cross_attn_audio_scale_shift"),
           ("av_ca_v2a_gate_adaln_single", "av_cross_attn_audio_v2a_gate"),
           ("scale_shift_table_a2v_ca_video", "video_a2v_cross_attn_scale_shift_table"),
           ("scale_shift_table_a2v_ca_audio", "audio_a2v_cross_attn_scale_shift_table"),
           ("q_norm", "norm_q"), ("k_norm", "norm_k"),
           ("audio_prompt_adaln_single", "audio_prompt_adaln"), ("prompt_adaln_single", "prompt_adaln")]
# name: (latent shape [B, C, F, H, W], video sigma per sample, fps per sample, first frame given per
# sample, audio tokens (0: none), audio sigma per sample (None: the video's), text pads per sample)
CASES = {
    "t2v": ((2, 8, 3, 4, 5), [0.3, 0.8], [24.0, 24.0], [False, False], 0, None, None),
    "i2v": ((2, 8, 3, 4, 5), [0.6, 0.9], [24.0, 24.0], [True, True], 0, None, None),
    "batch": ((3, 8, 3, 4, 4), [0.2, 0.5, 0.95], [24.0, 12.0, 30.0], [False, True, False], 0, None, [0, 2, 4]),
    "odd": ((1, 8, 2, 3, 7), [0.45], [25.0], [False], 0, None, None),
    "one_frame": ((2, 8, 1, 4, 4), [0.1, 0.7], [24.0, 24.0], [False, False], 0, None, None),
    "av": ((2, 8, 3, 4, 5), [0.3, 0.8], [24.0, 24.0], [False, False], 9, [0.5, 0.15], None),
    "av_i2v": ((2, 8, 3, 4, 5), [0.6, 0.4], [24.0, 24.0], [True, False], 9, [0.6, 0.9], None),
    "av_same": ((2, 8, 3, 4, 5), [0.3, 0.8], [24.0, 24.0], [False, False], 9, "video", None),
    "grad": ((2, 8, 2, 3, 4), [0.35, 0.75], [24.0, 24.0], [False, False], 5, "video", None),
}
TEXT_TOKENS = 6
# diffusers' parameter gradients kept (ltx-core's are kept for every parameter)
DIFFUSERS_GRADS = {f"transformer_blocks.1.{name}" for name in (
    "attn1.to_q.weight", "attn1.norm_k.weight", "attn2.to_v.weight", "attn2.to_out.0.bias", "ff.net.0.proj.weight",
    "audio_attn1.to_k.weight", "audio_ff.net.2.weight", "audio_to_video_attn.to_q.weight",
    "video_to_audio_attn.to_v.weight", "scale_shift_table", "audio_scale_shift_table",
    "video_a2v_cross_attn_scale_shift_table", "audio_a2v_cross_attn_scale_shift_table",
    "prompt_scale_shift_table", "attn1.to_gate_logits.weight")} | {
    "proj_in.weight", "time_embed.linear.weight", "time_embed.emb.timestep_embedder.linear_1.weight",
    "av_cross_attn_video_a2v_gate.linear.weight", "av_cross_attn_audio_scale_shift.linear.bias",
    "prompt_adaln.linear.weight", "caption_projection.linear_1.weight", "scale_shift_table", "proj_out.weight",
    "audio_proj_out.weight"}


def randomise(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Every parameter seeded random at a scale that keeps activations O(1): weights ~ 1/sqrt(fan-in),
    norm scales ~ 1, tables, biases and gates ~ 0.2 (LTX leaves tables uninitialised and inits some
    gates at zero, which would hide a wrong table row or gate). Rounded to bf16 values, as the
    releases ship, so the files are stored in bf16 and every library computes on the same fp32 weights."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if param.dim() == 2 and "table" not in name and "registers" not in name:
                noise = noise / param.shape[1] ** 0.5
            elif "norm" in name:
                noise = 1 + 0.1 * noise
            else:
                noise = 0.2 * noise
            param.copy_(noise.bfloat16().float())


def to_diffusers(state: dict) -> dict:
    out = {}
    for key, value in state.items():
        new = key
        for old, renamed in RENAMES:
            new = new.replace(old, renamed)
        for old, renamed in (("adaln_single.", "time_embed."), ("audio_adaln_single.", "audio_time_embed.")):
            if new.startswith(old):
                new = renamed + new[len(old):]
        out[new] = value
    return out


def text_side(version: str, config: dict, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """What a release file holds beside the DiT: ltx-core's connectors, the feature projection,
    the decoders (a few tensors each, under their real prefixes)."""
    from ltx_core.text_encoders.gemma.embeddings_connector import (AudioEmbeddings1DConnectorConfigurator,
                                                                   Embeddings1DConnectorConfigurator)
    metadata = {"config": config}
    tensors = {}
    for prefix, configurator in (("video_embeddings_connector", Embeddings1DConnectorConfigurator),
                                 ("audio_embeddings_connector", AudioEmbeddings1DConnectorConfigurator)):
        connector = configurator.from_metadata(metadata)
        connector.learnable_registers = torch.nn.Parameter(connector.learnable_registers.float())
        randomise(connector, generator)
        tensors.update({f"model.diffusion_model.{prefix}.{k}": v for k, v in connector.state_dict().items()})
    projections = ["aggregate_embed"] if version == "ltx2.0" else ["video_aggregate_embed", "audio_aggregate_embed"]
    for name in projections:
        tensors[f"text_embedding_projection.{name}.weight"] = torch.randn(CAPTION, 3 * CAPTION,
                                                                          generator=generator).bfloat16()
    for name, shape in (("vae.decoder.conv_in.conv.weight", (4, 8, 3, 3, 3)), ("vae.per_channel_statistics.mean-of-means",
                        (8,)), ("audio_vae.decoder.conv_in.conv.weight", (4, 8, 3, 3)),
                        ("vocoder.conv_pre.weight", (4, 8, 7))):
        tensors[name] = torch.randn(shape, generator=generator).bfloat16()
    return {name: tensor.bfloat16() for name, tensor in tensors.items()}


def text_widths(version: str) -> tuple[int, int]:
    """(video, audio) text widths the DiT takes: LTX-2.0 the connectors' (projected inside), LTX-2.3
    the streams' own."""
    return (CAPTION, CAPTION) if version == "ltx2.0" else (32, 16)


def case_inputs(version: str, name: str, generator: torch.Generator) -> dict[str, torch.Tensor]:
    shape, sigma, fps, given, audio_tokens, audio_sigma, pads = CASES[name]
    b, c, frames = shape[:3]
    video_width, audio_width = text_widths(version)
    inputs = {"x": torch.randn(shape, generator=generator), "t": torch.tensor(sigma), "fps": torch.tensor(fps),
              "x_mask": torch.ones(b, frames, dtype=torch.bool),
              "context": torch.randn(b, TEXT_TOKENS, video_width, generator=generator)}
    for i, first in enumerate(given):
        inputs["x_mask"][i, 0] = not first
    if pads is not None:   # left-padded text, as Gemma's prompts are
        inputs["context_mask"] = torch.ones(b, TEXT_TOKENS, dtype=torch.int64)
        for i, pad in enumerate(pads):
            inputs["context_mask"][i, :pad] = 0
    if audio_tokens:
        inputs["audio"] = torch.randn(b, audio_tokens, 8, generator=generator)
        inputs["audio_t"] = inputs["t"].clone() if audio_sigma == "video" else torch.tensor(audio_sigma)
        inputs["audio_context"] = torch.randn(b, TEXT_TOKENS, audio_width, generator=generator)
    return inputs


def run_ltx(checkout, model, version: str, inputs: dict):
    """ltx-core's forward on videodit-form inputs: positions as ltx-trainer builds them (per
    sample, for its own fps), per-token timesteps (0 on given frames), patchified latents."""
    x, t = inputs["x"], inputs["t"]
    b, _, frames, height, width = x.shape
    positions = torch.cat([ref.video_positions(checkout, frames, height, width, 1, float(fps)) for fps in inputs["fps"]])
    timesteps = torch.where(inputs["x_mask"].repeat_interleave(height * width, dim=1), t[:, None], 0.0)
    video = ref.modality(checkout, latent=ref.patchify(x), sigma=t, timesteps=timesteps, positions=positions,
                         context=inputs["context"], context_mask=inputs.get("context_mask"))
    audio = None
    if "audio" in inputs:
        tokens = inputs["audio"].shape[1]
        audio = ref.modality(checkout, latent=inputs["audio"], sigma=inputs["audio_t"],
                             timesteps=inputs["audio_t"][:, None].expand(b, tokens),
                             positions=ref.audio_positions(checkout, tokens, b),
                             context=inputs["audio_context"])
    out, audio_out = model(video, audio, None)
    return out.transpose(1, 2).reshape(x.shape), audio_out


def run_diffusers(model, version: str, inputs: dict, checkout):
    """diffusers' forward of the same inputs (times x 1000, as its pipelines pass them); without audio
    the cross-modal attentions are off (``isolate_modalities``) and a dummy audio stream runs beside."""
    x, t = inputs["x"], inputs["t"]
    b, _, frames, height, width = x.shape
    coords = torch.cat([ref.video_positions(checkout, frames, height, width, 1, float(fps)) for fps in inputs["fps"]])
    timestep = torch.where(inputs["x_mask"].repeat_interleave(height * width, dim=1), t[:, None], 0.0) * 1000
    has_audio = "audio" in inputs
    audio = inputs["audio"] if has_audio else torch.zeros(b, 2, 8)
    audio_t = inputs["audio_t"] if has_audio else t
    audio_context = inputs["audio_context"] if has_audio else torch.zeros(b, TEXT_TOKENS, text_widths(version)[1])
    mask = inputs.get("context_mask")
    out, audio_out = model(ref.patchify(x), audio, inputs["context"], audio_context,
                           timestep=timestep, audio_timestep=audio_t[:, None].expand(b, audio.shape[1]) * 1000,
                           sigma=t * 1000, audio_sigma=audio_t * 1000, encoder_attention_mask=mask,
                           video_coords=coords, audio_coords=ref.audio_positions(checkout, audio.shape[1], b),
                           isolate_modalities=not has_audio, use_cross_timestep=True, return_dict=False)
    return out.transpose(1, 2).reshape(x.shape), (audio_out if has_audio else None)


def diffusers_comparable(name: str) -> bool:
    return name not in ("av", "av_i2v")


def grad_case(checkout, ltx_model, diffusers_model, version, inputs, generator, store):
    """MSE of both outputs against targets, backward in both libraries: the loss, the input and every
    parameter gradient (ltx-core's under its names; diffusers' renamed back by name order)."""
    store["target"] = torch.randn(inputs["x"].shape, generator=generator)
    store["audio_target"] = torch.randn(inputs["audio"].shape, generator=generator)
    for library, model in (("ltx", ltx_model), ("diffusers", diffusers_model)):
        model.zero_grad()
        leaves = {k: inputs[k].clone().requires_grad_() for k in ("x", "context", "audio", "audio_context")}
        run = run_ltx if library == "ltx" else run_diffusers
        args = (checkout, model, version, {**inputs, **leaves}) if library == "ltx" else \
            (model, version, {**inputs, **leaves}, checkout)
        out, audio_out = run(*args)
        loss = F.mse_loss(out, store["target"]) + F.mse_loss(audio_out, store["audio_target"])
        loss.backward()
        tag = "" if library == "ltx" else "diffusers_"
        store[f"{tag}loss"] = loss.detach()
        for k, leaf in leaves.items():
            store[f"{tag}d{k}"] = leaf.grad
        for name, param in model.named_parameters():
            if library == "ltx" or name in DIFFUSERS_GRADS:   # diffusers': a sample of every kind (size)
                store[f"{tag}param.{name}"] = param.grad.clone()


def export_checks(checkout, version, out_dir: Path, cases: dict) -> dict:
    """videodit's exports of the fixture model loaded strictly by ltx-core and diffusers, run on the
    t2v case: the largest relative deviation from the fixture's output, per layout."""
    sys.path.insert(0, str(REPO))
    from diffusers import LTX2VideoTransformer3DModel
    from videodit.models.ltx2 import layouts
    geometry, tensors = layouts.read_ltx2(out_dir / version / "ltx-2-tiny.safetensors")
    state = {k: tensors[k] for k in tensors}
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        file = layouts.write_release(Path(tmp) / "export.safetensors", geometry, state)
        with safe_open(str(file), framework="pt") as handle:
            config = json.loads(handle.metadata()["config"])
        model = ref.build_model(config, checkout)
        exported = {k[len(layouts.PREFIX):]: v for k, v in load_file(str(file)).items()}
        model.load_state_dict(exported, strict=True)
        inputs = {k: v for k, v in cases[f"{version}/t2v"].items() if k not in ("out", "diffusers_out")}
        with torch.no_grad():
            out, _ = run_ltx(checkout, model.eval(), version, inputs)
        result["ltx2"] = relative(out, cases[f"{version}/t2v"]["out"])
        folder = layouts.write_diffusers(Path(tmp) / "diffusers", geometry, state)
        model, info = LTX2VideoTransformer3DModel.from_pretrained(folder, output_loading_info=True)
        assert not any(info.values()), info   # strict: nothing missing, unexpected or mismatched
        with torch.no_grad():
            out, _ = run_diffusers(model.eval(), version, inputs, checkout)
        result["diffusers"] = relative(out, cases[f"{version}/t2v"]["out"])
    return result


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", required=True, help="a Lightricks/LTX-2 checkout")
    parser.add_argument("--out", default=str(REPO / "tests" / "fixtures" / "ltx2"))
    parser.add_argument("--no-check", action="store_true", help="skip the deviation report of videodit's model")
    args = parser.parse_args()
    ref.import_ltx_core(args.checkout)
    from diffusers import LTX2VideoTransformer3DModel
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    generator = torch.Generator().manual_seed(SEED)
    flat, record = {}, {"seed": SEED, "cases": {k: list(map(str, v)) for k, v in CASES.items()}}
    try:
        record["ltx2_commit"] = subprocess.run(["git", "-C", args.checkout, "rev-parse", "HEAD"], capture_output=True,
                                               text=True).stdout.strip() or "400fd31 (archive)"
    except OSError:
        record["ltx2_commit"] = "400fd31 (archive)"
    import diffusers
    record["diffusers"], record["torch"] = diffusers.__version__, torch.__version__
    for version, sizes in VERSIONS.items():
        config = {"transformer": ref.transformer_config(**sizes)}
        model = ref.build_model(config, args.checkout)
        randomise(model, generator)
        model.eval()
        folder = out / version
        folder.mkdir(exist_ok=True)
        release = {f"model.diffusion_model.{k}": v.bfloat16().contiguous() for k, v in model.state_dict().items()}
        release.update(text_side(version, config, generator))
        save_file(release, str(folder / "ltx-2-tiny.safetensors"),
                  metadata={"config": json.dumps(config), "model_version": version[3:] + ".0-tiny"})
        dmodel = LTX2VideoTransformer3DModel(**DIFFUSERS_VERSIONS[version])
        dmodel.load_state_dict(to_diffusers(model.state_dict()), strict=True)
        copy.deepcopy(dmodel).to(torch.bfloat16).save_pretrained(folder / "diffusers" / "transformer")
        dmodel.eval()
        record[version] = {"config": config, "parameters": sum(p.numel() for p in model.parameters())}
        for name in CASES:
            inputs = case_inputs(version, name, generator)
            store = dict(inputs)
            if name == "grad":
                grad_case(args.checkout, model, dmodel, version, inputs, generator, store)
            else:
                with torch.no_grad():
                    store["out"], audio_out = run_ltx(args.checkout, model, version, inputs)
                    if audio_out is not None:
                        store["audio_out"] = audio_out
                    if diffusers_comparable(name):
                        store["diffusers_out"], d_audio = run_diffusers(dmodel, version, inputs, args.checkout)
                        if d_audio is not None:
                            store["diffusers_audio_out"] = d_audio
            flat.update({f"{version}/{name}/{k}": v.contiguous() for k, v in store.items()})
    # ltx-core's meta-device builds of the released configurations, from the configs videodit writes
    sys.path.insert(0, str(REPO))
    from videodit.models.ltx2.geometry import LTX2_0, LTX2_3
    from videodit.models.ltx2.release_config import release_config
    record["released_parameters"] = {name: ref.meta_parameter_count(release_config(g), args.checkout)
                                     for name, g in (("ltx2-19b", LTX2_0), ("ltx2.3-22b", LTX2_3))}
    save_file(flat, str(out / "cases.safetensors"))
    grouped = {}
    for key, tensor in flat.items():
        version, case, name = key.split("/", 2)
        grouped.setdefault(f"{version}/{case}", {})[name] = tensor
    record["export_checks"] = {version: export_checks(args.checkout, version, out, grouped) for version in VERSIONS}
    (out / "cases.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: record[k] for k in ("released_parameters", "export_checks")}, indent=1))
    if not args.no_check:
        check(out, grouped)


def check(out: Path, grouped: dict) -> None:
    """videodit's largest deviations from both libraries (informational)."""
    from videodit.models.ltx2.layouts import load_ltx2
    for version in VERSIONS:
        model = load_ltx2(out / version / "ltx-2-tiny.safetensors").eval()
        for name in CASES:
            if name == "grad":
                continue
            case = grouped[f"{version}/{name}"]
            kwargs = {k: case[k] for k in ("fps", "x_mask", "context_mask", "audio", "audio_t", "audio_context")
                      if k in case}
            with torch.no_grad():
                result = model(case["x"], case["t"], case["context"], **kwargs)
            video, audio = result if isinstance(result, tuple) else (result, None)
            line = f"{version} {name}: ltx video {relative(video, case['out']):.1e}"
            if audio is not None:
                line += f" audio {relative(audio, case['audio_out']):.1e}"
            if "diffusers_out" in case:
                line += f"; diffusers video {relative(video, case['diffusers_out']):.1e}"
            print(line)


if __name__ == "__main__":
    main()
