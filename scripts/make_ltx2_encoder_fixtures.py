"""Write the golden fixtures of LTX-2's frozen encoders (tests/fixtures/ltx2_encoders/) with
Lightricks' own code and diffusers'.

    python scripts/make_ltx2_encoder_fixtures.py /path/to/LTX-2 [--out tests/fixtures/ltx2_encoders]

The checkout is Lightricks/LTX-2 (commit 400fd31); ltx-core is imported on CPU
(``scripts/ltx2_reference.py``); diffusers is the installed one (0.42). Written into ``--out``:

- ``gemma/``: a tiny random Gemma 3 (``Gemma3ForConditionalGeneration``: text width 16, 4 layers
  alternating sliding (window 16) and full attention, 2 heads / 1 KV head of 8, a 1-layer vision
  tower) saved by transformers, in the layout google/gemma-3-12b-it is downloaded in
  (``language_model.model.*``), and its tokenizer: a word-level ``tokenizers`` model over a small
  vocabulary (``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, ``<unk>`` 3, a post-processor prepending
  ``<bos>`` as Gemma's does) in ``tokenizer.json`` + ``tokenizer_config.json``; ltx-core also
  asks for a ``processor_config.json`` (used only by its prompt enhancer, never here).
- ``ltx2.0/ltx-2-tiny.safetensors`` and ``ltx2.3/ltx-2-tiny.safetensors``: the text side of a
  release in its single-file layout, built by ltx-core from the metadata config: video and audio
  connectors (``model.diffusion_model.{video,audio}_embeddings_connector.*``; 2.0: 2 layers of
  2 x 8, 2.3: 2 gated layers, video 2 x 8, audio 2 x 4) and ``text_embedding_projection.*``
  (2.0 ``aggregate_embed``, 2.3 the per-stream pair), 128 registers, RoPE max_pos 4096 in fp64;
  ltx2.0's file also holds a tiny VAE under ``vae.*`` with its ltx-core config (latent 8
  channels, 8 x 32 x 32, every kind of down/upsampler; bf16 as the releases store weights).
- ``vae/``: the same VAE converted by diffusers' own ``convert_ltx2_vae_to_diffusers``, saved by
  ``save_pretrained`` (bf16).
- ``cases.safetensors`` + ``cases.json``: for the captions in cases.json (empty, short, unknown
  words, longer than 1024 tokens): ltx-core's text encoder pipeline (``LTXGemmaTokenizer``, the
  Gemma built by its ``SingleGPUModelBuilder`` with its key ops, ``EmbeddingsProcessor``) outputs
  ``{version}/video``, ``{version}/audio``, ``{version}/mask``, the token ids and mask, and
  diffusers' ``LTX2TextConnectors`` (converted from the same tensors) ``{version}/diffusers_video``
  and ``/diffusers_audio``; for a 9-frame 64 x 64 clip (and a 1-frame one): ltx-core's
  ``VideoEncoder`` latents and ``VideoDecoder`` output (fp32 from the bf16 weights).

Every weight is seeded random (norm scales around 1, zero-initialised ones too). tests/models/
test_ltx2_encoders.py reads the fixtures; it never needs LTX-2's code.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import ltx2_reference as ref  # noqa: E402

WORDS = ("a", "red", "blue", "green", "circle", "square", "moves", "left", "right", "slowly", "the", "cat", "on",
         "camera", "pans", "over", "city", "at", "night", ".", ",")
CAPTIONS = ["The cat on the GREEN square , slowly . ü", "", " ".join(["a camera pans over the city at night ."] * 130)]
DIFFUSERS_CAPTIONS = 2   # diffusers' outputs are kept for the first two (the fixtures stay small)
GEMMA = dict(vocab_size=64, hidden_size=8, intermediate_size=16, num_hidden_layers=4, num_attention_heads=2,
             num_key_value_heads=1, head_dim=4, max_position_embeddings=2048, sliding_window=16,
             query_pre_attn_scalar=4, layer_types=["sliding_attention", "full_attention"] * 2)
CONNECTORS = {   # the release config's transformer keys of each version's text side
    "ltx2.0": dict(num_attention_heads=2, attention_head_dim=8, audio_num_attention_heads=2,
                   audio_attention_head_dim=4, connector_num_attention_heads=2, connector_attention_head_dim=4,
                   connector_num_layers=2, connector_positional_embedding_max_pos=[4096], rope_type="split",
                   frequencies_precision="float64"),
    "ltx2.3": dict(num_attention_heads=2, attention_head_dim=4, audio_num_attention_heads=2,
                   audio_attention_head_dim=2, connector_num_attention_heads=2, connector_attention_head_dim=4,
                   audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=2,
                   connector_num_layers=2, connector_apply_gated_attention=True,
                   connector_positional_embedding_max_pos=[4096], rope_type="split", frequencies_precision="float64",
                   caption_proj_before_connector=True, caption_projection_first_linear=False,
                   caption_proj_input_norm=False, caption_projection_second_linear=False),
}
_ENC = lambda m: [["res_x", {"num_layers": 1}], ["compress_space_res", {"multiplier": m[0]}],  # noqa: E731
                  ["res_x", {"num_layers": 1}], ["compress_time_res", {"multiplier": m[1]}],
                  ["res_x", {"num_layers": 1}], ["compress_all_res", {"multiplier": m[2]}],
                  ["res_x", {"num_layers": 1}], ["compress_all_res", {"multiplier": m[3]}],
                  ["res_x", {"num_layers": 1}]]
_COMMON = {"_class_name": "CausalVideoAutoencoder", "dims": 3, "in_channels": 3, "out_channels": 3,
           "latent_channels": 8, "patch_size": 4, "norm_layer": "pixel_norm", "latent_log_var": "uniform",
           "decoder_base_channels": 2, "causal_decoder": False, "timestep_conditioning": False}
VAES = {   # LTX-2.0's shape (3 spatiotemporal upsamplers) and LTX-2.3's (space, time, all, all)
    "ltx2.0": {**_COMMON, "encoder_blocks": _ENC((1, 1, 1, 1)),
               "decoder_blocks": [["res_x", {"num_layers": 1}], ["compress_all", {"multiplier": 2}],
                                  ["res_x", {"num_layers": 2}], ["compress_all", {"multiplier": 1}],
                                  ["res_x", {"num_layers": 1}], ["compress_all", {"multiplier": 2, "residual": True}],
                                  ["res_x", {"num_layers": 1}]]},
    "ltx2.3": {**_COMMON, "encoder_blocks": _ENC((1, 1, 1, 2)), "spatial_padding_mode": "zeros",
               "decoder_blocks": [["res_x", {"num_layers": 1}], ["compress_space", {"multiplier": 2}],
                                  ["res_x", {"num_layers": 1}], ["compress_time", {"multiplier": 2}],
                                  ["res_x", {"num_layers": 1}], ["compress_all", {"multiplier": 1, "residual": True}],
                                  ["res_x", {"num_layers": 1}], ["compress_all", {"multiplier": 2}],
                                  ["res_x", {"num_layers": 1}]]},
}


def randomise(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if not t.is_floating_point():
                continue
            fresh = torch.randn(t.shape, generator=g, dtype=torch.float32)
            if "norm" in name and name.endswith("weight"):
                fresh = 1.0 + 0.1 * fresh
            elif "std-of-means" in name or "latents_std" in name:
                fresh = 0.5 + fresh.abs()
            elif t.dim() >= 2:
                fresh = fresh / max(1, t[0].numel()) ** 0.5
            else:
                fresh = 0.1 * fresh
            t.copy_(fresh.to(t.dtype))


# ----------------------------------------------------------------------------- Gemma

def save_gemma(folder: Path) -> None:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
         "unk_token": "<unk>", "padding_side": "left", "model_max_length": 1024}, indent=2) + "\n")
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "Gemma3Processor"}) + "\n")
    config = Gemma3Config(text_config=GEMMA, vision_config=dict(hidden_size=8, intermediate_size=16,
                          num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14,
                          vision_use_head=False),
                          mm_tokens_per_image=4, image_token_index=60, boi_token_index=61, eoi_token_index=62)
    model = Gemma3ForConditionalGeneration(config)
    randomise(model, 1)
    model.save_pretrained(folder)
    (folder / "generation_config.json").unlink(missing_ok=True)
    # google/gemma-3-12b-it keeps its SigLIP tower under vision_tower.vision_model.* (transformers >= 5.8
    # saves it flattened); write it as downloaded, the layout ltx-core's key ops read
    weights = load_file(str(folder / "model.safetensors"))
    weights = {("vision_tower.vision_model." + k[len("vision_tower."):] if k.startswith("vision_tower.")
                and not k.startswith("vision_tower.vision_model.") else k): v for k, v in weights.items()}
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


def ltx_text(checkout: Path, gemma: Path, release: Path, captions: list[str]) -> dict:
    """ltx-core's text encoder pipeline, built as its pipelines build it (utils/blocks.py)."""
    ref.import_ltx_core(checkout)
    from ltx_core.loader.single_gpu_model_builder import SingleGPUModelBuilder as Builder
    from ltx_core.text_encoders.gemma import (EMBEDDINGS_PROCESSOR_KEY_OPS, EmbeddingsProcessorConfigurator,
                                              GemmaTextEncoderConfigurator, get_gemma_ops)
    from ltx_core.text_encoders.gemma.gemma_assets import resolve_gemma_weight_paths

    sd_ops, module_ops = get_gemma_ops(str(gemma))
    module_ops = tuple(op for op in module_ops if op.name != "ProcessorLoad")   # the prompt enhancer's only
    encoder = Builder(model_path=resolve_gemma_weight_paths(str(gemma)), model_sd_ops=sd_ops, module_ops=module_ops,
                      model_class_configurator=GemmaTextEncoderConfigurator.with_gemma_model_path(str(gemma)),
                      ).build(device=torch.device("cpu"), dtype=torch.float32).eval()
    processor = Builder(model_path=str(release), model_sd_ops=EMBEDDINGS_PROCESSOR_KEY_OPS,
                        model_class_configurator=EmbeddingsProcessorConfigurator.with_gemma_model_path(str(gemma)),
                        ).build(device=torch.device("cpu"), dtype=torch.float32).eval()
    with torch.no_grad():
        encoded = encoder.encode(captions)
        out = [processor.process_hidden_states(hidden, mask) for hidden, mask in encoded]
    tokens = [encoder.tokenizer.tokenize_with_weights(c)["gemma"] for c in captions]
    return {"video": torch.cat([o.video_encoding for o in out]), "audio": torch.cat([o.audio_encoding for o in out]),
            "mask": torch.cat([o.attention_mask for o in out]).bool(),
            "ids": torch.tensor([[int(t) for t, _ in row] for row in tokens]),
            "token_mask": torch.tensor([[int(w) for _, w in row] for row in tokens]).bool(),
            "hidden": torch.stack(encoded[0][0], dim=-1)}


def write_text_side(checkout: Path, version: str, file: Path, gemma_hidden: int, gemma_states: int,
                    extra: dict | None = None, vae_config: dict | None = None) -> dict[str, torch.Tensor]:
    """A release file's text side built by ltx-core's configurators, randomised."""
    ref.import_ltx_core(checkout)
    from ltx_core.text_encoders.gemma.embeddings_connector import (AudioEmbeddings1DConnectorConfigurator,
                                                                   Embeddings1DConnectorConfigurator)
    from ltx_core.text_encoders.gemma.encoders.encoder_configurator import _create_feature_extractor

    config = {"transformer": CONNECTORS[version], **({"vae": vae_config} if vae_config else {})}
    meta = {"config": config}
    text_config = type("TextConfig", (), {"hidden_size": gemma_hidden, "num_hidden_layers": gemma_states - 1})
    parts = {"model.diffusion_model.video_embeddings_connector.": Embeddings1DConnectorConfigurator.from_metadata(meta),
             "model.diffusion_model.audio_embeddings_connector.":
                 AudioEmbeddings1DConnectorConfigurator.from_metadata(meta),
             "text_embedding_projection.": _create_feature_extractor(CONNECTORS[version], text_config)}
    tensors = {}
    for i, (prefix, module) in enumerate(parts.items()):
        module.float()
        randomise(module, 10 + i)
        tensors.update({prefix + k: v.contiguous() for k, v in module.state_dict().items()})
    tensors.update(extra or {})
    file.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(file), metadata={"config": json.dumps(config)})
    return tensors


def diffusers_connectors(tensors: dict, version: str, gemma_hidden: int, gemma_states: int):
    """diffusers' LTX2TextConnectors holding the same tensors (renamed as its converter renames them)."""
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    c, v23 = CONNECTORS[version], version == "ltx2.3"
    model = LTX2TextConnectors(
        caption_channels=gemma_hidden, text_proj_in_factor=gemma_states,
        video_connector_num_attention_heads=c["connector_num_attention_heads"],
        video_connector_attention_head_dim=c["connector_attention_head_dim"],
        video_connector_num_layers=c["connector_num_layers"], video_connector_num_learnable_registers=128,
        video_gated_attn=v23, audio_connector_num_attention_heads=c.get("audio_connector_num_attention_heads", 2),
        audio_connector_attention_head_dim=c.get("audio_connector_attention_head_dim", 4),
        audio_connector_num_layers=c["connector_num_layers"], audio_connector_num_learnable_registers=128,
        audio_gated_attn=v23, connector_rope_base_seq_len=4096, rope_theta=10000.0, rope_double_precision=True,
        rope_type="split", per_modality_projections=v23, video_hidden_dim=8, audio_hidden_dim=4, proj_bias=v23)
    renamed = {}
    for key, value in tensors.items():
        if not key.startswith(("model.diffusion_model.", "text_embedding_projection.")):
            continue
        k = key.replace("model.diffusion_model.", "").replace("_embeddings_connector.", "_connector.")
        k = k.replace("transformer_1d_blocks", "transformer_blocks").replace("q_norm", "norm_q")
        k = k.replace("k_norm", "norm_k").replace("text_embedding_projection.aggregate_embed", "text_proj_in")
        k = k.replace("text_embedding_projection.video_aggregate_embed", "video_text_proj_in")
        k = k.replace("text_embedding_projection.audio_aggregate_embed", "audio_text_proj_in")
        renamed[k] = value
    model.load_state_dict(renamed, strict=True)
    return model.eval()


# ----------------------------------------------------------------------------- VAE

def ltx_vae(checkout: Path, config: dict, seed: int):
    """ltx-core's VideoEncoder / VideoDecoder of ``config``, weights rounded to bf16 (as the releases
    store them) and computing in fp32, and their tensors as a release file holds them."""
    ref.import_ltx_core(checkout)
    from ltx_core.model.video_vae.model_configurator import VideoDecoderConfigurator, VideoEncoderConfigurator
    meta = {"config": {"vae": config}}
    encoder, decoder = VideoEncoderConfigurator.from_metadata(meta), VideoDecoderConfigurator.from_metadata(meta)
    randomise(encoder, seed)
    randomise(decoder, seed + 1)
    decoder.per_channel_statistics.load_state_dict(encoder.per_channel_statistics.state_dict())
    with torch.no_grad():
        for t in [*encoder.parameters(), *encoder.buffers(), *decoder.parameters(), *decoder.buffers()]:
            if t.is_floating_point():
                t.copy_(t.to(torch.bfloat16).float())
    tensors = {f"vae.encoder.{k}": v for k, v in encoder.state_dict().items() if "per_channel" not in k}
    tensors.update({f"vae.decoder.{k}": v for k, v in decoder.state_dict().items() if "per_channel" not in k})
    stats = encoder.per_channel_statistics.state_dict()
    tensors.update({f"vae.per_channel_statistics.{k}": v for k, v in stats.items()})
    return encoder.eval(), decoder.eval(), {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", type=Path, help="a Lightricks/LTX-2 checkout")
    parser.add_argument("--out", type=Path, default=REPO / "tests/fixtures/ltx2_encoders")
    args = parser.parse_args()
    torch.manual_seed(0)
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    gemma = args.out / "gemma"
    save_gemma(gemma)
    hidden, states = GEMMA["hidden_size"], GEMMA["num_hidden_layers"] + 1

    cases, info = {}, {"captions": CAPTIONS, "commit": "400fd31", "versions": {}}
    # one 9-frame 64 x 64 clip for both VAEs, its values fp16-exact so that it is stored in half
    clip = (torch.rand(1, 3, 9, 64, 64, generator=torch.Generator().manual_seed(5)) * 2 - 1).half()
    cases["vae/clip"] = clip
    for version in CONNECTORS:
        file = args.out / version / "ltx-2-tiny.safetensors"
        encoder, decoder, vae_tensors = ltx_vae(args.checkout, VAES[version], 20 + len(info["versions"]))
        tensors = write_text_side(args.checkout, version, file, hidden, states, vae_tensors, VAES[version])
        with torch.no_grad():   # the clip's and its first frame's latents; decoded: 2.3 the clip, 2.0 one frame
            latents, first = encoder(clip.float()), encoder(clip[:, :, :1].float())
            decoded = decoder(latents if version == "ltx2.3" else first)
        cases[f"{version}/vae/latents"] = latents.contiguous()
        cases[f"{version}/vae/first_latents"] = first.contiguous()
        cases[f"{version}/vae/decoded"] = decoded.contiguous()
        if version == "ltx2.0":   # diffusers' own converter knows LTX-2.0's block layout
            from diffusers import AutoencoderKLLTX2Video
            from diffusers.loaders.single_file_utils import convert_ltx2_vae_to_diffusers

            from videodit.models.ltx2.vae import diffusers_config
            config = {k: v for k, v in diffusers_config(VAES[version], "fixture").items() if k != "_class_name"}
            dvae = AutoencoderKLLTX2Video(**config)
            dvae.load_state_dict({k: v.float() for k, v in convert_ltx2_vae_to_diffusers(dict(vae_tensors)).items()},
                                 strict=True)
            dvae.to(torch.bfloat16).save_pretrained(str(args.out / "vae"))
        out = ltx_text(args.checkout, gemma, file, CAPTIONS)
        for name in ("video", "audio", "mask"):
            cases[f"{version}/{name}"] = out[name].contiguous()
        cases["ids"], cases["token_mask"] = out["ids"].int(), out["token_mask"]
        ids, valid = out["ids"], out["token_mask"]   # ltx-core's tokens, for diffusers' connectors
        connectors = diffusers_connectors(tensors, version, hidden, states)
        from transformers import AutoModel
        model = AutoModel.from_pretrained(str(gemma), dtype=torch.float32).eval()
        with torch.no_grad():
            layers = model(input_ids=ids, attention_mask=valid.long(), output_hidden_states=True).hidden_states
            h = torch.stack(layers, -1)
            dv, da, _ = connectors(h.flatten(2), valid.long())
        n = DIFFUSERS_CAPTIONS
        cases[f"{version}/diffusers_video"] = dv[:n].contiguous()
        cases[f"{version}/diffusers_audio"] = da[:n].contiguous()
        info["versions"][version] = CONNECTORS[version]

    info["vae"] = VAES
    save_file(cases, str(args.out / "cases.safetensors"))
    (args.out / "cases.json").write_text(json.dumps(info, indent=2) + "\n")
    total = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"wrote {args.out} ({total / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
