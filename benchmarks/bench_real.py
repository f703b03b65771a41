"""Trained models on real or realistic held-out inputs: size, task metric, labels kept, time, memory.

Three trained models from registry packages (fetched into the test-model cache):

- the PP-OCRv4 text recognizer (CTC) and the PP-OCR direction classifier (rapidocr-onnxruntime
  1.4.4), on text lines rendered with a system TrueType font (DejaVu) and the models' own
  preprocessing: 50 calibration lines (one ``.npz`` of ``x [50, 3, 48, W]``, as a user would
  hand to ``--inputs``) and 100 held-out lines that score each output;
- Magika's file-type classifier (magika 0.6.2), on the files of this machine: 100 as the
  calibration file, 400 others held out;
- hama's phoneme recognizer (hama 1.3.13; CTC over IPA units, raw 16 kHz audio in), on the
  utterances espeak-ng spoke into ``tests/data/speech.npz``: 12 as a calibration directory (one
  ``.npz`` a file, as their lengths differ), 20 held out, scored against espeak-ng's own IPA.

Each command is run as a user types it, in its own process, and timed; its peak memory is that
process's (``wait4``). Rows:

- ``fp32``: the original (the baseline of the task metric), with Y: what a careful user spends
  by hand (the plain rewrite, onnxruntime's MatMulNBitsQuantizer 4 bits block 64, one ``verify``);
- ``defaults``: ``quantize MODEL OUT`` (synthesised inputs, the default accuracy floor);
- ``--inputs``: the same with ``--inputs calib.npz``;
- ``--auto --inputs``: ``--auto --inputs calib.npz``;
- ``--int8-dynamic --inputs``: onnxruntime's dynamic int8 through the tool, checked on the inputs;
- with ``--validate``: ``--auto --validate metric.py:score --max-drop D --inputs calib.npz``, the
  score being the task metric on 60 scored lines (others than the held-out ones).

``metric`` is the recognizer's character error rate (CTC greedy decoding with the alphabet in
the model's ``character`` metadata), the direction classifier's top-1 accuracy (half the lines
turned by 180 degrees), or the phoneme recognizer's phoneme error rate; ``agree`` the share of
fp32's labels the output keeps on the held-out
inputs, counted as the check counts them (per sample; for the recognizer, the characters read
from its frames, changes counted as edits). A last run checks 2,000 lines of 3x48x597 (687 MB)
against the default 64 MiB budget with ``verify --inputs`` (``--big``).

Needs Pillow (to render the lines): ``pip install pillow``.

``--rankers`` runs, instead, ``--auto --min-cosine 0.99 --inputs calib.npz`` once per way of
ranking the MatMuls (``AutoOptions(criterion=...)``: measured, predicted and NNCF's criteria,
see quantize/sensitivity.py) through the library, every conv rewritten and nothing timed, and prints
each one's size and task metric.

    python benchmarks/bench_real.py [--workdir DIR] [--only rec|cls|magika|speech] [--validate] [--big]
    python benchmarks/bench_real.py --rankers [A,B]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from _process import run_quiet as _run  # noqa: E402
from bench_onepass import RECIPE  # noqa: E402
from model_cache import FETCHER  # noqa: E402
from real_packages import CLS, MAGIKA, REC, SPEECH, SPEECH_VOCAB  # noqa: E402

FONTS = (
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/dejavu/DejaVuSerif.ttf",
)
WORDS = [
    "invoice",
    "total",
    "amount",
    "date",
    "order",
    "number",
    "customer",
    "address",
    "street",
    "city",
    "phone",
    "email",
    "price",
    "quantity",
    "item",
    "description",
    "payment",
    "due",
    "account",
    "balance",
    "reference",
    "page",
    "section",
    "chapter",
    "report",
    "summary",
    "model",
    "version",
    "release",
    "update",
    "server",
    "client",
    "request",
    "response",
    "status",
]

METRIC = """
import json, os
import numpy as np, onnx, onnxruntime as ort

DATA = os.environ["BENCH_REAL_LINES"]
KIND = os.environ["BENCH_REAL_KIND"]


def _edits(a, b):
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def score(model_path):
    so = ort.SessionOptions()
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(model_path, so, providers=["CPUExecutionProvider"])
    data = np.load(os.path.join(DATA, "lines.npz"))
    labels = json.load(open(os.path.join(DATA, "labels.json")))
    if KIND == "cls":
        right = sum(int(session.run(None, {"x": data["x"][i : i + 1]})[0][0].argmax() == label)
                    for i, label in enumerate(labels))
        return right / len(labels)
    meta = {p.key: p.value for p in onnx.load(model_path, load_external_data=False).metadata_props}
    chars = ["", *meta["character"].split("\\n"), " "]
    errors = total = 0
    for i, text in enumerate(labels):
        best = session.run(None, {"x": data["x"][i : i + 1]})[0][0].argmax(-1)
        keep = (best != 0) & np.r_[True, best[1:] != best[:-1]]
        errors += _edits("".join(chars[k] for k in best[keep]).strip(), text)
        total += len(text)
    return 1.0 - errors / total
"""


def _text(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(2, 5)):
        kind = rng.random()
        if kind < 0.6:
            word = rng.choice(WORDS)
            parts.append(word.capitalize() if rng.random() < 0.3 else word)
        elif kind < 0.85:
            parts.append(str(rng.randint(0, 99999)))
        else:
            parts.append(
                f"{rng.choice('ABCDEFGHJKLMNPRSTUVWXYZ')}{rng.randint(100, 999)}-{rng.randint(10, 99)}"
            )
    return " ".join(parts)


def _render(text: str, rng: random.Random, height: int, width: int, turn: bool = False) -> np.ndarray:
    """``x [3, height, width]`` as rapidocr feeds it: resized to the height, scaled to [-1, 1],
    padded with 0 on the right."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.truetype(rng.choice([f for f in FONTS if os.path.exists(f)]), rng.randint(26, 34))
    left, top, right, bottom = font.getbbox(text)
    image = Image.new("RGB", (right - left + 16, bottom - top + 12), (255, 255, 255))
    ink = rng.randint(0, 60)
    ImageDraw.Draw(image).text((8 - left, 6 - top), text, font=font, fill=(ink, ink, ink))
    if turn:
        image = image.rotate(180)
    scaled = min(width, max(16, round(image.width * height / image.height)))
    image = image.resize((scaled, height), Image.BILINEAR)
    x = np.zeros((3, height, width), np.float32)
    x[:, :, :scaled] = ((np.asarray(image, np.float32) / 255 - 0.5) / 0.5).transpose(2, 0, 1)
    return x


def _lines(kind: str, count: int, seed: int, width: int) -> tuple[np.ndarray, list]:
    rng = random.Random(seed)
    xs, labels = [], []
    for _ in range(count):
        text = _text(rng)
        turn = kind == "cls" and rng.random() < 0.5
        xs.append(_render(text, rng, 48, width, turn))
        labels.append(int(turn) if kind == "cls" else text)
    return np.stack(xs), labels


def _metric(path: str, data: Path, kind: str) -> float:
    if kind == "speech":
        return 1.0 - _speech_per(path)
    env = {"BENCH_REAL_LINES": str(data), "BENCH_REAL_KIND": kind}
    os.environ.update(env)
    namespace: dict = {}
    exec(compile(METRIC, "metric", "exec"), namespace)  # the same function --validate runs
    return float(namespace["score"](path))


def _inputs(kind: str, work: Path) -> None:
    """The calibration file, the scored and the held-out lines, the metric's module."""
    width = 597 if kind == "rec" else 192
    calib, _ = _lines(kind, 50, 1, width)
    np.savez(work / "calib.npz", x=calib)
    for name, seed, count in (("scored", 2, 60), ("held", 3, 100)):
        folder = work / name
        folder.mkdir(exist_ok=True)
        x, labels = _lines(kind, count, seed, width)
        np.savez(folder / "lines.npz", x=x)
        (folder / "labels.json").write_text(json.dumps(labels))
    (work / "metric.py").write_text(METRIC)


def _agreement(model: str, candidate: str, x: np.ndarray, name: str, kind: str) -> str:
    """The share of fp32's labels ``candidate`` keeps on ``x``, counted as the check counts them
    (:func:`onnx_conv2matmul.verify.labels.count`: per sample for a classifier, the labels read
    from the frames for a recognizer)."""
    from onnx_conv2matmul.verify.labels import FRAMES, LABELS, count

    def outputs(path: str) -> np.ndarray:
        options = ort.SessionOptions()
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        step = 1 if kind == "rec" else 100
        return np.concatenate([session.run(None, {name: x[i : i + step]})[0] for i in range(0, len(x), step)])

    labels, changed = count(outputs(model), outputs(candidate), FRAMES if kind == "rec" else LABELS)
    return f"{100 * (labels - changed) / labels:.2f}% of {labels}"


def _yardstick(model: str, work: Path) -> float:
    """Y: the plain rewrite, onnxruntime's MatMulNBitsQuantizer (4 bits, block 64) and one
    ``verify`` with its defaults, each a process of its own, in seconds."""
    tool = [sys.executable, "-m", "onnx_conv2matmul"]
    rewritten, recipe = work / "y-rewritten.onnx", work / "y-recipe.onnx"
    seconds = 0.0
    for argv in (
        [*tool, str(model), str(rewritten)],
        [sys.executable, "-c", RECIPE, str(rewritten), str(recipe)],
        [*tool, "verify", str(model), str(recipe)],
    ):
        seconds += _run(argv, dict(os.environ))[1]
    return seconds


def bench(
    kind: str, model: str, work: Path, max_drop: str, extra: list[str], validate: bool = False
) -> list[tuple[str, ...]]:
    name = "bytes" if kind == "magika" else "x"
    if kind == "magika":
        x = _magika_inputs(work)
    elif kind == "speech":
        x = _speech_inputs(work)
    else:
        _inputs(kind, work)
        x = np.load(work / "held" / "lines.npz")["x"]
    env = dict(os.environ, BENCH_REAL_LINES=str(work / "scored"), BENCH_REAL_KIND=kind)
    tool = [sys.executable, "-m", "onnx_conv2matmul"]
    calib = str(work / ("calib" if kind == "speech" else "calib.npz"))
    runs = {
        "defaults": [],
        "--inputs": ["--inputs", calib],
        "--auto --inputs": ["--auto", "--inputs", calib],
        "--int8-dynamic --inputs": ["--int8-dynamic", "--inputs", calib],
    }
    if validate and kind not in ("magika", "speech"):
        runs["--validate"] = ["--auto", "--validate", f"{work / 'metric.py'}:score", "--max-drop", max_drop]
        runs["--validate"] += ["--inputs", calib]
    size = os.path.getsize(model)

    def shown(value: float | None) -> str:
        if value is None:
            return "-"
        return f"{100 * (1 - value):.2f}%" if kind in ("rec", "speech") else f"{100 * value:.1f}%"

    fp32 = None if kind == "magika" else _metric(model, work / "held", kind)
    y = _yardstick(model, work)
    rows = [(kind, "fp32", f"{size / 2**20:.2f}", "1.000", shown(fp32), "", f"Y {y:.1f}", "", "")]
    for run, more in runs.items():
        out = work / f"{run.strip('-').replace(' --', '-').replace(' ', '')}.onnx"
        code, seconds, peak, stderr = _run([*tool, "quantize", model, str(out), *more, *extra], env)
        if not out.exists():
            last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
            rows.append(
                (
                    kind,
                    run,
                    "-",
                    "-",
                    "-",
                    "-",
                    f"{seconds:.1f}",
                    f"{peak / 2**20:.0f}",
                    f"exit {code}: {last[:160]}",
                )
            )
            continue
        written = os.path.getsize(out) + sum(
            os.path.getsize(p) for p in work.glob(f"{out.name}.data") if p.is_file()
        )
        value = None if kind == "magika" else _metric(str(out), work / "held", kind)
        rows.append(
            (
                kind,
                run,
                f"{written / 2**20:.2f}",
                f"{written / size:.3f}",
                shown(value),
                _speech_agreement(model, str(out))
                if kind == "speech"
                else _agreement(model, str(out), x, name, kind),
                f"{seconds:.1f}",
                f"{peak / 2**20:.0f}",
                f"exit {code}",
            )
        )
    what = {
        "rec": "CER on 100 held-out lines",
        "cls": "top-1 on 100 held-out lines",
        "magika": "400 other files",
        "speech": "phoneme error rate on 20 held-out utterances",
    }
    rows.append(("", f"({what[kind]}; agree: fp32's labels kept)", "", "", "", "", "", "", ""))
    return rows


def _speech_inputs(work: Path) -> np.ndarray:
    """The 12 calibration utterances of ``tests/data/speech.npz`` as a directory of ``.npz`` files;
    the 20 held out, and their truth, kept for the metric (an empty array stands for them)."""
    import test_task_speech as speech

    units = json.loads(Path(FETCHER.fetch(SPEECH_VOCAB)).read_text())["decoder"]
    held, truth = speech.speech_sets(work / "calib", units)
    _HELD[:] = list(zip(held, truth, strict=True))
    _UNITS[:] = units
    return np.zeros(0)


_HELD: list[tuple[dict[str, np.ndarray], list[str]]] = []
_UNITS: list[str] = []


def _speech_per(path: str) -> float:
    import test_task_speech as speech

    feeds, truth = [feed for feed, _ in _HELD], [units for _, units in _HELD]
    return speech._per(Path(path), feeds, truth, _UNITS)


def _speech_agreement(model: str, candidate: str) -> str:
    """The phonemes read from fp32's frames that ``candidate`` keeps on the held-out utterances,
    counted as the check counts them."""
    from onnx_conv2matmul.verify.labels import FRAMES, count

    def session(path: str) -> ort.InferenceSession:
        options = ort.SessionOptions()
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])

    a, b = session(model), session(candidate)
    labels = changed = 0
    for feed, _ in _HELD:
        n, k = count(a.run(None, feed)[0], b.run(None, feed)[0], FRAMES)
        labels, changed = labels + n, changed + k
    return f"{100 * (labels - changed) / labels:.2f}% of {labels}"


def _magika_inputs(work: Path) -> np.ndarray:
    """100 files of this machine as the calibration file, 400 others held out."""
    from file_features import file_features

    x = file_features(500)
    np.savez(work / "calib.npz", bytes=x[:100])
    return x[100:]


RANKER = """
import sys
from onnx_conv2matmul import ConvertOptions
from onnx_conv2matmul.api import quantize_file
from onnx_conv2matmul.quantize.options import AutoOptions
from onnx_conv2matmul.verify.check import VerifyOptions, load_inputs

model, out, calib, criterion = sys.argv[1:]
report = quantize_file(
    model,
    out,
    auto=AutoOptions(min_cosine=0.99, criterion=criterion),
    convert_options=ConvertOptions(extended=True, allow_non_unit_dilation=True, allow_added_transposes=True),
    verify=VerifyOptions(feeds=tuple(load_inputs([calib])), min_cosine=0.99),
)
sys.exit(0 if report.output_path else 1)
"""


def rankers(kind: str, model: str, work: Path, which: str = "all") -> list[tuple[str, ...]]:
    """``--auto --min-cosine 0.99 --inputs calib.npz`` with each way of ranking the MatMuls
    (``AutoOptions(criterion=...)``, the library's; every conv rewritten, nothing timed)."""
    from onnx_conv2matmul.quantize.options import CRITERIA

    size = os.path.getsize(model)
    rows = []
    for criterion in CRITERIA if which == "all" else which.split(","):
        out = work / f"rank-{criterion}.onnx"
        argv = [sys.executable, "-c", RANKER, model, str(out), str(work / "calib.npz"), criterion]
        code, seconds, peak, stderr = _run(argv, dict(os.environ))
        if not out.exists():
            last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
            failed = f"exit {code}: {last}"
            rows.append((kind, f"ranker {criterion}", "-", "-", "-", "", f"{seconds:.1f}", "", failed))
            continue
        written = os.path.getsize(out) + sum(p.stat().st_size for p in work.glob(f"{out.name}.data"))
        value = _metric(str(out), work / "held", kind)
        shown = f"{100 * (1 - value):.2f}%" if kind == "rec" else f"{100 * value:.1f}%"
        rows.append(
            (
                kind,
                f"ranker {criterion}",
                f"{written / 2**20:.2f}",
                f"{written / size:.3f}",
                shown,
                "",
                f"{seconds:.1f}",
                f"{peak / 2**20:.0f}",
                f"exit {code}",
            )
        )
    return rows


def big(model: str, work: Path) -> tuple[str, ...]:
    """2,000 lines of 3x48x597 in one file, checked with the default budget."""
    path = work / "big.npz"
    x = np.lib.format.open_memmap(work / "x.npy", mode="w+", dtype=np.float32, shape=(2000, 3, 48, 597))
    base, _ = _lines("rec", 100, 4, 597)
    for start in range(0, 2000, 100):
        x[start : start + 100] = base
    x.flush()
    del x
    import zipfile

    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        archive.write(work / "x.npy", "x.npy")
    os.unlink(work / "x.npy")
    tool = [sys.executable, "-m", "onnx_conv2matmul"]
    candidate = work / "defaults.onnx"
    code, seconds, peak, stderr = _run(
        [*tool, "verify", model, str(candidate), "--inputs", str(path), "--min-cosine", "0.9"],
        dict(os.environ),
    )
    chunks = next((line for line in stderr.splitlines() if "chunks" in line), "").strip()
    return (
        "rec",
        "verify --inputs 2000 lines",
        f"{path.stat().st_size / 2**20:.0f} MiB file",
        "",
        "",
        "",
        f"{seconds:.1f}",
        f"{peak / 2**20:.0f}",
        f"exit {code}; {chunks[:90]}",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--big", action="store_true", help="also check 2,000 lines in the default budget")
    parser.add_argument("--only", choices=("rec", "cls", "magika", "speech"), help="one model only")
    parser.add_argument("--validate", action="store_true", help="also --auto --validate with the task metric")
    parser.add_argument("--allow-added-transposes", action="store_true", help="pass it to every quantize run")
    parser.add_argument(
        "--rankers", nargs="?", const="all", default=None, help="only --auto per ranking criterion (or: a,b)"
    )
    args = parser.parse_args()
    root = args.workdir or Path(tempfile.mkdtemp(prefix="bench-real-"))
    header = ("model", "run", "MiB", "x fp32", "metric", "agree", "wall s", "peak MiB", "result")
    rows = [header]
    models = (
        ("rec", REC, "0.01"),
        ("cls", CLS, "0.01"),
        ("magika", MAGIKA, "0.01"),
        ("speech", SPEECH, "0.01"),
    )
    for kind, packaged, drop in models:
        if args.only not in (None, kind):
            continue
        work = root / kind
        work.mkdir(parents=True, exist_ok=True)
        extra = ["--allow-added-transposes"] if args.allow_added_transposes else []
        if args.rankers:
            if kind in ("magika", "speech"):  # the rankers compare on rendered lines
                continue
            _inputs(kind, work)
            rows.extend(rankers(kind, str(FETCHER.fetch(packaged)), work, args.rankers))
            continue
        rows.extend(bench(kind, str(FETCHER.fetch(packaged)), work, drop, extra, args.validate))
        if kind == "rec" and args.big:
            rows.append(big(str(FETCHER.fetch(packaged)), work))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    print(f"(work files in {root}; {onnx.__version__=} {ort.__version__=})")


if __name__ == "__main__":
    main()
