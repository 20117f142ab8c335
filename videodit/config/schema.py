"""The one typed configuration schema: every option as a dataclass field with a default and
a one-line description (``help`` metadata) and, where it has them, its allowed values.

A leaf: it imports only the preset table (``model_presets.py``). Reading, overriding and validating a config is
``config/load.py``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from videodit.config.model_presets import MODEL_OPTION_DEFAULTS, MODEL_PRESETS



def opt(default: Any, help: str, **kw: Any) -> Any:
    """A config field: its default and the one-line description shown by ``config show``."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


# The most samples one batch may hold per GPU (train.batch_size, a bucket_config batch size). The
# largest Open-Sora 1.2 uses is 475 (144p images) and `videodit plan` searches up to 4,096; a
# per-GPU batch of 65,536 is already more than any model fits, while 10**30 overflows the
# sampler's int64 arrays (a traceback) or asks for its memory.
MAX_BATCH_SIZE = 1 << 16
# The largest LoRA rank: a rank above a layer's smaller side (in or out features) adds nothing
# a full update cannot, and no released video DiT has layers wider than this (Wan 2.1 14B: 5,120
# wide, FFN 13,824). The rank is checked against the adapted layers once the model is known
# (models/lora.py); this bound stops 1e9 before anything is built.
MAX_LORA_RANK = 1 << 16
# The default largest decoded frame (height x width): an 8192x8192 RGB frame is 200 MB; one of
# 16000x16000 would need ~12 GB by the time it is resized.
MAX_PIXELS = 16384 * 16384 // 4


@dataclass
class ModelConfig:
    preset: str = opt("tiny", "model geometry preset: tiny, S, B, XL or opensora-v1.2 (XL with Open-Sora 1.2's "
                      "options, for its weights) of the STDiT family; wan-tiny, wan2.1-t2v-1.3b, wan2.1-t2v-14b, "
                      "wan2.1-i2v-14b, wan2.2-ti2v-5b, wan2.2-t2v-a14b or wan2.2-i2v-a14b (one expert) of the Wan "
                      "family; mmdit-tiny, mmdit-S, opensora-v2 or opensora-v2-hc of the MMDiT family (Open-Sora "
                      "2.0); ltx2-tiny, ltx2-19b (LTX-2.0) or ltx2.3-22b (LTX-2.3) of the LTX-2 family; fields set "
                      "below override it", choices=tuple(MODEL_PRESETS))
    family: Optional[str] = opt(None, "model family: stdit (Open-Sora 1.2), wan (Wan 2.1), mmdit (Open-Sora 2.0) "
                                "or ltx2 (LTX-2) (default: the preset's; it must agree with the preset)",
                                choices=("stdit", "wan", "mmdit", "ltx2"))
    depth: Optional[int] = opt(None, "number of spatial+temporal block pairs (STDiT), blocks (Wan) or double-stream "
                               "blocks (MMDiT) (default: from preset)", min=1)
    hidden_size: Optional[int] = opt(None, "transformer width (default: from preset)", min=1)
    num_heads: Optional[int] = opt(None, "attention heads (default: from preset)", min=1)
    mlp_ratio: Optional[float] = opt(None, "MLP hidden size / width (default: from preset)", min=0.0)
    patch_size: Optional[list[int]] = opt(None, "3D patch (pt, ph, pw) over latents (default: from preset)",
                                          length=3, min=1)
    ffn_dim: Optional[int] = opt(None, "Wan: FFN hidden width (default: from preset)", min=1)
    task: Optional[str] = opt(None, "Wan: what the model is built for (Wan's model_type): t2v, i2v (36 input "
                              "channels: latent, a 4-channel mask of the given frames, their latents) or ti2v "
                              "(Wan 2.2 TI2V-5B: text or image to video, the image frame at time 0) (default: "
                              "from preset)", choices=("t2v", "i2v", "ti2v"))
    image_dim: Optional[int] = opt(None, "Wan 2.1 I2V: width of the CLIP image features its img_emb embeds "
                                   "(1280; default: from preset, none)", min=1)
    expert: Optional[str] = opt(None, "Wan 2.2 A14B (two experts split by timestep): high or low trains one "
                                "expert on its timesteps (diffusion.timestep_range follows from "
                                "model.expert_boundary; one 14B in memory), both trains the two in one run, "
                                "each step routed to the expert of its sampled time (two 14B in memory)",
                                choices=("high", "low", "both"))
    expert_boundary: Optional[float] = opt(None, "Wan 2.2 A14B: the shifted time t at which the high-noise expert "
                                           "takes over (T2V 0.875, I2V 0.9; default: from preset)", min=0.0, max=1.0)
    depth_single: Optional[int] = opt(None, "MMDiT: single-stream blocks after the model.depth double-stream ones "
                                      "(default: from preset)", min=0)
    axes_dim: Optional[list[int]] = opt(None, "MMDiT: head channels rotated by frame, row and column position (3 even "
                                        "sizes summing to the head size; default: from preset, else 1/8, 7/16, "
                                        "7/16 of the head as released)", length=3, min=2)
    vec_in_dim: Optional[int] = opt(None, "MMDiT: width of the pooled caption vector it embeds (CLIP-L: 768; "
                                    "default: from preset)", min=1)
    cond_embed: Optional[bool] = opt(None, "MMDiT: take the given frames' mask and latents as input channels "
                                     "(Open-Sora 2.0's cond_in; default: from preset, on)")
    qk_norm: bool = opt(True, "RMS-normalise queries and keys in self-attention")
    pos_base_grid: int = opt(16, "patch grid side at which spatial positions span their base range")
    temporal_pos_embed: bool = opt(False, "add an absolute sin/cos frame-index embedding (STDiT3 has only "
                                   "temporal RoPE)")
    pooled_caption: bool = opt(False, "add the mean caption embedding (through a small MLP) to the timestep "
                               "embedding, so the caption also drives adaLN (PixArt/SD3)")
    position_embedding: Optional[str] = opt(None, "2D position table: videodit (from the patch grid) or opensora "
                                            "(Open-Sora 1.2's, from the clip's pixel size) (default: from preset)",
                                            choices=("videodit", "opensora"))
    null_caption_mask: Optional[str] = opt(None, "tokens of the CFG null caption attended to: full (all) or prompt "
                                           "(under the prompt's mask, as Open-Sora) (default: from preset)",
                                           choices=("full", "prompt"))
    bf16_timesteps: Optional[bool] = opt(None, "round t*1000 to bf16 before the timestep embedding, as Open-Sora "
                                         "does in bf16 (its weights were trained so) (default: from preset)")
    freeze_null_caption: Optional[bool] = opt(None, "never train the null caption (Open-Sora's is a fixed buffer) "
                                              "(default: from preset)")
    freeze_caption_embedder: bool = opt(False, "never train the caption projection nor the null caption "
                                        "(Open-Sora's freeze_y_embedder)")
    train_audio: bool = opt(False, "LTX-2: train the audio stream too (its own sigma, noise and loss beside the "
                            "video's, as ltx-trainer's flexible strategy; needs audio.kind and a soundtrack per clip, "
                            "silence without one); false trains the video stream alone, the audio stream frozen")
    audio_channels: Optional[int] = opt(None, "LTX-2: width of the audio stream's input tokens, the audio VAE's "
                                        "latent channels x latent mel bins (default: from preset; the releases' 128)",
                                        min=1)
    init_from: Optional[str] = opt(None, "start from these weights (a checkpoint or an exported model folder; its "
                                   "EMA weights if it has them): weights only, with a fresh optimizer, data "
                                   "position and step, unlike resume")

    def resolved(self) -> "ModelConfig":
        """A copy with every preset-derived field filled in."""
        preset = {**MODEL_OPTION_DEFAULTS, **MODEL_PRESETS[self.preset]}
        filled = {k: (v if v is not None else preset.get(k)) for k, v in dataclasses.asdict(self).items()}
        filled["family"] = preset["family"] if self.family is None else self.family   # checked in load.py
        return ModelConfig(**filled)

    @property
    def preset_family(self) -> str:
        return {**MODEL_OPTION_DEFAULTS, **MODEL_PRESETS[self.preset]}["family"]


@dataclass
class DiffusionConfig:
    timestep_sampling: str = opt("logit_normal", "training timestep distribution",
                                 choices=("logit_normal", "uniform"))
    logit_mean: float = opt(0.0, "mean of the logit-normal timestep distribution")
    logit_std: float = opt(1.0, "std of the logit-normal timestep distribution", min=0.0)
    shift: bool = opt(True, "resolution- and length-dependent timestep shift (Open-Sora 1.2)")
    shift_base_pixels: int = opt(512 * 512, "H*W (pixels) at which the spatial shift ratio is 1", min=1)
    shift_base_frames: int = opt(1, "latent frames at which the temporal shift ratio is 1", min=1)
    shift_scale: float = opt(1.0, "extra multiplier on the shift ratio", min=0.0)
    constant_shift: Optional[float] = opt(None, "one timestep shift k for every clip (t' = k t / (1 + (k-1) t)), "
                                          "as Wan trains and samples (5 for text-to-video); replaces the "
                                          "resolution- and length-dependent one", min=0.0)
    shift_rule: str = opt("opensora1.2", "the resolution- and length-dependent shift: opensora1.2 (sqrt of pixels "
                          "and latent frames over shift_base_*, times shift_scale) or opensora2 (Open-Sora 2.0: a line "
                          "through (256 tokens per latent frame, 1) and (4096, 3), times sqrt(latent frames))",
                          choices=("opensora1.2", "opensora2"))
    sigma_min: float = opt(0.0, "noise floor of the objective: x_t = (1-t) x0 + (1 - (1-sigma_min)(1-t)) noise, "
                           "target (1-sigma_min) noise - x0 (Open-Sora 2.0: 1e-5; 0: plain rectified flow)",
                           min=0.0, max=0.5)
    prediction: str = opt("velocity", "what the model outputs: velocity (Open-Sora) or data (x0, turned "
                          "into a velocity; learns faster in pixel space)", choices=("velocity", "data"))
    loss_space: str = opt("velocity", "where the MSE is taken: velocity (Open-Sora) or data (the x0 error, "
                          "i.e. the velocity error weighted by t^2, so high-noise steps that decide layout "
                          "and motion are not drowned by low-noise ones)", choices=("velocity", "data"))
    timestep_range: Optional[list[float]] = opt(None, "[lo, hi]: train only on timesteps lo <= t <= hi (after the shift), "
                                               "drawn from the same distribution restricted to the range, as one "
                                               "expert of Wan 2.2 A14B trains (high: [0.875, 1], low: [0, 0.875])",
                                               length=2, min=0.0, max=1.0)
    caption_dropout: float = opt(0.1, "probability of training on the null caption (enables CFG)",
                                 min=0.0, max=1.0)
    pooled_caption_dropout: Optional[float] = opt(None, "a text encoder with a pooled vector (text.kind=t5-clip): "
                                                  "the probability of replacing that vector by the empty caption's, "
                                                  "drawn apart from caption_dropout's (which replaces the tokens by "
                                                  "the empty caption's) as Open-Sora 2.0 does (0.31622777 each); "
                                                  "null: caption_dropout", min=0.0, max=1.0)
    mask_ratios: Optional[dict] = opt(None, "image/video conditioning as Open-Sora 1.2 trains it: mask kind -> "
                                      "probability (random, intepolate, quarter_head, image_head, ...; the rest "
                                      "is identity); given frames stay clean and out of the loss")
    condition_config: Optional[dict] = opt(None, "image/video conditioning as Open-Sora 2.0 trains it, written as in "
                                           "its configs: mode -> weight (t2v, i2v_head, i2v_tail, i2v_loop, v2v_head, "
                                           "v2v_tail, v2v_head_easy, v2v_tail_easy), one mode drawn per sample; the "
                                           "model gets cat(mask, masked latents) as input channels (model.cond_embed)")
    no_i2v_ref_loss: bool = opt(False, "with condition_config: leave the given first/last latent frame of the "
                                "i2v modes out of the loss (what Open-Sora 2.0's flag means; its own trainer never "
                                "hands the masks to the loss, so there it changes nothing)")
    first_frame_p: float = opt(0.0, "LTX-2 (model.family=ltx2): probability that a training clip's first latent frame "
                               "is given clean at sigma 0 and left out of the loss, as LTX's image-to-video training "
                               "does (its i2v recipes: 0.5; 0: text-to-video)", min=0.0, max=1.0)
    stg_scale: float = opt(1.0, "LTX-2's sampler: spatio-temporal guidance, the prompt's branch with one block's video "
                           "self-attention skipped (its dev default 1; 0: off, one model call less per step)", min=0.0)
    stg_block: Optional[int] = opt(None, "LTX-2's sampler: the block STG skips (default: the release's, 29 in LTX-2.0 "
                                   "and 28 in 2.3, at the same relative depth in a model of fewer blocks)", min=0)
    guidance_rescale: float = opt(0.7, "LTX-2's sampler: the guided estimate rescaled towards the prompt branch's "
                                  "standard deviation by this much (its dev default 0.7; 0: off)", min=0.0, max=1.0)


@dataclass
class DataConfig:
    csv: str = opt("videodit-toy/train.csv", "training metadata CSV (Open-Sora columns)")
    make_toy_if_missing: bool = opt(False, "generate the toy dataset if data.csv is a missing train.csv in a "
                                    "videodit-toy* folder (the toy presets' own path)")
    num_frames: int = opt(8, "frames per training clip (1 = images)", min=1)
    frame_interval: int = opt(1, "take every n-th frame of the source clip", min=1)
    height: int = opt(32, "training height in pixels", min=1)
    width: int = opt(32, "training width in pixels", min=1)
    num_workers: int = opt(0, "DataLoader worker processes", min=0)
    bucket_config: Optional[dict] = opt(None, "Open-Sora bucket_config: resolution -> num_frames -> "
                                        "[keep_prob or [p_keep, p_frames], batch_size]; see docs/buckets.md")
    bucket_config_file: Optional[str] = opt(None, "read bucket_config from an Open-Sora .py config "
                                            "(never executed) or a YAML file")
    bad_rows: str = opt("skip", "invalid CSV rows: skip them (counted) or error", choices=("skip", "error"))
    metadata_cache: Optional[str] = opt("auto", "folder for the checked, memory-mapped copy of data.csv that "
                                        "the ranks of a node share: auto (~/.cache/videodit/metadata, for files "
                                        "of 64 MiB or more), a folder, or null (each process reads its own)")
    max_pixels: int = opt(MAX_PIXELS, "largest decoded frame (height x width) a clip or image may have: "
                          "larger ones are skipped and reported like unreadable files, before their frames are "
                          "decoded (a crafted 16000x16000 clip would need ~12 GB)", min=1)
    max_audio_seconds: float = opt(60.0, "longest soundtrack window one sample may decode, in seconds (audio "
                                   "training): a longer one is skipped and reported like an unreadable file; "
                                   "only the window is decoded, however long the soundtrack", min=0.0)
    max_audio_sample_rate: int = opt(96_000, "highest soundtrack sample rate in Hz (audio training): a higher one "
                                     "(e.g. 192 kHz) is skipped and reported like an unreadable file", min=1)
    max_audio_channels: int = opt(8, "most soundtrack channels (audio training; 7.1 is 8): more are skipped and "
                                  "reported like an unreadable file", min=1)
    decoder: str = opt("auto", "video decoder of training and videodit cache build: auto (torchcodec where it loads, else "
                       "PyAV), pyav, or torchcodec (pip install videodit[torchcodec], plus FFmpeg 4-8 shared "
                       "libraries); both give the same frames, and files torchcodec cannot read exactly are read by "
                       "PyAV",
                       choices=("auto", "pyav", "torchcodec"))
    decode_device: str = opt("cpu", "where videos are decoded: cpu, or cuda (torchcodec's NVDEC on the GPU; not "
                             "with data.decoder=pyav)", choices=("cpu", "cuda"))
    max_bad_fraction: float = opt(0.05, "stop when more than this fraction of file reads fail",
                                  min=0.0, max=1.0)
    on_change: str = opt("error", "on resume with a changed dataset or bucket config: error or "
                         "restart_epoch", choices=("error", "restart_epoch"))
    caption_suffix: str = opt("none", "what is appended to each training caption: none, or opensora2 (Open-Sora 2.0's "
                              "' {fps} FPS, {motion} motion score.': the fps of the frames the model sees, the "
                              "CSV's score_vmafmotion rounded; either part left out where unknown)",
                              choices=("none", "opensora2"))
    cache: Optional[str] = opt(None, "feature cache folder (videodit cache build): train on its stored latents and "
                               "caption embeddings; no VAE or text encoder is built, data.csv is not read")


@dataclass
class ToyConfig:
    clips_per_combination: int = opt(10, "toy clips per seen (colour, shape, direction)", min=1)
    num_frames: int = opt(16, "frames per toy clip", min=1)
    sizes: list[list[int]] = opt([[32, 32]], "[height, width] of toy clips, cycled (even numbers)")
    image_fraction: float = opt(0.0, "fraction of training clips written as still images", min=0.0, max=1.0)
    fps: int = opt(8, "toy clip frame rate", min=1)


WEIGHT_FREE_VAE_KINDS = ("identity", "space-to-depth")   # built from nothing: vae.path is ignored


@dataclass
class VAEConfig:
    kind: str = opt("identity", "identity (pixels as latents), space-to-depth (pixels folded 4x4 into 48 "
                    "channels: the toy's stand-in for a VAE, for LTX-2's 1x1 patch), diffusers (local folder), opensora-v1.2 "
                    "(Open-Sora 1.2's VAE folder, hpcai-tech/OpenSora-VAE-v1.2), wan2.1 (Wan 2.1's VAE: a "
                    "diffusers vae/ folder or Wan2.1_VAE.pth, per-channel normalised) or wan2.2 (Wan 2.2 "
                    "TI2V-5B's VAE: a diffusers vae/ folder or Wan2.2_VAE.pth; 48 channels, 16x space), hunyuan "
                    "(Open-Sora 2.0's HunyuanVideo VAE: hunyuan_vae.safetensors or a diffusers vae/ folder; 16 "
                    "channels, 4x8x8, causal) or opensora-dc-ae (Open-Sora 2.0's Video DC-AE, "
                    "F32T4C128_AE.safetensors; 128 channels, 4x32x32) or ltx2 (LTX-2's video VAE: the release file or a "
                    "diffusers AutoencoderKLLTX2Video folder; 128 channels, 8x32x32, causal, 8k+1 frames)",
                    choices=("identity", "space-to-depth", "diffusers", "opensora-v1.2", "wan2.1", "wan2.2", "hunyuan", "opensora-dc-ae",
                             "ltx2"))
    path: Optional[str] = opt(None, "local autoencoder folder or file (vae.kind=diffusers, opensora-v1.2, "
                              "wan2.1, wan2.2, hunyuan, opensora-dc-ae, ltx2)")
    subfolder: Optional[str] = opt(None, "subfolder of vae.path holding the autoencoder")
    scaling_factor: Optional[float] = opt(None, "latent scale (default: the model's own config; not for "
                                          "opensora-v1.2, which uses its checkpoint's shift and scale; hunyuan: "
                                          "0.476986, multiplied; opensora-dc-ae: 0.493, divided by, as Open-Sora "
                                          "writes it)")
    sample_posterior: bool = opt(False, "vae.kind=hunyuan: training encodes to a sample of the posterior (mean + "
                                 "std * noise, seeded by the batch) instead of its mode; Open-Sora 2.0 trains on "
                                 "samples (its encode's default); validation, cache build and sampling keep the mode")
    micro_batch: int = opt(16, "frames per pass of a per-frame VAE (opensora-v1.2: of its SD-VAE)", min=1)
    temporal_micro_batch: int = opt(4, "17-frame pieces per pass of Open-Sora 1.2's temporal VAE (pieces of "
                                    "all clips in a batch are encoded together; vae.kind=opensora-v1.2)", min=1)
    dtype: str = opt("fp32", "weights and compute of a pretrained VAE: bf16 halves its weights' memory (Open-Sora "
                     "1.2 runs its VAE in bf16; bf16 runs on a GPU encode under autocast either way); latents "
                     "come out in fp32",
                     choices=("fp32", "bf16", "fp16"))


@dataclass
class TextConfig:
    kind: str = opt("toy", "toy (built-in toy vocabulary), transformers (local folder), umt5 (Wan's umT5-XXL: "
                    "text_encoder/ + tokenizer/ of a diffusers Wan folder; run with its mask, zero-padded) or t5-clip "
                    "(Open-Sora 2.0's T5-XXL tokens and CLIP-L pooled vector) or gemma3-ltx2 (LTX-2's Gemma 3 + its "
                    "release's text connectors; text.max_length=1024)",
                    choices=("toy", "transformers", "umt5", "t5-clip", "gemma3-ltx2"))
    path: Optional[str] = opt(None, "local transformers encoder folder (text.kind=transformers or umt5); t5-clip: a "
                              "folder holding t5/ and clip/, or Open-Sora 2.0's ckpts/ download (google/t5-v1_1-xxl/ "
                              "and openai/clip-vit-large-patch14/); gemma3-ltx2: a folder holding the LTX-2 release file and Gemma 3 in "
                              "gemma/ (or text_encoder/ + tokenizer/)")
    mask: bool = opt(True, "t5-clip: run T5 with its attention mask and mask the padded tokens in the model; false "
                     "is Open-Sora 2.0's way (no mask: the pads carry features and the model attends to all "
                     "max_length tokens)")
    max_length: int = opt(8, "caption tokens (padded / truncated)", min=1)
    dim: int = opt(64, "embedding width of the toy encoder", min=1)
    dtype: str = opt("fp32", "weights and compute of a transformers encoder: bf16 halves T5-XXL (9.5 GB instead "
                     "of 19; Open-Sora encodes in bf16); embeddings come out in fp32 either way",
                     choices=("fp32", "bf16", "fp16"))


@dataclass
class AudioConfig:
    kind: str = opt("none", "the frozen audio VAE of audio training (model.train_audio): none, ltx2 (LTX-2's "
                    "audio VAE: the release file or a diffusers LTX-2 folder with audio_vae/) or toy (weight-free: the "
                    "mel folded into tokens, vocoded by additive synthesis; the toy world's)",
                    choices=("none", "ltx2", "toy"))
    path: Optional[str] = opt(None, "audio.kind=ltx2: the LTX-2 release file (ltx-2-19b-* / ltx-2.3-22b-*) or a "
                              "diffusers LTX-2 folder (audio_vae/ and vocoder/)")
    subfolder: Optional[str] = opt(None, "subfolder of audio.path holding the audio VAE")
    dtype: str = opt("fp32", "weights and compute of the audio VAE (ltx-trainer encodes in fp32); latents come out "
                     "in fp32", choices=("fp32", "bf16", "fp16"))


@dataclass
class ImageEncoderConfig:
    path: Optional[str] = opt(None, "Wan 2.1 I2V (model.image_dim): its CLIP image encoder, a diffusers Wan I2V "
                              "folder (image_encoder/ inside), that image_encoder/ folder, or Wan's download (its "
                              "models_clip_*.pth, read without unpickling code)")
    dtype: str = opt("fp32", "weights and compute of the image encoder (Wan runs it in fp16 on GPUs); features come "
                     "out in fp32 either way", choices=("fp32", "bf16", "fp16"))


@dataclass
class TrainConfig:
    max_steps: int = opt(1000, "optimizer steps to train", min=0)
    seed: int = opt(0, "seed for initialisation, data order, noise and timesteps")
    batch_size: int = opt(16, "samples per micro-batch", min=1, max=MAX_BATCH_SIZE)
    grad_accum: int = opt(1, "micro-batches per optimizer step", min=1)
    lr: float = opt(3e-4, "peak AdamW learning rate", min=0.0)
    weight_decay: float = opt(0.0, "AdamW weight decay", min=0.0)
    optimizer: str = opt("adamw", "adamw (fp32 moments: 8 bytes per trained parameter) or adamw8bit (torchao's 8-bit "
                         "moments with a scale per 256 values: about 2 bytes; pip install videodit[lowmem])",
                         choices=("adamw", "adamw8bit"))
    betas: list[float] = opt([0.9, 0.999], "AdamW betas", length=2, min=0.0, max=1.0)
    warmup_steps: int = opt(100, "linear LR warm-up steps", min=0)
    grad_clip: float = opt(1.0, "max global gradient norm (0 disables clipping)", min=0.0)
    ema_decay: float = opt(0.99, "EMA decay per step (0 disables EMA)", min=0.0, max=1.0)
    precision: str = opt("auto", "auto (bf16 autocast on GPU, fp32 on CPU), fp32 or bf16",
                         choices=("auto", "fp32", "bf16"))
    device: str = opt("auto", "auto, cpu or cuda", choices=("auto", "cpu", "cuda"))
    threads: int = opt(0, "torch CPU threads (0 = torch default)", min=0)
    deterministic: bool = opt(False, "use deterministic algorithms (bitwise-reproducible on CPU)")
    log_every: int = opt(10, "steps between metrics lines", min=1)
    sample_every: int = opt(0, "steps between sample videos (0 = only at the end)", min=0)
    loggers: list[str] = opt(["tensorboard", "jsonl"], "where metrics and sample videos go: tensorboard, jsonl, "
                             "wandb (Weights & Biases: pip install videodit[wandb]; WANDB_MODE=offline works "
                             "without network); jsonl (metrics.jsonl) is always on, listed or not",
                             choices=("tensorboard", "jsonl", "wandb"))
    peak_tflops: float = opt(0.0, "the device's dense bf16 peak in TFLOP/s for MFU (0 = from a table of common "
                             "GPUs: H100, H200, A100, L40S, RTX 4090; none on CPU)", min=0.0)
    on_nonfinite: str = opt("stop", "a step whose loss or gradient norm is NaN/inf: stop the run (no update, no "
                            "checkpoint of it) or skip the update (counted in metrics as skipped_steps)",
                            choices=("stop", "skip"))
    compile: bool = opt(False, "torch.compile every transformer block (regional compilation, as torchtitan): "
                        "composes with activation checkpointing, DDP, FSDP2/HSDP, SP and PP, not TP; recompiles "
                        "are logged in metrics as recompiles")
    compile_dynamic: str = opt("auto", "shapes of compiled blocks: auto (dynamic batch, frames and positions when "
                               "the data has several bucket shapes, else static), dynamic (always), static (one "
                               "graph per bucket shape: for a few buckets)", choices=("auto", "dynamic", "static"))
    compile_backend: str = opt("inductor", "torch.compile backend: inductor (generated kernels), aot_eager "
                               "(tracing only, for debugging; no speed-up)",
                               choices=("inductor", "aot_eager", "eager"))
    fp8: bool = opt(False, "fp8 compute: the linear layers of every block (attention, MLP) run their matmuls in "
                    "float8 with per-tensor scales (torchao, pip install videodit[lowmem]); CUDA compute capability "
                    ">= 8.9 (emulated on CPU); with FSDP2 the weights are all-gathered in float8; fastest with "
                    "train.compile; not with LoRA or parallel.tp")


@dataclass
class MemoryConfig:
    checkpointing: str = opt("none", "activation checkpointing of transformer blocks: none, full (keep only each "
                             "block's input, recompute the rest) or selective (keep matmul and attention "
                             "outputs, recompute norms, modulation and activations)",
                             choices=("none", "full", "selective"))
    checkpoint_every: int = opt(1, "checkpoint every n-th block (1 = every block)", min=1)
    checkpoint_fraction: float = opt(1.0, "checkpoint this fraction of the blocks, the first ones (after "
                                     "checkpoint_every)", min=0.0, max=1.0)
    offload: bool = opt(False, "copy tensors saved for backward in blocks that are not checkpointed, and the token "
                        "input each checkpointed block keeps for its recompute, to pinned host memory on a side "
                        "stream, and back in backward (CUDA; a no-op on CPU)")
    compression: str = opt("none", "store floating-point tensors saved for backward in blocks that are not "
                           "checkpointed as bf16 or fp8 (e4m3, per-tensor scale): lossy, less memory",
                           choices=("none", "bf16", "fp8"))
    swap_blocks: int = opt(0, "keep the frozen weights of the first K repeated blocks (per expert) in pinned host "
                           "memory and copy each to the GPU only for its forward and backward, on a side stream "
                           "(0 = off; LoRA only; not with FSDP sharding, tp or pp)", min=0)
    checkpoint_blocks: Optional[dict] = opt(None, "checkpoint the first n blocks of each kind instead of "
                                            "checkpoint_every/fraction: block kind -> n (MMDiT: {double: 8, single: "
                                            "100}, Open-Sora 2.0's grad_ckpt_settings; n may exceed the count; kinds "
                                            "left out: none)")

    def checkpointed_blocks(self, num_blocks: int, kinds: Optional[list[str]] = None) -> list[int]:
        """Indices of the checkpointed blocks: every ``checkpoint_every``-th, then the first
        ``checkpoint_fraction`` of those (none without checkpointing); with ``checkpoint_blocks``,
        the first n of each kind, ``kinds`` giving each block's."""
        if self.checkpointing == "none":
            return []
        if self.checkpoint_blocks is not None:
            if kinds is None or len(kinds) != num_blocks:
                raise ValueError("memory.checkpoint_blocks counts blocks by kind: pass the kind of every block")
            chosen, seen = [], {}
            for i, kind in enumerate(kinds):
                seen[kind] = seen.get(kind, 0) + 1
                if seen[kind] <= self.checkpoint_blocks.get(kind, 0):
                    chosen.append(i)
            return chosen
        candidates = list(range(0, num_blocks, self.checkpoint_every))
        return candidates[: math.ceil(len(candidates) * self.checkpoint_fraction - 1e-9)]


# What LoRA adapts by default, per model family: every block's self-attention projections and
# its MLP (module paths inside each block; see models/lora.py). Wan's are its original names.
LORA_TARGETS = {"stdit": ["attn.q", "attn.k", "attn.v", "attn.proj", "mlp.fc1", "mlp.fc2"],
                "wan": ["self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "ffn.0", "ffn.2"],
                # MMDiT: the double blocks' image and text projections, the single blocks' (Open-Sora 2.0
                # applies PEFT to "double/single blocks" and ships no list)
                "mmdit": ["img_attn.q_proj", "img_attn.k_proj", "img_attn.v_proj", "img_attn.proj",
                          "txt_attn.q_proj", "txt_attn.k_proj", "txt_attn.v_proj", "txt_attn.proj",
                          "img_mlp.0", "img_mlp.2", "txt_mlp.0", "txt_mlp.2",
                          "q_proj", "k_proj", "v_mlp", "linear2"],
                # LTX-2: LTX's trainer's to_q/to_k/to_v/to_out.0, on the video stream's self- and text
                # attentions (LORA_AUDIO_TARGETS join them when the audio stream trains)
                "ltx2": [f"{attention}.{projection}" for attention in ("attn1", "attn2")
                         for projection in ("to_q", "to_k", "to_v", "to_out.0")]}
# With model.train_audio: the audio stream's attentions and the cross-modal ones, as ltx-trainer's
# audio-video LoRA adapts every attention's to_q/to_k/to_v/to_out.0.
LORA_AUDIO_TARGETS = {"ltx2": [f"{attention}.{projection}" for attention in
                               ("audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")
                               for projection in ("to_q", "to_k", "to_v", "to_out.0")]}


@dataclass
class LoraConfig:
    rank: int = opt(0, "LoRA rank (0 = off: full fine-tuning); >0 trains low-rank adapters (peft) on a frozen base "
                    "given by model.init_from; checkpoints then hold only the adapters; at most the smaller side "
                    "of every adapted layer", min=0, max=MAX_LORA_RANK)
    alpha: Optional[float] = opt(None, "LoRA scale numerator, > 0: adapter outputs are scaled by alpha/rank "
                                 "(default: the rank, i.e. scale 1)", above=0.0,
                                 above_why="adapter outputs are scaled by alpha/rank: 0 trains adapters that change "
                                           "nothing; leave it unset for alpha = rank")
    dropout: float = opt(0.0, "dropout on the adapters' inputs", min=0.0, max=1.0)
    targets: Optional[list[str]] = opt(None, "Linear layers that get adapters: a path inside every block (attn.q, "
                                       "cross_attn.k, mlp.fc1, ...; Wan: self_attn.q, ffn.0, ... or diffusers' "
                                       "attn1.to_q, ffn.net.0.proj, ...) or a full module path (t_block.1) "
                                       "(default: the family's self-attention and MLP; LTX-2's attentions, with "
                                       "model.train_audio its audio and cross-modal ones too)", nonempty=True)
    base_dtype: str = opt("auto", "how the frozen base is held: auto (bf16 when training in bf16, else as loaded), "
                          "bf16, or fp8 (block Linear weights as float8 e4m3 with a power-of-two scale per output "
                          "row, upcast per layer at compute time; norms, biases, embedders and head as auto)",
                          choices=("auto", "bf16", "fp8"))


@dataclass
class DistillConfig:
    method: Optional[str] = opt(None, "few-step distillation (docs/distillation.md): dmd2 (DMD2: the trained model is "
                                "the student, a critic learns its samples' score, the frozen teacher gives the real "
                                "one) or trajectory (the student regresses the guided teacher's ODE endpoint at its "
                                "steps); null: ordinary flow-matching training", choices=("dmd2", "trajectory"))
    teacher: Optional[str] = opt(None, "the model to distil (a checkpoint or exported folder, as model.init_from); "
                                 "student and critic start from it (default: model.init_from)")
    steps: list[int] = opt([1000, 750, 500, 250], "the student's timesteps on the 1000-grid, from noise down, each "
                           "warped by distill.shift (lightx2v's and Self-Forcing's denoising_step_list)", nonempty=True,
                           min=1, max=1000)
    shift: float = opt(5.0, "the warp of distill.steps, t -> shift*t / (1 + (shift-1)*t) (Wan's students: 5)",
                       above=0.0)
    teacher_substeps: int = opt(8, "trajectory: the teacher's guided Euler steps between successive student steps "
                                "(4 student steps x 8 = a 32-step teacher trajectory)", min=1, max=1000)
    trajectories: Optional[str] = opt(None, "trajectory: a folder of the teacher's trajectories computed once by "
                                      "`videodit distill trajectories CONFIG --out DIR`, regressed on in place of "
                                      "the batches' samples; null: the teacher runs within each step")
    renoise: bool = opt(True, "the student's sampler starts each step from its x0 with fresh noise (LCM-style, as "
                        "trained); false: Euler steps along the ODE")
    teacher_cfg: float = opt(4.0, "the teacher's guidance in the Ho-Salimans form, uncond + w (cond - uncond); "
                             "DMD2/Self-Forcing write w - 1 (their 3 is this 4)", min=0.0)
    generator_every: int = opt(5, "the student updates on every n-th step (steps 0, n, 2n, ...); the critic on "
                               "every step (DMD2's dfake_gen_update_ratio)", min=1)
    critic_lr: Optional[float] = opt(None, "the critic's learning rate (default: train.lr)", min=0.0)
    critic_betas: list[float] = opt([0.0, 0.999], "the critic's AdamW betas (DMD2: beta1 0; set train.betas the "
                                    "same for the student)", length=2, min=0.0, max=1.0)
    score_t_range: list[float] = opt([0.02, 0.98], "the range of the timesteps at which teacher and critic score "
                                     "the student's samples (uniform, warped by distill.shift, clamped)", length=2,
                                     min=0.0, max=1.0)
    normaliser: str = opt("sample", "the DMD gradient's normaliser mean|x0 - x0_teacher|: per sample (Self-Forcing, "
                          "DMD2) or over the batch (FastVideo)", choices=("sample", "batch"))
    rollout: str = opt("simulate", "the student's input: simulate (data-free: noise run through the student's "
                       "earlier steps, from captions only) or data (the batch's latents noised to the step)",
                       choices=("simulate", "data"))


@dataclass
class ParallelConfig:
    dp_replicate: int = opt(1, "data-parallel replicas: DDP, or the replicate axis of HSDP", min=1)
    dp_shard: int = opt(-1, "FSDP2 shard group size (-1 = every rank left over, 1 = no sharding)", min=-1)
    sp: int = opt(1, "sequence-parallel group size (Open-Sora: sp_size)", min=1)
    sp_ring: int = opt(1, "full-attention families (Wan): ring-attention degree within parallel.sp; the rest is "
                       "Ulysses (heads): sp = ulysses x sp_ring (1: Ulysses only; sp: ring only)", min=1)
    tp: int = opt(1, "tensor-parallel group size (Open-Sora: tp_size)", min=1)
    pp: int = opt(1, "pipeline-parallel stages (Open-Sora: pp_size)", min=1)
    pp_schedule: str = opt("1f1b", "pipeline schedule", choices=("gpipe", "1f1b", "interleaved_1f1b"))
    pp_microbatches: int = opt(0, "micro-batches per pipeline step; every bucket batch size must be a multiple "
                               "(0 = the number of stages)", min=0)
    pp_stages_per_rank: int = opt(0, "pipeline stages per rank (0 = 2 for interleaved_1f1b, else 1)", min=0)
    pp_split: str = opt("even", "how blocks are cut into stages: even (by count) or cost (balanced FLOPs at the "
                        "data's base bucket)", choices=("even", "cost"))
    reshard_after_forward: bool = opt(True, "FSDP: free gathered weights after forward (ZeRO-3); false keeps "
                                      "them for backward (ZeRO-2-like, more memory, less traffic)")
    cpu_offload: bool = opt(False, "FSDP: keep sharded weights, gradients and optimizer state in host memory")
    timeout_minutes: float = opt(10.0, "how long a collective may wait for a stuck rank before the job ends",
                                 min=0.1)


# Open-Sora's parallel options and where they land (documented in docs/parallelism.md).
PARALLEL_ALIASES = {"sp_size": "sp", "tp_size": "tp", "pp_size": "pp"}
ZERO_STAGES = {0: dict(dp_shard=1), 1: dict(reshard_after_forward=False), 2: dict(reshard_after_forward=False),
               3: dict(reshard_after_forward=True)}


@dataclass
class CheckpointConfig:
    every_steps: int = opt(500, "steps between checkpoints (0 = only at the end)", min=0)
    every_minutes: float = opt(0.0, "also save when this many minutes passed since the last save (0 = off)",
                               min=0.0)
    save_total_limit: int = opt(0, "keep only the newest K checkpoints (0 = keep all); best ones are kept apart",
                                min=0)
    keep_best: int = opt(0, "also keep the best N checkpoints by checkpoint.metric", min=0)
    metric: str = opt("val_loss", "metric that ranks checkpoints for keep_best")
    mode: str = opt("min", "whether a smaller (min) or larger (max) metric is better", choices=("min", "max"))
    async_save: bool = opt(False, "write checkpoints in a background thread (one in flight at most)")
    on_config_change: str = opt("error", "on resume with a changed config: error or continue",
                                choices=("error", "continue"))


@dataclass
class ValidationConfig:
    csv: Optional[str] = opt(None, "held-out metadata CSV for the validation loss (none = no validation)")
    every_steps: int = opt(0, "steps between validations (0 = at every checkpoint)", min=0)
    num_timesteps: int = opt(10, "evenly spaced timesteps the loss is averaged over", min=1)
    max_samples: int = opt(256, "validation samples used at most", min=1)


@dataclass
class SampleConfig:
    prompts: list[str] = opt(["a red circle moving right", "a blue square moving up"],
                             "prompts for the periodic training samples", nonempty=True)
    num_frames: Optional[int] = opt(None, "frames of sampled clips (default: data.num_frames)", min=1)
    height: Optional[int] = opt(None, "height of sampled clips (default: data.height)", min=1)
    width: Optional[int] = opt(None, "width of sampled clips (default: data.width)", min=1)
    steps: int = opt(30, "sampling steps", min=1)
    sampler: str = opt("euler", "euler (Euler steps on the shifted grid) or unipc (Wan's flow-matching UniPC, "
                       "order 2, on Wan's own sigma grid; with diffusion.constant_shift)", choices=("euler", "unipc"))
    negative_prompt: Optional[str] = opt(None, "the unconditional branch of CFG for families that sample with one "
                                         "(Wan; its recipes set Wan's default); null: the dropped-caption "
                                         "condition of training")
    cfg: float = opt(4.0, "classifier-free guidance scale (1 = off)", min=0.0)
    audio_cfg: float = opt(7.0, "LTX-2 sampling with sound (model.train_audio): the audio stream's classifier-free "
                           "guidance scale (LTX's audio guider: 7; 1 = off, as it is whenever sample.cfg is 1)",
                           min=0.0)
    expert_cfg: Optional[list[float]] = opt(None, "a model.expert=both run (Wan 2.2 A14B): [low, high], each expert's "
                                            "guidance scale, as Wan's sample_guide_scale (T2V [3.0, 4.0]; default: "
                                            "sample.cfg for both)", length=2, min=0.0)
    image_cfg: float = opt(3.0, "models given frames as input channels (Open-Sora 2.0's cond_in): the image scale of "
                           "its three-way CFG, v = u2 + image_cfg (u - u2) + cfg (c - u) over [text and frames, "
                           "frames only, neither] (Open-Sora: 3.0, text 7.5)", min=0.0)
    text_oscillation: bool = opt(False, "three-way CFG: after the first 10 steps, every odd step uses text scale 1 "
                                 "(Open-Sora 2.0's text_osci; its inference configs turn it on)")
    image_oscillation: bool = opt(False, "three-way CFG: the same for the image scale (Open-Sora 2.0's image_osci)")
    image_cfg_ramp: bool = opt(False, "three-way CFG of an i2v mode: the image scale rises along the latent frames from "
                               "1 to a ceiling that falls from image_cfg to 1 over the steps (Open-Sora 2.0's "
                               "scale_temporal_osci)")
    ref_mode: str = opt("i2v_head", "models given frames as input channels: what --ref gives, as Open-Sora 2.0's "
                        "cond_type: i2v_head (its first frame opens the clip), i2v_tail (its last frame ends it), "
                        "i2v_loop (both), v2v_head / v2v_tail (its first / last 32 frames, +1 with a causal VAE), "
                        "v2v_head_easy / v2v_tail_easy (64)",
                        choices=("i2v_head", "i2v_tail", "i2v_loop", "v2v_head", "v2v_tail", "v2v_head_easy",
                                 "v2v_tail_easy"))
    fps: int = opt(8, "frames per second given to the model and written (match the training clips' "
                   "fps / data.frame_interval)", min=1)
    prompt_style: str = opt("plain", "plain (prompts as given), opensora (Open-Sora 1.2's inference: the "
                            "aesthetic score appended, then its caption cleaning, lower case included) or opensora2 "
                            "(Open-Sora 2.0's inference: a final period, then ' {sample.fps} FPS.' and "
                            "' {motion_score} motion score.')",
                            choices=("plain", "opensora", "opensora2"))
    aesthetic_score: Optional[float] = opt(6.5, "with prompt_style=opensora: 'aesthetic score: X.' appended "
                                           "(null: none)")
    motion_score: Optional[int] = opt(4, "with prompt_style=opensora2: 'X motion score.' appended (Open-Sora 2.0's "
                                      "configs: 4; null: none)", min=0)


@dataclass
class Config:
    name: str = opt("tiny", "run name (used for the default output folder)")
    model: ModelConfig = field(default_factory=ModelConfig)
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    toy: ToyConfig = field(default_factory=ToyConfig)
    vae: VAEConfig = field(default_factory=VAEConfig)
    text: TextConfig = field(default_factory=TextConfig)
    image_encoder: ImageEncoderConfig = field(default_factory=ImageEncoderConfig)
    audio: AudioConfig = field(default_factory=AudioConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    resume: Optional[str] = opt(None, "auto (newest checkpoint in the run folder) or a checkpoint path")
