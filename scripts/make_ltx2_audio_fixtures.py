"""Write tests/fixtures/ltx2_audio/ from Lightricks' own LTX-2 audio preprocessing: ltx-core's
``AudioProcessor`` (resampling and log-mel) and ltx-trainer's ``_encode_audio`` (stereo downmix, then
the processor) on small deterministic waveforms.

    python scripts/make_ltx2_audio_fixtures.py --checkout /path/to/LTX-2 [--out DIR] [--no-check]

The checkout is Lightricks/LTX-2 (400fd31); ``packages/ltx-core/src`` goes on sys.path. Their code
needs torchaudio (``torchaudio.transforms.MelSpectrogram``, ``torchaudio.functional.resample``), which
videodit does not: run this script with a Python that has it, e.g. a scratch virtual environment on
top of the installed torch (torchaudio's transforms are pure torch, so a release built for a nearby
torch imports; its compiled extensions are not used here):

    python -m venv --system-site-packages /tmp/ltx-audio && /tmp/ltx-audio/bin/pip install --no-deps torchaudio
    /tmp/ltx-audio/bin/python scripts/make_ltx2_audio_fixtures.py --checkout /path/to/LTX-2

``_encode_audio`` lives in ltx-trainer's ``scripts/process_videos.py``, whose imports (typer, rich,
pandas, the VAE loaders) are not needed: the function's own source is taken from that file (parsed,
never imported) and run as written, with torch, ltx-core's ``Audio`` and a logger as its globals. Its
audio encoder is a stand-in that returns the mel spectrogram it is given (one parameter, so the
function finds a device and dtype), so what comes out is their downmix + resample + log-mel.

What it writes (about 0.4 MB):

- ``tensors.safetensors``: ``{case}.input``: int16 PCM ``[channels, samples]`` (the waveform is
  ``input / 32768`` in float32, exact); ``{case}.mel``: their ``[2, frames, 64]`` log-mel;
  ``{case}.resampled``: for the resampling cases, ``AudioProcessor.resample_audio``'s stereo 16 kHz waveform.
- ``cases.json``: each case's rate, channels, path through their code; the settings (16 kHz, 64 bins,
  hop 160, n_fft 1024: ltx-core's ``AudioEncoder`` defaults, the release config's values); library
  versions; the sha256 of the files read.

After writing, it runs videodit's ``data/audio.py`` on the same inputs and prints the largest deviation
of each case relative to their output's largest magnitude (``--no-check`` skips). tests/data/test_audio.py
reads the fixtures; it never needs LTX-2 or torchaudio.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import logging
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
OPS = "packages/ltx-core/src/ltx_core/model/audio_vae/ops.py"
TYPES = "packages/ltx-core/src/ltx_core/types.py"
TRAINER = "packages/ltx-trainer/scripts/process_videos.py"
SETTINGS = {"sample_rate": 16000, "mel_bins": 64, "hop_length": 160, "n_fft": 1024}

# name: (rate, channels, seconds, path through their code)
CASES = {
    "stereo16k": (16000, 2, 0.3, "processor"),      # log-mel alone
    "stereo44k": (44100, 2, 0.25, "processor"),     # resampled 44.1 -> 16 kHz, then log-mel
    "stereo48k": (48000, 2, 0.25, "processor"),
    "mono22k": (22050, 1, 0.25, "encode"),          # duplicated to stereo
    "surround51": (48000, 6, 0.15, "encode"),       # 5.1 downmix
    "surround71": (16000, 8, 0.2, "encode"),        # 7.1 downmix
    "quad": (16000, 4, 0.2, "encode"),              # other layouts: the mean, duplicated
    "tiny": (16000, 2, 0.04, "processor"),          # 640 samples: just above reflect padding's minimum
}


def waveform(name: str, rate: int, channels: int, seconds: float) -> torch.Tensor:
    """int16 [channels, samples]: per channel a few tones, a rising chirp, seeded noise and a silent stretch."""
    count = round(rate * seconds)
    seed = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16)
    generator = torch.Generator().manual_seed(seed)
    t = torch.arange(count, dtype=torch.float64) / rate
    rows = []
    for c in range(channels):
        tones = sum(0.2 / (k + 1) * torch.sin(2 * torch.pi * (220 * (c + 1) * (k + 1)) * t) for k in range(3))
        chirp = 0.15 * torch.sin(2 * torch.pi * (100 + 3000 * t / seconds) * t)
        noise = 0.05 * torch.randn(count, generator=generator, dtype=torch.float64)
        row = tones + chirp + noise
        row[round(0.4 * count) : round(0.55 * count)] = 0   # silence: the log floor
        rows.append(row)
    return (torch.stack(rows).clamp(-1, 32767 / 32768) * 32768).round().to(torch.int16)


def their_code(checkout: Path):
    sys.path.insert(0, str(checkout / "packages" / "ltx-core" / "src"))
    from ltx_core.model.audio_vae.ops import AudioProcessor
    from ltx_core.types import Audio

    tree = ast.parse((checkout / TRAINER).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_encode_audio")
    scope = {"torch": torch, "Audio": Audio, "logger": logging.getLogger("ltx-trainer")}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(checkout / TRAINER), "exec"), scope)
    processor = AudioProcessor(target_sample_rate=SETTINGS["sample_rate"], mel_bins=SETTINGS["mel_bins"],
                               mel_hop_length=SETTINGS["hop_length"], n_fft=SETTINGS["n_fft"])
    return processor, scope["_encode_audio"], Audio


class MelPassThrough(torch.nn.Module):
    """The audio encoder's stand-in: its input (the log-mel) is its output."""

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        return mel


def make(checkout: Path, out: Path) -> dict:
    processor, encode_audio, Audio = their_code(checkout)
    tensors, cases = {}, {}
    for name, (rate, channels, seconds, path) in CASES.items():
        pcm = waveform(name, rate, channels, seconds)
        wave = pcm.float() / 32768
        tensors[f"{name}.input"] = pcm
        with torch.no_grad():
            if path == "processor":
                audio = Audio(waveform=wave[None], sampling_rate=rate)
                tensors[f"{name}.mel"] = processor.waveform_to_mel(audio)[0]
                if rate != SETTINGS["sample_rate"]:
                    tensors[f"{name}.resampled"] = processor.resample_audio(audio).waveform[0]
            else:
                tensors[f"{name}.mel"] = encode_audio(MelPassThrough(), processor, Audio(wave, rate))["latents"]
        cases[name] = {"rate": rate, "channels": channels, "samples": pcm.shape[1], "path": path,
                       "mel_frames": tensors[f"{name}.mel"].shape[1]}
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "tensors.safetensors"))
    return cases


def check(out: Path) -> None:
    sys.path.insert(0, str(REPO))
    from videodit.data.audio import AudioSpec, resample, to_stereo

    tensors = load_file(str(out / "tensors.safetensors"))
    cases = json.loads((out / "cases.json").read_text())["cases"]
    for name, case in cases.items():
        wave = tensors[f"{name}.input"].numpy().astype("float32") / 32768
        mel = AudioSpec().encode(wave, case["rate"])
        want = tensors[f"{name}.mel"]
        line = f"{name:12s} mel {float((mel - want).abs().max() / want.abs().max()):.2e}"
        if f"{name}.resampled" in tensors:
            ours = resample(to_stereo(torch.from_numpy(wave)), case["rate"])
            theirs = tensors[f"{name}.resampled"]
            line += f"  resampled {float((ours - theirs).abs().max() / theirs.abs().max()):.2e}"
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkout", type=Path, required=True, help="Lightricks/LTX-2 checkout (400fd31)")
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "ltx2_audio")
    ap.add_argument("--no-check", action="store_true", help="do not compare videodit's implementation after writing")
    args = ap.parse_args()
    torch.set_num_threads(1)
    checkout = args.checkout.resolve()
    cases = make(checkout, args.out)
    import torchaudio

    record = {"cases": cases, "settings": SETTINGS,
              "versions": {"torch": torch.__version__, "torchaudio": torchaudio.__version__},
              "sha256": {f: hashlib.sha256((checkout / f).read_bytes()).hexdigest() for f in (OPS, TYPES, TRAINER)}}
    (args.out / "cases.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")
    if not args.no_check:
        check(args.out)


if __name__ == "__main__":
    main()
