"""Trained models on rendered real-looking inputs: size, task metric, wall time and peak memory.

For the PP-OCRv4 text recognizer and the PP-OCR direction classifier (rapidocr-onnxruntime
1.4.4, fetched into the test-model cache), text lines are rendered with a system TrueType font
(DejaVu) and the models' own preprocessing: 50 calibration lines (one ``.npz`` of
``x [50, 3, 48, W]``, as a user would hand to ``--inputs``) and held-out lines that score each
output. Each command is run as a user types it, in its own process, and timed; its peak memory is
that process's (``wait4``). Rows:

- ``fp32``: the original (the baseline of the task metric);
- ``defaults``: ``quantize MODEL OUT`` (synthesised inputs, the default accuracy floor);
- ``--auto``: ``--auto --min-cosine 0.99 --inputs calib.npz``;
- ``--validate``: ``--auto --validate metric.py:score --max-drop D --inputs calib.npz``, the
  score being the task metric on 60 scored lines (others than the held-out ones).

The recognizer's metric is the character error rate (CTC greedy decoding with the alphabet in
the model's ``character`` metadata); the classifier's is top-1 accuracy on lines of which half
are turned by 180 degrees. A fourth run checks 2,000 lines of 3x48x597 (687 MB) against the
default 64 MiB budget with ``verify --inputs`` (``--big``).

Needs Pillow (to render the lines): ``pip install pillow``.

``--rankers`` runs, instead, ``--auto --min-cosine 0.99 --inputs calib.npz`` once per way of
ranking the MatMuls (``AutoOptions(criterion=...)``: measured, predicted and NNCF's criteria,
see quantize/criteria.py) through the library, every conv rewritten and nothing timed, and prints
each one's size and task metric.

    python benchmarks/bench_real.py [--workdir DIR] [--big] [--rankers [A,B]]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from _process import run_measured  # noqa: E402
from model_cache import FETCHER  # noqa: E402
from real_packages import CLS, REC  # noqa: E402

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


def _run(argv: list[str], env: dict[str, str]) -> tuple[int, float, int, str]:
    """Exit code, wall seconds and peak RSS bytes of one command in its own process (forked from
    a small launcher, see ``_process``), and its stderr."""
    usage = run_measured(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return usage.returncode, usage.seconds, usage.peak_bytes, usage.stderr


def _metric(path: str, data: Path, kind: str) -> float:
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


def bench(kind: str, model: str, work: Path, max_drop: str, extra: list[str]) -> list[tuple[str, ...]]:
    _inputs(kind, work)
    env = dict(os.environ, BENCH_REAL_LINES=str(work / "scored"), BENCH_REAL_KIND=kind)
    tool = [sys.executable, "-m", "onnx_conv2matmul"]
    runs = {
        "defaults": [],
        "--auto": ["--auto", "--min-cosine", "0.99", "--inputs", str(work / "calib.npz")],
        "--validate": [
            "--auto",
            "--validate",
            f"{work / 'metric.py'}:score",
            "--max-drop",
            max_drop,
            "--inputs",
            str(work / "calib.npz"),
        ],
    }
    size = os.path.getsize(model)
    label = "CER" if kind == "rec" else "top-1"

    def shown(value: float) -> str:
        return f"{100 * (1 - value):.2f}%" if kind == "rec" else f"{100 * value:.1f}%"

    rows = [
        (kind, "fp32", f"{size / 2**20:.2f}", "1.000", shown(_metric(model, work / "held", kind)), "", "", "")
    ]
    for name, more in runs.items():
        out = work / f"{name.strip('-')}.onnx"
        code, seconds, peak, stderr = _run([*tool, "quantize", model, str(out), *more, *extra], env)
        if not out.exists():
            last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
            rows.append(
                (kind, name, "-", "-", "-", f"{seconds:.1f}", f"{peak / 2**20:.0f}", f"exit {code}: {last}")
            )
            continue
        written = os.path.getsize(out) + sum(
            os.path.getsize(p) for p in work.glob(f"{out.name}.data") if p.is_file()
        )
        value = _metric(str(out), work / "held", kind)
        rows.append(
            (
                kind,
                name,
                f"{written / 2**20:.2f}",
                f"{written / size:.3f}",
                shown(value),
                f"{seconds:.1f}",
                f"{peak / 2**20:.0f}",
                f"exit {code}",
            )
        )
    rows.append(("", f"({label} on 100 held-out lines)", "", "", "", "", "", ""))
    return rows


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
            rows.append((kind, f"ranker {criterion}", "-", "-", "-", f"{seconds:.1f}", "", failed))
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
        f"{seconds:.1f}",
        f"{peak / 2**20:.0f}",
        f"exit {code}; {chunks[:90]}",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--big", action="store_true", help="also check 2,000 lines in the default budget")
    parser.add_argument("--only", choices=("rec", "cls"), help="one model only")
    parser.add_argument("--allow-added-transposes", action="store_true", help="pass it to every quantize run")
    parser.add_argument(
        "--rankers", nargs="?", const="all", default=None, help="only --auto per ranking criterion (or: a,b)"
    )
    args = parser.parse_args()
    root = args.workdir or Path(tempfile.mkdtemp(prefix="bench-real-"))
    header = ("model", "run", "MiB", "x fp32", "metric", "wall s", "peak MiB", "result")
    rows = [header]
    for kind, packaged, drop in (("rec", REC, "0.01"), ("cls", CLS, "0.01")):
        if args.only not in (None, kind):
            continue
        work = root / kind
        work.mkdir(parents=True, exist_ok=True)
        extra = ["--allow-added-transposes"] if args.allow_added_transposes else []
        if args.rankers:
            _inputs(kind, work)
            rows.extend(rankers(kind, str(FETCHER.fetch(packaged)), work, args.rankers))
            continue
        rows.extend(bench(kind, str(FETCHER.fetch(packaged)), work, drop, extra))
        if kind == "rec" and args.big:
            rows.append(big(str(FETCHER.fetch(packaged)), work))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    print(f"(work files in {root}; {onnx.__version__=} {ort.__version__=})")


if __name__ == "__main__":
    main()
