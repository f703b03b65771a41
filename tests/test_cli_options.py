"""Options and inputs that cannot work are refused before any work, with exit 2 and one line."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

from helpers import matmul_model, no_bench
from onnx_conv2matmul.cli.app import main
from onnx_conv2matmul.quantize.options import QuantizeOptions


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, no_bench(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def one_line(stderr: str) -> bool:
    return len(stderr.strip().splitlines()) == 1


# ---- 5. --block-size: what MatMulNBits supports ------------------------------------------------


@pytest.mark.parametrize("block_size", [8, 48, 512, 1024])
def test_block_size_outside_what_matmulnbits_supports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block_size: int
) -> None:
    src = tmp_path / "m.onnx"
    onnx.save(matmul_model(), src)

    def no_work(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("onnx_conv2matmul.quantize.workflow.load_input", no_work)
    code, _, stderr = invoke("quantize", str(src), str(tmp_path / "q.onnx"), "--block-size", str(block_size))
    assert code == 2, stderr
    assert "16, 32, 64, 128 or 256" in stderr and one_line(stderr)
    assert {p.name for p in tmp_path.iterdir()} == {"m.onnx"}
    with pytest.raises(ValueError, match="16, 32, 64, 128 or 256"):
        QuantizeOptions(block_size=block_size)


def test_every_supported_block_size_quantizes(tmp_path: Path) -> None:
    src = tmp_path / "m.onnx"
    onnx.save(matmul_model(), src)
    for block_size in (16, 32, 64, 128, 256):
        code, _, stderr = invoke(
            "quantize", str(src), str(tmp_path / "q.onnx"), "--block-size", str(block_size)
        )
        assert code == 0, stderr


# ---- 6. --int8-dynamic on a float16 model -------------------------------------------------------


@pytest.mark.parametrize("where", ["input-and-weight", "weight-only"])
def test_int8_dynamic_refuses_float16(tmp_path: Path, where: str) -> None:
    model = matmul_model(TensorProto.FLOAT16)
    if where == "weight-only":  # float32 in and out, a float16 weight behind a Cast
        model.graph.input[0].type.tensor_type.elem_type = TensorProto.FLOAT
        model.graph.output[0].type.tensor_type.elem_type = TensorProto.FLOAT
        model.graph.node.insert(0, helper.make_node("Cast", ["x"], ["x16"], to=TensorProto.FLOAT16))
        model.graph.node[1].input[0] = "x16"
        model.graph.node[1].output[0] = "y16"
        model.graph.node.append(helper.make_node("Cast", ["y16"], ["y"], to=TensorProto.FLOAT))
    src = tmp_path / "m.onnx"
    onnx.save(model, src)
    code, _, stderr = invoke("quantize", str(src), str(tmp_path / "q.onnx"), "--int8-dynamic")
    assert code == 2, stderr
    assert "float16" in stderr and "--int8-dynamic" in stderr and one_line(stderr)
    assert "--min-cosine" not in stderr
    assert {p.name for p in tmp_path.iterdir()} == {"m.onnx"}
    code, _, stderr = invoke("quantize", str(src), str(tmp_path / "q.onnx"), "-q")
    assert code == 0, "MatMulNBits takes float16"


# ---- 9. bundle on a directory without models ----------------------------------------------------


def test_bundle_of_a_directory_without_models(tmp_path: Path) -> None:
    (tmp_path / "vocab.txt").write_text("a\n")
    (tmp_path / "sub.onnx").mkdir()  # a directory is not a model
    code, stdout, stderr = invoke("bundle", "--check", str(tmp_path))
    assert code == 2 and stdout == ""
    assert "no .onnx models in" in stderr and one_line(stderr)


def test_every_option_of_every_command_says_what_it_does() -> None:
    """``--help`` explains each option; the ones declared once in cli/flags read the same everywhere."""
    import click

    ctx = click.Context(main)
    helps: dict[str, set[str]] = {}
    for name in main.list_commands(ctx):
        command = main.get_command(ctx, name)
        assert command is not None
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden:
                assert param.help, f"{name} {param.opts[0]} has no help"
                if name != "inspect":  # one model, not an input and an output
                    helps.setdefault(param.opts[-1], set()).add(param.help)
    for option in ("--report-json", "--report-json-stdout", "--skip-checker", "--verify-seed"):
        assert option in helps
    for option in ("--skip-checker", "--verify-seed"):
        assert len(helps[option]) == 1, helps[option]
