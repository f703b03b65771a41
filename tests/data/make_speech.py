"""Make ``speech.npz``: short English utterances spoken by espeak-ng, for the task test of a
trained speech recognizer (``tests/test_task_speech.py``). Needs ``espeak-ng`` and ``sox``.

Each utterance is four to seven words drawn from a fixed list, in one of six espeak-ng voices at
140 to 190 words a minute, resampled to 16 kHz mono and stored as 8-bit mu-law (telephone
quality, half the bytes of 16-bit PCM). The file holds, for utterance ``i``: ``audio_i`` (uint8
mu-law samples) and ``phonemes_i`` (espeak-ng's IPA for the words in that voice, stress marks
left in). ``split`` marks each one as calibration (0) or held out (1).

    python tests/data/make_speech.py tests/data/speech.npz
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile
import wave

import numpy as np

WORDS = (  # noqa: SIM905
    "the a quick brown fox jumps over lazy dog she sells sea shells by shore we will meet at noon"
    " under old bridge river flows north every morning birds sing near window please bring me"
    " water cold bread cheese my brother likes green apples they walked home after long day ship"
    " sails across ocean light rain fell on city small child reads book about stars music plays"
    " loud people dance until late teacher wrote numbers board garden full bright flowers"
).split()
VOICES = ["en-us", "en", "en-us+f3", "en+m3", "en-us+m7", "en+f2"]
CALIBRATION, HELD_OUT = 12, 20
MU = 255.0


def mu_law(x: np.ndarray) -> np.ndarray:
    """Float samples in [-1, 1] as 8-bit mu-law codes."""
    y = np.sign(x) * np.log1p(MU * np.abs(x)) / np.log1p(MU)
    return np.round((y + 1) / 2 * MU).astype(np.uint8)


def _speak(text: str, voice: str, speed: int) -> np.ndarray:
    with tempfile.TemporaryDirectory() as folder:
        raw, out = os.path.join(folder, "raw.wav"), os.path.join(folder, "16k.wav")
        subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-w", raw, text], check=True)
        subprocess.run(["sox", raw, "-r", "16000", "-c", "1", "-b", "16", out], check=True)
        with wave.open(out) as w:
            pcm = np.frombuffer(w.readframes(w.getnframes()), np.int16)
    return pcm.astype(np.float32) / 32768


def _ipa(text: str, voice: str) -> str:
    done = subprocess.run(["espeak-ng", "-q", "--ipa", "-v", voice, text], check=True, capture_output=True)
    return done.stdout.decode().strip()


def main(path: str) -> None:
    rng = random.Random(41)
    arrays: dict[str, np.ndarray] = {}
    for i in range(CALIBRATION + HELD_OUT):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 7)))
        voice, speed = rng.choice(VOICES), rng.randint(140, 190)
        arrays[f"audio_{i}"] = mu_law(_speak(text, voice, speed))
        arrays[f"phonemes_{i}"] = np.array(_ipa(text, voice))
    arrays["split"] = np.array([0] * CALIBRATION + [1] * HELD_OUT, np.int8)
    np.savez_compressed(path, **arrays)


if __name__ == "__main__":
    main(sys.argv[1])
