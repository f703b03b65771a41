"""The docs' examples are run by a test, so they cannot rot.

Every ``onnx-conv2matmul`` command in the README and in ``docs/*.md`` (fenced shell blocks, and
inline code that is a whole command) is parsed by the command line's own click parser: an option
that no longer exists, or a value click refuses, fails the test named ``PAGE:LINE``. Every
``python`` block is compiled. The README's commands, and the Python examples marked ``default`` in
:data:`PYTHON`, run for real in the default run, on the small models in ``tests/data``; the slow
set (``-m slow``) runs every other docs block. The docs name what a user has (``encoder.onnx``,
``fp32/`` for the Parakeet release folder, ``utts/`` for their recordings, ...); :data:`SOURCES`,
:data:`PRODUCTS` and :data:`DATA` say what each name stands for here. What cannot run is listed
in :data:`NOT_RUN` and :data:`PYTHON` with the reason, and a test checks that every entry still
names something in the docs.

Each block runs in a folder of its own, as a user pastes it: its commands in order, a name it
reads and did not make is put in place from the maps above first. ``mkdir`` and the ``jq`` line
that extracts a report's settings are done by the test; ``pip install`` is the environment's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import wave
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click
import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

from onnx_conv2matmul.cli import app

ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = ROOT / "tests" / "data"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"bash", "sh", "shell", "console", ""}
TOOL = "onnx-conv2matmul"


# --------------------------------------------------------------------------------------------
# Reading the pages


@dataclasses.dataclass(frozen=True)
class Block:
    page: str  # relative to the repository: README.md, docs/quantize.md
    line: int  # the line of the opening fence
    lang: str
    lines: tuple[tuple[int, str], ...]  # (line number, text) of the content

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def text(self) -> str:
        return "".join(text + "\n" for _, text in self.lines)


@dataclasses.dataclass(frozen=True)
class Step:
    """One shell command of a block: a segment of a line (``a && b`` is two steps)."""

    page: str
    line: int
    source: str  # the whole logical line, continuation lines joined
    kind: str  # cli, mkdir, jq, install, other
    words: tuple[str, ...]  # for cli: the arguments after onnx-conv2matmul
    env: tuple[tuple[str, str], ...] = ()

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: Path) -> list[Block]:
    out: list[Block] = []
    fence: tuple[int, str] | None = None
    content: list[tuple[int, str]] = []
    for number, text in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if text.startswith("```"):
            if fence is None:
                fence, content = (number, text[3:].strip()), []
            else:
                out.append(Block(page.relative_to(ROOT).as_posix(), fence[0], fence[1], tuple(content)))
                fence = None
        elif fence is not None:
            content.append((number, text))
    assert fence is None, f"{page.name}:{fence[0]}: a code fence that is never closed"
    return out


def all_blocks() -> list[Block]:
    return [block for page in PAGES for block in blocks(page)]


def _logical_lines(block: Block) -> Iterator[tuple[int, str]]:
    """The block's command lines: ``$ `` lines of a console block (the rest is output), lines
    beginning with ``onnx-conv2matmul`` or ``$ `` of an unlabelled one, every line of a bash or sh
    block; continuation lines joined, comment lines dropped."""
    pending: tuple[int, str] | None = None
    for number, raw in block.lines:
        text = raw.strip()
        if pending is None:
            if block.lang == "console" and not text.startswith("$ "):
                continue  # output
            if block.lang == "" and not text.startswith(("$ ", TOOL + " ")):
                continue  # an unlabelled block holds diagrams and output too: only commands count
            if text.startswith("$ "):
                text = text[2:]
            if not text or text.startswith("#"):
                continue
            pending = (number, "")
        start, joined = pending
        if text.endswith("\\"):
            pending = (start, joined + text[:-1] + " ")
            continue
        pending = None
        yield start, joined + text
    assert pending is None, f"{block.id}: a line continued past the end of the block"


_ENV = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_SEPARATORS = {"&&", "||", ";", "|", "&"}


def _words(text: str) -> list[str]:
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        return list(lexer)
    except ValueError:  # unbalanced quotes: kept as one word, which no test can run
        return [text]


def steps(block: Block) -> list[Step]:
    out = []
    for line, source in _logical_lines(block):
        segment: list[str] = []
        for word in [*_words(source), "&&"]:
            if word not in _SEPARATORS:
                segment.append(word)
                continue
            if segment:
                out.append(_step(block.page, line, source, segment))
            segment = []
    return out


def _step(page: str, line: int, source: str, words: list[str]) -> Step:
    env = []
    while words and _ENV.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        env.append((name, value))
    while words and words[0] in ("nice", "time"):  # wrappers that change nothing the test checks
        words.pop(0)
        while words and words[0] == "-n":
            del words[:2]
    kind = "other"
    if words and words[0] == TOOL:
        kind, words = "cli", words[1:]
    elif words and words[0] == "mkdir":
        kind, words = "mkdir", [w for w in words[1:] if w != "-p"]
    elif words and words[0] == "jq":
        kind = "jq"
    elif words[:2] == ["pip", "install"]:
        kind = "install"
    return Step(page, line, source, kind, tuple(words), tuple(env))


def shell_blocks() -> list[Block]:
    return [b for b in all_blocks() if b.lang in SHELL_LANGS and any(s.kind == "cli" for s in steps(b))]


def fenced_commands() -> list[Step]:
    return [s for b in all_blocks() if b.lang in SHELL_LANGS for s in steps(b) if s.kind == "cli"]


_INLINE = re.compile(r"`" + TOOL + r"( [^`]*)?`")


def inline_commands() -> list[Step]:
    """Inline code that is a whole command; synopses (``[options]``, ``MODEL...``, ``COMMAND``)
    are left out."""
    out = []
    for page in PAGES:
        fence = False
        for number, text in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if text.startswith("```"):
                fence = not fence
                continue
            if fence:
                continue
            for match in _INLINE.finditer(text):
                rest = (match.group(1) or "").strip()
                if not rest or rest in app.main.commands:  # the command's name, not a command
                    continue
                if any(mark in rest for mark in ("[", "...", "COMMAND", "|")):
                    continue
                name = page.relative_to(ROOT).as_posix()
                out.append(Step(name, number, match.group(0).strip("`"), "cli", tuple(shlex.split(rest))))
    return out


def python_blocks() -> list[Block]:
    return [b for b in all_blocks() if b.lang == "python"]


# --------------------------------------------------------------------------------------------
# The command line's own parser


def resolve(words: tuple[str, ...]) -> tuple[str, click.Command, list[str]]:
    """The subcommand and its arguments, as ``_DefaultGroup`` resolves them."""
    group = app.main
    assert isinstance(group, click.Group)
    if not words or words[0] in ("--help", "-h", "--version"):
        return TOOL, group, list(words)
    if words[0] in group.commands:
        return words[0], group.commands[words[0]], list(words[1:])
    return "convert", group.commands["convert"], list(words)


def parse(step: Step) -> dict[str, Any]:
    """The parameters click makes of the command; a usage error fails, naming the line."""
    name, command, args = resolve(step.words)
    try:
        with command.make_context(name, args) as ctx:
            return dict(ctx.params)
    except click.exceptions.Exit as exit_:  # --help, --version
        assert exit_.exit_code == 0, f"{step.id}: {step.source}"
        return {}
    except click.ClickException as error:
        pytest.fail(f"{step.id}: `{step.source}` does not parse: {error.format_message()}")


@pytest.mark.parametrize("step", [*fenced_commands(), *inline_commands()], ids=lambda s: s.id)
def test_every_documented_command_parses(step: Step) -> None:
    parse(step)


@pytest.mark.parametrize("block", python_blocks(), ids=lambda b: b.id)
def test_every_python_block_compiles(block: Block) -> None:
    compile(block.text, block.id, "exec")


def test_the_docs_have_what_the_tests_read() -> None:
    """The extraction finds what it should, so an empty parametrize cannot pass unnoticed."""
    readme = [s for s in fenced_commands() if s.page == "README.md"]
    assert len(readme) >= 5 and len(fenced_commands()) >= 25 and len(python_blocks()) >= 8
    assert any("conformer_small.onnx" in s.source for s in readme), "the quick start is gone"


# --------------------------------------------------------------------------------------------
# Links


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    fence = False
    for text in page.read_text(encoding="utf-8").splitlines():
        if text.startswith("```"):
            fence = not fence
        match = None if fence else re.match(r"#{1,6} (.*)", text)
        if match:
            slug = _slug(match.group(1))
            seen[slug] = seen.get(slug, 0) + 1
            if seen[slug] > 1:
                seen[f"{slug}-{seen[slug] - 1}"] = 1
    return set(seen)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    fence = False
    for number, text in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if text.startswith("```"):
            fence = not fence
        if fence:
            continue
        for url in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", url):
                continue
            path, _, anchor = url.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                broken.append(f"{number}: {url} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
                broken.append(f"{number}: {url} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


# --------------------------------------------------------------------------------------------
# What the docs' names stand for


def _copy(source: Path) -> Callable[[Path], None]:
    """A model (with its external data files) or a folder, copied under the docs' name."""

    def make(target: Path) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target)
            return
        shutil.copyfile(source, target)
        for data in source.parent.glob(source.name + ".*"):  # encoder-model.onnx.data keeps its name
            shutil.copyfile(data, target.parent / data.name)

    return make


def _image_model(target: Path) -> None:
    """An image model whose height and width are named dims: x [N, 3, height, width]."""
    weight = helper.make_tensor("w", TensorProto.FLOAT, [8, 3, 1, 1], np.linspace(-1, 1, 24).tolist())
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"), helper.make_node("Relu", ["c"], ["y"])],
        "detector",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, "height", "width"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8, "height", "width"])],
        [weight],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), target)


def _silero(target: Path) -> None:
    from model_cache import FETCHER
    from real_packages import SILERO

    shutil.copyfile(FETCHER.fetch(SILERO), target)  # skips, saying why, when it cannot be fetched


def _metric_stand_in(target: Path) -> None:
    target.write_text("def score(model_path):\n    return 1.0\n", encoding="utf-8")


def _speech(target: Path) -> None:
    t = np.arange(2 * 16000) / 16000
    samples = (0.3 * np.sin(2 * np.pi * 440 * t) * 32767).astype("<i2")
    with wave.open(str(target), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        out.writeframes(samples.tobytes())


RELEASE = DATA_DIR / "parakeet_small"
SOURCES: dict[str, Callable[[Path], None]] = {
    # What a user has: their models and folders, here the small models shipped in tests/data.
    "encoder.onnx": _copy(DATA_DIR / "conformer_small.onnx"),
    "encoder-model.onnx": _copy(RELEASE / "encoder-model.onnx"),
    "decoder_joint-model.onnx": _copy(RELEASE / "decoder_joint-model.onnx"),
    "decoder_joint.onnx": _copy(DATA_DIR / "tdt_decoder_small.onnx"),
    "rec.onnx": _copy(DATA_DIR / "conformer_small.onnx"),  # a stand-in: the commands need any model
    "detector.onnx": _image_model,
    "silero_vad.onnx": _silero,
    # The Parakeet TDT release folder, under the names the docs give it.
    "fp32": _copy(RELEASE),
    "parakeet-tdt-0.6b-v3": _copy(RELEASE),
    "release": _copy(RELEASE),
    # The validation function: a constant score (the real one, in docs/quantize.md, scores a
    # text recognizer on your labelled lines).
    "ocr_metric.py": _metric_stand_in,
    "speech.wav": _speech,
}

PRODUCTS: dict[str, tuple[str, ...]] = {
    # Made by an earlier command of the docs (or a user's earlier run): the command that makes it.
    "encoder.int4.onnx": ("quantize", "encoder.onnx", "encoder.int4.onnx"),
    "decoder_joint-model.int8.onnx": (
        "quantize", "decoder_joint-model.onnx", "decoder_joint-model.int8.onnx", "--int8-dynamic",
    ),
    "silero_vad.matmul.onnx": ("silero_vad.onnx", "silero_vad.matmul.onnx"),
    "int4": ("bundle", "fp32/", "int4/"),
    "int4-sherpa": ("bundle", "fp32/", "int4-sherpa/", "--layout", "sherpa-onnx"),
    "int4/encoder-model.int4.onnx": ("quantize", "fp32/encoder-model.onnx", "int4/encoder-model.int4.onnx"),
    "int8/encoder-model.int8.onnx": (
        "quantize", "fp32/encoder-model.onnx", "int8/encoder-model.int8.onnx", "--int8-dynamic",
    ),
}  # fmt: skip

DATA = {
    # A user's own inputs for a model (--inputs): .npz files whose keys are its input names.
    "utts": 2,  # a folder: one file per utterance
    "calib": 2,
    "features.npz": 1,
}

NOT_RUN: dict[tuple[str, str], str] = {
    # (page, part of the line): why it is not run. Its onnx-conv2matmul commands are still parsed.
    ("README.md", "python -m pytest -q"): "the test suite itself",
    ("docs/quantize.md", "pip download rapidocr-onnxruntime"): (
        "fetches the recognizer of the worked example; tests/model_cache.py fetches the same model"
    ),
    ("docs/quantize.md", "quantize ch_PP-OCRv4_rec_infer.onnx rec.int4.onnx"): (
        "the worked example needs your labelled lines (lines/, calib/) and a 3-minute search; "
        "the same options run in `quantize rec.onnx ... --validate` and `--auto` above"
    ),
}


def _feeds(model: Path, count: int) -> list[dict[str, np.ndarray]]:
    """Inputs a user would record for the model: batch 1, a few lengths, lengths filled in."""
    proto = onnx.load(model, load_external_data=False)
    initializers = {i.name for i in proto.graph.initializer}
    out = []
    for n in range(count):
        frames = 64 + 33 * n
        feed = {}
        for value in proto.graph.input:
            if value.name in initializers:
                continue
            kind = value.type.tensor_type
            dims = [d.dim_value or (1 if "batch" in d.dim_param else frames) for d in kind.shape.dim]
            dtype = helper.tensor_dtype_to_np_dtype(kind.elem_type)
            if np.issubdtype(dtype, np.integer):
                feed[value.name] = np.full(dims, frames, dtype)
            else:
                feed[value.name] = np.random.default_rng(n).standard_normal(dims).astype(dtype)
        out.append(feed)
    return out


def _make_data(target: Path, count: int, model: Path) -> None:
    feeds = _feeds(model, count)
    if target.suffix == ".npz":
        np.savez(target, **feeds[0])
        return
    target.mkdir(parents=True)
    for n, feed in enumerate(feeds, 1):
        np.savez(target / f"utt{n}.npz", **feed)


class World:
    """A folder a block runs in, and the session's cache of products (made once per worker)."""

    def __init__(self, folder: Path, cache: Path) -> None:
        self.folder = folder
        self.cache = cache

    def has(self, name: str) -> bool:
        return (self.folder / name.rstrip("/")).exists()

    def provide(self, name: str, model: str | None = None) -> None:
        """Put the docs' name in place, unless the block already made it."""
        key = name.rstrip("/")
        target = self.folder / key
        if target.exists():
            return
        if key in SOURCES:
            SOURCES[key](target)
        elif key.split("/")[0] in SOURCES and "/" in key:
            self.provide(key.split("/")[0])  # fp32/encoder-model.onnx: the folder it is in
        elif key in PRODUCTS:
            self._copy_product(key)
        elif key in DATA:
            assert model is not None, f"{name}: inputs for which model?"
            self.provide(model)
            source = self.folder / model.rstrip("/")
            _make_data(target, DATA[key], source / "encoder-model.onnx" if source.is_dir() else source)
        elif (ROOT / key).exists():
            _copy(ROOT / key)(target)  # a path of the repository (the quick start's model)
        else:
            pytest.fail(f"no stand-in for {name!r}: add it to SOURCES, PRODUCTS or DATA in {__file__}")
        assert target.exists(), name

    def _copy_product(self, key: str) -> None:
        """Made once per worker, in a folder of its own, by the command PRODUCTS gives; then copied
        (a model with the files named after it, such as its ``.data``, or a folder)."""
        maker = World(self.cache / "docs-products" / key.replace("/", "__"), self.cache)
        if not (maker.folder / key).exists():
            shutil.rmtree(maker.folder, ignore_errors=True)
            (maker.folder / key).parent.mkdir(parents=True, exist_ok=True)
            maker.run_cli(Step("(product)", 0, shlex.join((TOOL, *PRODUCTS[key])), "cli", PRODUCTS[key]))
        _copy(maker.folder / key)(self.folder / key)

    # -- running a block's steps

    def run_cli(self, step: Step) -> None:
        words = [self._local(w) for w in step.words]
        step = dataclasses.replace(step, words=tuple(words))
        params = parse(step)
        name = resolve(step.words)[0]
        model = _model_of(name, params)
        for value in _inputs(name, params):
            self.provide(value, model)
        runner = CliRunner()
        cwd = Path.cwd()
        os.chdir(self.folder)
        try:
            result = runner.invoke(app.main, words, env=dict(step.env), catch_exceptions=False)
        finally:
            os.chdir(cwd)
        expected = EXIT_CODES.get(step.source, 0)
        assert result.exit_code == expected, (
            f"{step.id}: `{step.source}` exited {result.exit_code}, not {expected}:\n{result.output[-3000:]}"
        )
        for value in _outputs(name, params):
            assert (self.folder / value).exists(), f"{step.id}: `{step.source}` did not write {value}"

    def _local(self, word: str) -> str:
        """An absolute path of the user's machine (``/tmp/x.onnx``) goes inside the folder."""
        if word.startswith("/") and Path(word).parent.is_dir():
            local = self.folder / word.lstrip("/")
            local.parent.mkdir(parents=True, exist_ok=True)
            return str(local)
        return word

    def run(self, block: Block) -> list[str]:
        """Every step of the block, in order; returns why the steps not run were not."""
        not_run = []
        for step in steps(block):
            reason = _not_run(step)
            if reason:
                if f"{step.id}: {reason}" not in not_run:
                    not_run.append(f"{step.id}: {reason}")
            elif step.kind == "cli":
                self.run_cli(step)
            elif step.kind == "mkdir":
                for folder in step.words:
                    (self.folder / folder).mkdir(parents=True, exist_ok=True)
            elif step.kind == "jq":
                self._jq(step)
            elif step.kind != "install":  # the environment the tests run in is installed
                pytest.fail(f"{step.id}: the test cannot run `{step.source}`: teach it, or add it to NOT_RUN")
        return not_run

    def _jq(self, step: Step) -> None:
        """``jq .a.b FILE > OUT``: the one jq line the docs have, done in Python."""
        words = list(step.words)
        assert len(words) == 5 and words[3] == ">" and words[1].startswith("."), step.source
        value = json.loads((self.folder / words[2]).read_text(encoding="utf-8"))
        for key in words[1].strip(".").split("."):
            value = value[key]
        (self.folder / words[4]).write_text(json.dumps(value), encoding="utf-8")


EXIT_CODES: dict[str, int] = {}  # a documented command whose documented exit code is not 0

_INPUTS = ("input_path", "original", "candidate", "check_dir", "config")


def _inputs(name: str, params: dict[str, Any]) -> list[str]:
    values = [params[key] for key in _INPUTS if params.get(key)]
    values += list(params.get("models") or ()) + list(params.get("inputs") or ())
    if name == "bundle" and params.get("paths"):
        values.append(params["paths"][0])
    validate = params.get("validate")
    if validate and ".py:" in validate:
        values.append(validate.rsplit(":", 1)[0])
    # the models first: an inputs folder is made for the model of the command
    return sorted(values, key=lambda v: v.rstrip("/") in DATA)


def _outputs(name: str, params: dict[str, Any]) -> list[str]:
    keys = ("output_path", "report_json", "save_config", "manifest")
    values = [params[key] for key in keys if params.get(key)]
    if name == "bundle" and len(params.get("paths") or ()) == 2:
        values.append(params["paths"][1])
    return values


def _model_of(name: str, params: dict[str, Any]) -> str | None:
    if name == "bundle":
        return params["paths"][0] if params.get("paths") else None
    return params.get("input_path") or params.get("original") or next(iter(params.get("models") or ()), None)


def _not_run(step: Step) -> str | None:
    reasons = [why for (page, part), why in NOT_RUN.items() if page == step.page and part in step.source]
    return reasons[0] if reasons else None


@pytest.fixture
def world(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> World:
    folder = tmp_path / "world"
    folder.mkdir()
    return World(folder, tmp_path_factory.getbasetemp())


# --------------------------------------------------------------------------------------------
# Running the shell blocks


def _block_id(block: Block) -> str:
    first = next(s for s in steps(block) if s.kind == "cli")
    return first.id


@pytest.mark.parametrize("block", [b for b in shell_blocks() if b.page == "README.md"], ids=_block_id)
def test_the_readmes_commands_run(block: Block, world: World) -> None:
    world.run(block)


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in shell_blocks() if b.page != "README.md"], ids=_block_id)
def test_the_docs_commands_run(block: Block, world: World) -> None:
    not_run = world.run(block)
    ran = [s for s in steps(block) if s.kind == "cli" and not _not_run(s)]
    if not ran:
        pytest.skip("; ".join(not_run))


def test_not_run_names_lines_of_the_docs() -> None:
    """Every entry of NOT_RUN matches exactly one line of the docs, so it cannot outlive it."""
    lines = [s for b in all_blocks() if b.lang in SHELL_LANGS for s in steps(b)]
    for (page, part), _ in NOT_RUN.items():
        matches = {s.source for s in lines if s.page == page and part in s.source}
        assert len(matches) == 1, f"NOT_RUN's {page}: {part!r} matches {sorted(matches)}"


# --------------------------------------------------------------------------------------------
# Running the Python blocks


@dataclasses.dataclass(frozen=True)
class Py:
    """How a Python block runs: in the default run or the slow set, what it reads (with the model
    an inputs folder is made for), and the names it uses that a user defines elsewhere."""

    when: str  # default, slow, or never (then `why` says why)
    needs: tuple[str, ...] = ()
    data_for: str = "encoder.onnx"
    names: Callable[[Path], dict[str, Any]] | None = None
    subprocess: bool = False
    why: str = ""


def _api_names(folder: Path) -> dict[str, Any]:
    import onnx_ir

    return {
        "onnx_model_proto": onnx.load(folder / "encoder.onnx"),
        "ir_model": onnx_ir.load(folder / "encoder.onnx"),
        "my_score": lambda path: 1.0,  # your measure of a model file; here a constant
    }


def _samples(folder: Path) -> dict[str, Any]:
    t = np.arange(2 * 16000) / 16000
    np.save(folder / "samples.npy", (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32))
    return {}


PYTHON: dict[tuple[str, str], Py] = {
    # (page, a part of the block that tells it apart): how it runs. Every block has an entry.
    ("README.md", 'convert_file("encoder.onnx"'): Py("default", ("encoder.onnx",)),
    ("docs/api.md", "build_bundle("): Py(
        "slow", ("encoder.onnx", "utts/", "rec.onnx", "decoder_joint.onnx", "fp32/"), names=_api_names
    ),
    ("docs/api.md", "bench_models("): Py("default", ("encoder.onnx", "encoder.int4.onnx")),
    ("docs/api.md", "ConvToMatMulPass("): Py("default", ("encoder.onnx",)),
    ("docs/bundles.md", "onnx_asr.load_model"): Py("slow", ("int4/", "speech.wav")),
    # sherpa-onnx ends the process on a model it cannot use: its own process.
    ("docs/bundles.md", "sherpa_onnx.OfflineRecognizer"): Py(
        "slow", ("int4-sherpa/",), names=_samples, subprocess=True
    ),
    ("docs/quantize.md", "# ocr_metric.py"): Py("default"),  # defines the function; scored below
    ("docs/quantize.md", "from PIL import Image"): Py(
        "never", why="needs Pillow, which the project does not depend on, and your labelled lines"
    ),
    ("docs/quantize.md", "AutoOptions(metric="): Py(
        "slow", ("encoder.onnx", "utts/", "rec.onnx", "calib/", "ocr_metric.py")
    ),
}


def _entry(block: Block) -> Py:
    keys = [key for key in PYTHON if key[0] == block.page and key[1] in block.text]
    assert len(keys) == 1, f"{block.id}: {len(keys)} entries of PYTHON match this block; it needs one"
    return PYTHON[keys[0]]


def test_every_python_block_has_one_entry() -> None:
    for block in python_blocks():
        _entry(block)
    for page, part in PYTHON:
        matches = [b.id for b in python_blocks() if b.page == page and part in b.text]
        assert len(matches) == 1, f"PYTHON's {page}: {part!r} matches {matches}"


def _run_python(block: Block, world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = _entry(block)
    for name in entry.needs:
        world.provide(name, entry.data_for)
    names = entry.names(world.folder) if entry.names else {}
    monkeypatch.chdir(world.folder)
    if entry.subprocess:
        script = "import numpy as np\nsamples = np.load('samples.npy')\n" + block.text
        result = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, check=False, timeout=300
        )
        assert result.returncode == 0, f"{block.id}: exited {result.returncode}:\n{result.stderr[-3000:]}"
        return
    monkeypatch.syspath_prepend(str(world.folder))
    monkeypatch.delitem(sys.modules, "ocr_metric", raising=False)
    exec(compile(block.text, block.id, "exec"), {"__name__": "__docs__", **names})


def _python(when: str) -> list[Block]:
    return [b for b in python_blocks() if _entry(b).when == when]


@pytest.mark.parametrize("block", _python("default"), ids=lambda b: b.id)
def test_the_python_examples_run(block: Block, world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    _run_python(block, world, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("block", _python("slow"), ids=lambda b: b.id)
def test_the_slower_python_examples_run(block: Block, world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    _run_python(block, world, monkeypatch)


@pytest.mark.slow
def test_the_worked_metric_scores_the_recognizer(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/quantize.md's ocr_metric.py on the recognizer it is written for, with one line."""
    from model_cache import FETCHER
    from real_packages import REC

    model = FETCHER.fetch(REC)
    (block,) = [b for b in python_blocks() if "# ocr_metric.py" in b.text]
    lines = world.folder / "eval"
    lines.mkdir()
    x = np.random.default_rng(0).uniform(-1, 1, (1, 3, 48, 160)).astype(np.float32)
    np.savez(lines / "line0000.npz", x=x)
    (lines / "labels.json").write_text(json.dumps({"line0000.npz": "abc"}), encoding="utf-8")
    monkeypatch.chdir(world.folder)
    namespace: dict[str, Any] = {"__name__": "ocr_metric"}
    exec(compile(block.text, block.id, "exec"), namespace)
    score = namespace["score"](str(model))
    assert np.isfinite(score) and score <= 1.0


def test_the_placeholder_maps_are_used() -> None:
    """Every name the maps give a stand-in for is one the docs use, so no entry outlives them."""
    text = "\n".join(b.text for b in all_blocks() if b.lang in SHELL_LANGS | {"python"})
    unused = [name for name in [*SOURCES, *PRODUCTS, *DATA] if name not in text]
    assert not unused, f"names no docs block uses any more: {unused}"
