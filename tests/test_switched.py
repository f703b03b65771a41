"""The classes' candidates as one model (``classes.switched_model``): each class's layers behind an
``If`` on a flag of its own, one session for every class. The losses must be those of the classes built
apart, and the model with every flag false the float model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from click.testing import CliRunner

from onnx_conv2matmul.cli.app import main
from onnx_conv2matmul.quantize import classes as _switched
from test_classes import BLOCKS, C, repeated_blocks


def _quantize(src: Path, dst: Path) -> dict:
    result = CliRunner().invoke(
        main, ["quantize", str(src), str(dst), "--no-bench", "--report-json-stdout"], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_the_switched_losses_are_those_of_the_classes_built_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "blocks.onnx"
    onnx.save(repeated_blocks(), src)
    made: list[ir.Model | None] = []
    real = _switched.switched_model

    def keep(*args: object) -> ir.Model | None:
        model = real(*args)  # type: ignore[arg-type]
        made.append(model)
        return model

    monkeypatch.setattr(_switched, "switched_model", keep)
    together = _quantize(src, tmp_path / "together.onnx")
    assert len(made) == 1 and made[0] is not None
    monkeypatch.setattr(_switched, "switched_model", lambda *args: None)  # built apart, as before
    apart = _quantize(src, tmp_path / "apart.onnx")
    one, other = together["one_pass"]["classes"]["measured"], apart["one_pass"]["classes"]["measured"]
    assert [g["first"] for g in one] == [g["first"] for g in other] and len(one) >= 2
    for a, b in zip(one, other, strict=True):
        assert a["measured_loss"] == pytest.approx(b["measured_loss"], rel=1e-4, abs=1e-9)
    assert together["options"]["quantize"]["nodes"] == apart["options"]["quantize"]["nodes"]
    assert (tmp_path / "together.onnx").read_bytes() == (tmp_path / "apart.onnx").read_bytes()

    # The graph: every layer of the blocks behind an If on its class's flag, one flag a class.
    model = made[0]
    switches = [node for node in model.graph if node.op_type == "If"]
    assert len(switches) == 2 * BLOCKS
    flags = [value.name for value in model.graph.inputs if value.name != "x"]
    assert flags == [_switched.FLAG.format(i) for i in range(len(one))]
    assert not any(node.op_type in ("MatMul", "MatMulNBits") for node in model.graph)
    for node in switches:
        then = node.attributes["then_branch"].as_graph()
        otherwise = node.attributes["else_branch"].as_graph()
        assert [n.op_type for n in then] == ["MatMulNBits"] and [n.op_type for n in otherwise] == ["MatMul"]

    # Run: every flag false is the float model; one class's flag alone, a model with that class
    # quantized, at several lengths.
    path = tmp_path / "switched.onnx"
    ir.save(model, path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    original = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(5)
    for length in (1, 8, 33):
        x = rng.standard_normal((2, length, C)).astype(np.float32)
        want = original.run(None, {"x": x})[0]
        off = _switched.Flagged(session, len(flags), -1).run(None, {"x": x})[0]
        np.testing.assert_allclose(off, want, rtol=1e-5, atol=1e-5)
        first = _switched.Flagged(session, len(flags), 0).run(None, {"x": x})[0]
        assert not np.allclose(first, want, rtol=1e-6, atol=1e-6)  # the class quantized moves it


def test_a_layer_the_switch_does_not_take_builds_the_classes_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A class naming a layer that is not a main-graph MatMul (as a layer in a subgraph is not):
    no switched model, and each class is built and measured apart."""
    real = _switched.switched_model
    seen: list[object] = []

    def with_a_stranger(plan: object, quantize: object, groups: list[list[str]], cache: object) -> object:
        model = real(plan, quantize, [*groups[:-1], [*groups[-1], "not-in-the-graph"]], cache)  # type: ignore[arg-type]
        seen.append(model)
        return model

    monkeypatch.setattr(_switched, "switched_model", with_a_stranger)
    src = tmp_path / "blocks.onnx"
    onnx.save(repeated_blocks(), src)
    data = _quantize(src, tmp_path / "q.onnx")
    assert seen == [None]
    assert all(g["measured_loss"] is not None for g in data["one_pass"]["classes"]["measured"])
    assert "scaled to their losses" in data["one_pass"]["classes"]["note"]


def test_the_losses_of_a_large_model_are_kept_and_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Above the cache's size (patched to 0 here) a second run on the same model reads the classes'
    losses instead of measuring them again, and says so; its model is the same. Another floor is
    another key; ``--no-bench-cache`` measures afresh."""
    from onnx_conv2matmul.quantize import check as _check
    from onnx_conv2matmul.quantize import measure as _measure

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(_measure, "CACHE_MIN_BYTES", 0)
    real, runs = _check.check, []

    def counted(session: object, *args: object, **kwargs: object) -> object:
        short = kwargs.get("runs")
        if short is not None and short.only:  # type: ignore[attr-defined]
            runs.append(1)
        return real(session, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_check, "check", counted)
    src = tmp_path / "blocks.onnx"
    onnx.save(repeated_blocks(), src)

    def quantize(name: str, *more: str) -> tuple[dict, int]:
        before = len(runs)
        timed = "--no-bench-cache" in more
        result = CliRunner().invoke(
            main,
            ["quantize", str(src), str(tmp_path / name), "--report-json-stdout", *more]
            + ([] if timed else ["--no-bench"]),
            catch_exceptions=False,
        )
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout), len(runs) - before

    first, measured = quantize("a.onnx")
    classes = len(first["one_pass"]["classes"]["measured"])
    assert measured == classes and "kept in the cache" not in first["one_pass"]["classes"]["note"]
    assert len(list((tmp_path / "cache" / "onnx-conv2matmul" / "class-losses").iterdir())) == 1
    second, measured = quantize("b.onnx")
    assert measured == 0 and "their losses kept in the cache" in second["one_pass"]["classes"]["note"]
    assert second["one_pass"]["classes"]["measured"] == first["one_pass"]["classes"]["measured"]
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()
    _, measured = quantize("c.onnx", "--min-cosine", "0.995")
    assert measured == classes
    _, measured = quantize("d.onnx", "--no-bench-cache")
    assert measured == classes


def test_the_searchs_losses_alone_are_those_of_each_node_built_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--auto's measured ranking (each MatMul quantized alone, its loss on the inputs) takes every
    node's loss from one switched model: the same losses as building each node's model apart."""
    from onnx_conv2matmul.quantize import ranking
    from onnx_conv2matmul.quantize.options import AutoOptions
    from onnx_conv2matmul.quantize.search import search, synthesised_feeds
    from onnx_conv2matmul.rewrite.options import ConvertOptions
    from onnx_conv2matmul.rewrite.passes import rewrite_model
    from onnx_conv2matmul.verify.check import VerifyOptions

    encoder = Path(__file__).parent / "data" / "conformer_small.onnx"
    feeds = synthesised_feeds(str(encoder), VerifyOptions(lengths=(64,)))
    switched: list[int] = []
    real = ranking._losses_switched

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        found = real(*args, **kwargs)
        switched.append(len(found or {}))
        return found

    def losses(folder: str) -> dict:  # type: ignore[type-arg]
        model = ir.load(encoder)
        rewrite_model(model, ConvertOptions(extended=True, allow_non_unit_dilation=True))
        (tmp_path / folder).mkdir()
        kept: dict = {}  # type: ignore[type-arg]
        options = AutoOptions(min_cosine=0.999, criterion="measured", max_evaluations=2)
        search(model, feeds, options, str(tmp_path / folder), deterministic=True, losses=(("m",), kept))
        return {key[-2:]: loss for key, loss in kept.items()}

    monkeypatch.setattr(ranking, "_losses_switched", counted)
    together = losses("together")
    assert len(switched) == 1 and switched[0] >= 10  # every node's loss from the one model
    monkeypatch.setattr(ranking, "_losses_switched", lambda *_args: None)
    apart = losses("apart")
    assert together.keys() == apart.keys()
    assert switched[0] == len([name for name, _ in apart if name != "(other weights)"])
    for key, loss in apart.items():
        assert together[key] == pytest.approx(loss, rel=1e-4, abs=1e-7), key
