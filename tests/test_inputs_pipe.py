"""--inputs from a pipe (issue 43, rule 3: ``--inputs <(...)``, a ``/dev/fd/N``): read for what it
is, an .npz archive streamed into memory, or refused in one line that says why."""

from __future__ import annotations

import io
import os
import threading
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from helpers import conv_model
from onnx_conv2matmul.cli.app import main
from onnx_conv2matmul.errors import InputError
from onnx_conv2matmul.verify.given import load_inputs


def _fifo(tmp_path: Path, data: bytes) -> Path:
    """A named pipe that a thread fills with ``data`` once it is opened."""
    path = tmp_path / "inputs.fifo"
    os.mkfifo(path)

    def write() -> None:
        with open(path, "wb") as handle:
            handle.write(data)

    threading.Thread(target=write, daemon=True).start()
    return path


def _npz(**arrays: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def test_an_npz_from_a_pipe_is_one_feed(tmp_path: Path) -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    (feed,) = load_inputs([_fifo(tmp_path, _npz(x=x))])
    assert np.array_equal(feed["x"], x) and feed.source.endswith("inputs.fifo")


@pytest.mark.parametrize(
    ("data", "why"), [(b"hello\n", "not an .npz file"), (_npz(), "holds no arrays")], ids=["text", "empty"]
)
def test_a_pipe_that_is_no_npz_is_refused_for_what_it_is(tmp_path: Path, data: bytes, why: str) -> None:
    with pytest.raises(InputError, match=why):
        load_inputs([_fifo(tmp_path, data)])


def test_verify_reads_its_inputs_from_a_pipe(tmp_path: Path) -> None:
    import onnx

    onnx.save(conv_model(), tmp_path / "m.onnx")
    x = np.random.default_rng(0).standard_normal((2, 6, 16)).astype(np.float32)
    pipe = _fifo(tmp_path, _npz(x=x))
    model = str(tmp_path / "m.onnx")
    result = CliRunner().invoke(main, ["verify", model, model, "--inputs", str(pipe)])
    assert result.exit_code == 0, result.output
