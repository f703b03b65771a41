"""The check's runs: which dims take the lengths, what each run holds, and memory that runs out.

Issue 23: a check fed a fixed-batch model ``[1, 'T', 4]`` at T = 1 while reporting lengths
64..191 (finding 1); identical joints ``[B, T, U, 8000]`` failed (finding 2: every length on
every dim at once, outputs held and compared in float64 until memory ran out); memory that ran
out was reported as a difference or an internal error (finding 3).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from onnx_conv2matmul.cli.app import main
from onnx_conv2matmul.errors import Hint, InputError, OutOfMemory
from onnx_conv2matmul.verify import feeds as feeds_mod
from onnx_conv2matmul.verify import run as run_mod
from onnx_conv2matmul.verify.check import LONG_LENGTH, VerifyOptions, verify_models
from onnx_conv2matmul.verify.feeds import InputSpec, dim_roles, synthesise_inputs
from onnx_conv2matmul.verify.options import parse_size
from onnx_conv2matmul.verify.plan import Planner, held, plan_lengths
from onnx_conv2matmul.verify.sizes import Growth, OutputDecl, OutputSizes, eval_dim

DATA = Path(__file__).parent / "data"
OPSET = [helper.make_opsetid("", 17)]


def _save(model: onnx.ModelProto, path: Path) -> str:
    onnx.save(model, path)
    return str(path)


def _invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def _time_model(cumsum: bool, dim: str | None = "T") -> onnx.ModelProto:
    """x [1, dim, 4] -> y: Identity, or CumSum over the time axis (equal only when dim is 1)."""
    if cumsum:
        nodes = [helper.make_node("CumSum", ["x", "axis"], ["y"])]
    else:
        nodes = [helper.make_node("Identity", ["x"], ["y"])]
    graph = helper.make_graph(
        nodes,
        "time",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, dim, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, dim, 4])],
        [numpy_helper.from_array(np.array(1, np.int64), "axis")],
    )
    return helper.make_model(graph, opset_imports=OPSET)


@pytest.mark.parametrize("dim", ["T", None, "d1"])
def test_a_fixed_batch_of_one_leaves_the_lengths_on_time(tmp_path: Path, dim: str | None) -> None:
    """Finding 1: [1, T, 4] is checked at T = 64..191, so a CumSum over T is caught."""
    a = _save(_time_model(False, dim), tmp_path / "a.onnx")
    b = _save(_time_model(True, dim), tmp_path / "b.onnx")
    report = verify_models(a, b)
    assert not report.passed
    assert [r.shape for r in report.results] == [[1, n, 4] for n in (64, 80, 97, 128, 191)]
    fed = [run.dims for run in report.runs]
    key = dim or "(unnamed)"
    assert fed == [{key: n} for n in (64, 80, 97, 128, 191)]
    assert verify_models(a, a).passed
    code, _, stderr = _invoke("verify", a, b)
    assert code == 1 and "Verification FAILED" in stderr
    assert f"{key} sequence 64, 80, 97, 128, 191" in stderr


def test_quantize_checks_a_fixed_batch_model_at_its_lengths(tmp_path: Path) -> None:
    """The same in quantize's check: [1, 'T', 64] runs at every default length, not at T = 1."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", 64])],
        [numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "w")],
    )
    src = _save(helper.make_model(graph, opset_imports=OPSET), tmp_path / "m.onnx")
    code, stdout, stderr = _invoke("quantize", src, str(tmp_path / "q.onnx"), "--report-json-stdout")
    assert code == 0, stderr
    verification = json.loads(stdout)["verification"]
    assert [r["shape"] for r in verification["results"]] == [[1, n, 64] for n in (64, 80, 97, 128, 191)]
    assert [run["dims"] for run in verification["lengths"]["runs"]] == [
        {"T": n} for n in (64, 80, 97, 128, 191)
    ]


def _roles(*specs: InputSpec, **options: object) -> feeds_mod.Roles:
    return dim_roles(list(specs), VerifyOptions(**options))  # type: ignore[arg-type]


def _role_of(roles: feeds_mod.Roles) -> dict[str, str]:
    return {d.key: d.role.value for d in roles.dims}


def test_dim_roles_from_names_positions_and_the_inputs_together() -> None:
    f32, i64 = np.float32, np.int64
    # The seed's decoder/joint: names decide, the length input measures its own input's dim.
    joint = _roles(
        InputSpec("encoder_outputs", f32, ["batch", 1024, "time"]),
        InputSpec("targets", i64, ["batch", "tokens"]),
        InputSpec("target_length", i64, ["batch"]),
        InputSpec("input_states_1", f32, [2, "batch", 640]),
    )
    assert _role_of(joint) == {"batch": "batch", "time": "sequence", "tokens": "sequence"}
    assert joint.primary == "time" and joint.sequence == ["time", "tokens"]
    assert joint.length_of == {"target_length": "tokens"} and not joint.speech and not joint.warnings
    # Exporter names that say nothing: positions decide (dynamo's s0/s1, the legacy exporter's).
    dynamo = _roles(InputSpec("audio_signal", f32, ["s0", 128, "s1"]), InputSpec("length", i64, ["s0"]))
    assert _role_of(dynamo) == {"s0": "batch", "s1": "sequence"}
    assert dynamo.speech and dynamo.length_of == {"length": "s1"}
    legacy = _roles(InputSpec("x", f32, ["x_dynamic_axes_1", 80, "x_dynamic_axes_2"]))
    assert _role_of(legacy) == {"x_dynamic_axes_1": "batch", "x_dynamic_axes_2": "sequence"}
    # A time-major input keeps its name's word; a state's batch sits on its first symbolic axis.
    assert _role_of(_roles(InputSpec("x", f32, ["T", "B", 80]))) == {"T": "sequence", "B": "batch"}
    state = _roles(InputSpec("h0", f32, [2, None, 64]), InputSpec("x", f32, [None, None, 64]))
    assert _role_of(state) == {"(unnamed batch)": "batch", "(unnamed)": "sequence"}
    # A rank-1 float input is a signal; a rank-1 integer length input is per batch row.
    assert _role_of(_roles(InputSpec("wave", f32, ["samples"]))) == {"samples": "sequence"}
    assert _role_of(_roles(InputSpec("wave", f32, ["n"]))) == {"n": "sequence"}
    assert _role_of(_roles(InputSpec("lens", i64, ["k"]))) == {"k": "batch"}
    # A value given fixes the dim, whatever its name.
    assert _role_of(_roles(InputSpec("x", f32, [1, "T", 4]), dims={"T": 50})) == {"T": "fixed"}


def test_a_batch_that_may_be_time_gets_a_warning(tmp_path: Path) -> None:
    """x [d0, 4]: d0 is the batch by its position only and nothing takes the lengths."""
    roles = _roles(InputSpec("x", np.float32, ["d0", 4]))
    assert _role_of(roles) == {"d0": "batch"}
    assert len(roles.warnings) == 1 and "d0" in roles.warnings[0] and "time axis" in roles.warnings[0]
    assert not _roles(InputSpec("x", np.float32, ["batch", 4])).warnings  # its name says batch
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "flat",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["d0", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["d0", 4])],
    )
    src = _save(helper.make_model(graph, opset_imports=OPSET), tmp_path / "flat.onnx")
    report = verify_models(src, src)
    assert report.passed and report.warnings == list(roles.warnings)
    assert report.lengths == [0] and [run.dims for run in report.runs] == [{"d0": 1}]
    code, _, stderr = _invoke("verify", src, src)
    assert code == 0 and "Warning:" in stderr and "PASSED, with 1 warning above" in stderr
    assert "Lengths: none" in stderr
    # Lengths given that no dim takes are said to be unused, not reported as fed.
    report = verify_models(src, src, VerifyOptions(lengths=(7, 9)))
    assert report.lengths == [0] and any("not used" in w for w in report.warnings)


def test_a_length_input_whose_dim_cannot_be_told_gets_a_warning() -> None:
    roles = _roles(
        InputSpec("a", np.float32, ["B", "T", 8]),
        InputSpec("b", np.float32, ["B", "U", 8]),
        InputSpec("len", np.int64, ["B"]),
    )
    assert roles.length_of == {"len": "T"} and any("'len'" in w for w in roles.warnings)


def test_synthesised_length_follows_its_dim() -> None:
    specs = [
        InputSpec("encoder_outputs", np.float32, ["batch", 16, "time"]),
        InputSpec("targets", np.int64, ["batch", "tokens"]),
        InputSpec("target_length", np.int64, ["batch"]),
    ]
    options = VerifyOptions(batch=3)
    roles = dim_roles(specs, options)
    feeds, how = synthesise_inputs(specs, 50, options, {"batch": 3, "time": 50, "tokens": 7}, roles)
    assert feeds["encoder_outputs"].shape == (3, 16, 50) and feeds["targets"].shape == (3, 7)
    assert (
        feeds["target_length"].tolist() == [7, 7, 7]
        and how["target_length"] == "length of tokens per batch row"
    )


def _joint_model(vocab: int = 8000, hidden: int = 8, declared: bool = True) -> onnx.ModelProto:
    """enc [B, T, H] + dec [B, U, H] -> logits [B, T, U, vocab], as a transducer joint.

    Not ``declared``: the logits are flattened to [1, T * U, vocab] by a Reshape whose -1
    no shape inference names, and the output has no declared shape.
    """
    rng = np.random.default_rng(1)
    nodes = [
        helper.make_node("Unsqueeze", ["enc", "axis2"], ["e4"]),
        helper.make_node("Unsqueeze", ["dec", "axis1"], ["d4"]),
        helper.make_node("Add", ["e4", "d4"], ["sum"]),
        helper.make_node("Relu", ["sum"], ["act"]),
        helper.make_node("MatMul", ["act", "W"], ["logits" if declared else "joint"]),
    ]
    if not declared:
        nodes.append(helper.make_node("Reshape", ["joint", "flat"], ["logits"]))
    inits = [
        numpy_helper.from_array(np.array([2], np.int64), "axis2"),
        numpy_helper.from_array(np.array([1], np.int64), "axis1"),
        numpy_helper.from_array((rng.standard_normal((hidden, vocab)) / 4).astype(np.float32), "W"),
        numpy_helper.from_array(np.array([1, -1, vocab], np.int64), "flat"),
    ]
    shape = ["B", "T", "U", vocab] if declared else None
    graph = helper.make_graph(
        nodes,
        "joint",
        [
            helper.make_tensor_value_info("enc", TensorProto.FLOAT, ["B", "T", hidden]),
            helper.make_tensor_value_info("dec", TensorProto.FLOAT, ["B", "U", hidden]),
        ],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, shape)],
        inits,
    )
    return helper.make_model(graph, opset_imports=OPSET)


def _output_bytes(report: object, run_length: int) -> int:
    rows = [r for r in report.results if r.length == run_length]  # type: ignore[attr-defined]
    return sum(math.prod(r.shape) * 4 for r in rows)


def test_identical_joints_pass_within_the_budget(tmp_path: Path) -> None:
    """Finding 2: the same joint twice passes with default options, each run within the budget.

    Every default length on T and U at once would be 191 x 191 x 8000 floats (1.2 GB) per
    model; the plan keeps T at the default lengths and shortens U.
    """
    src = _save(_joint_model(), tmp_path / "joint.onnx")
    report = verify_models(src, src)
    assert report.passed, report.failures
    assert report.lengths == [64, 80, 97, 128, 191]
    assert held(report.runs) <= report.options.memory
    for run, row in zip(report.runs, report.results, strict=True):
        assert row.shape == [1, run.dims["T"], run.dims["U"], 8000]  # what was fed is what is reported
        assert run.outputs == _output_bytes(report, run.length)  # declared shapes: exact
    assert all(run.dims["U"] < run.dims["T"] for run in report.runs)
    assert "shortened to fit the memory budget" in report.lengths_rule
    # A larger budget lets U grow; given lengths beyond the budget are refused, not shortened.
    wide = verify_models(src, src, VerifyOptions(memory=parse_size("128MiB")))
    assert sum(r.dims["U"] for r in wide.runs) > sum(r.dims["U"] for r in report.runs)
    with pytest.raises(InputError, match="above the memory budget") as refused:
        verify_models(src, src, VerifyOptions(lengths=(191,)))
    assert refused.value.hint is Hint.VERIFY_BUDGET


def test_undeclared_output_sizes_are_measured(tmp_path: Path) -> None:
    """An output without a declared shape: measured at small lengths, then extrapolated."""
    src = _save(_joint_model(vocab=4000, declared=False), tmp_path / "joint.onnx")
    report = verify_models(src, src)
    assert report.passed and report.output_sizes.startswith("measured")
    for run, row in zip(report.runs, report.results, strict=True):
        actual = math.prod(row.shape) * 4
        assert row.shape == [1, run.dims["T"] * run.dims["U"], 4000]
        assert run.outputs == actual  # T * U is a product: exact
    assert held(report.runs) <= report.options.memory


def test_a_check_that_cannot_fit_says_so(tmp_path: Path) -> None:
    src = _save(_joint_model(vocab=4000), tmp_path / "joint.onnx")
    code, _, stderr = _invoke("verify", src, src, "--verify-memory", "64KiB")
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert "does not fit in the memory budget of 64 KiB" in stderr and "--verify-memory" in stderr
    code, _, stderr = _invoke("verify", src, src, "--verify-lengths", "100", "--verify-memory", "1MiB")
    assert code == 2 and "above the memory budget" in stderr and "--verify-memory" in stderr
    code, _, stderr = _invoke("verify", src, src, "--verify-lengths", "100", "--verify-memory", "400MiB")
    assert code == 0, stderr
    code, _, stderr = _invoke("verify", src, src, "--verify-memory", "lots")
    assert code == 2 and "not a size" in stderr


def test_parse_size() -> None:
    assert parse_size("512MiB") == 512 * 2**20 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("1G") == 2**30 and parse_size("1.5k") == 1536 and parse_size("300MB") == 300 * 10**6
    assert parse_size("65536") == 65536
    for bad in ("", "0", "-1M", "1Q", "MiB"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_speech_encoder_checks_a_long_input_at_batch_1() -> None:
    """Item 2: the default check of a speech encoder includes 30 s of 10 ms frames."""
    src = str(DATA / "conformer_small.onnx")
    report = verify_models(src, src, VerifyOptions(batch=2))
    assert report.passed
    assert report.lengths == [64, 80, 97, 128, 191, LONG_LENGTH]
    long = report.runs[-1]
    assert long.long and long.dims == {"batch": 1, "time": LONG_LENGTH}
    assert all(run.dims["batch"] == 2 for run in report.runs[:-1])
    assert "long run" in report.lengths_rule
    # The decoder/joint has two sequence dims: no long run.
    decoder = str(DATA / "tdt_decoder_small.onnx")
    assert LONG_LENGTH not in verify_models(decoder, decoder).lengths
    # Lengths given replace the defaults, the long run included.
    assert verify_models(src, src, VerifyOptions(lengths=(50,))).lengths == [50]


def test_eval_dim_reads_exporters_expressions() -> None:
    values = {"time": 3000, "s0": 2, "s1": 17}
    assert eval_dim("(((time - 1)//8)) + 1", values) == 375
    assert eval_dim("2*s0 + s1 % 4", values) == 5
    assert eval_dim("Max(1, s1 - 20)", values) == 1 and eval_dim("min(s0, s1)", values) == 2
    for unknown in ("unk__3", "s1 / 2", "floor(s1)", "s1 // 0", "", "import os", "s1 ** 2"):
        assert eval_dim(unknown, values) is None


def test_growth_covers_linear_and_product_sizes() -> None:
    base = {"T": 16, "U": 16}
    # T // 8 + 1: linear in T, exact.
    subsampled = Growth(3.0, base, {"T": (32, 5.0), "U": (32, 3.0)})
    assert subsampled.at({"T": 3000, "U": 1}) == 3000 // 8 + 1
    # T * U, (T // 8 + 1) * U, T + U, T**2: exact above and below the base.
    product = Growth(256.0, base, {"T": (32, 512.0), "U": (32, 512.0)})
    assert product.at({"T": 191, "U": 64}) == 191 * 64 and product.at({"T": 58, "U": 1}) == 58
    mixed = Growth(48.0, base, {"T": (32, 80.0), "U": (32, 96.0)})
    assert mixed.at({"T": 3000, "U": 3}) == (3000 // 8 + 1) * 3
    added = Growth(32.0, base, {"T": (32, 48.0), "U": (32, 48.0)})
    assert added.at({"T": 191, "U": 7}) == 198
    square = Growth(256.0, {"T": 16}, {"T": (32, 1024.0)})
    assert square.at({"T": 100}) == 100 * 100
    assert Growth(5.0, base, {"T": (32, 5.0)}).at({"T": 999}) == 5  # not a function of T


def _planner(shapes: list[list[int | str]], memory: int, feature: int = 8) -> Planner:
    specs = [
        InputSpec("enc", np.float32, ["B", feature, "T"]),
        InputSpec("dec", np.int64, ["B", "U"]),
    ]
    options = VerifyOptions(memory=memory)
    roles = dim_roles(specs, options)
    sizes = OutputSizes([OutputDecl(f"o{i}", 4, tuple(shape)) for i, shape in enumerate(shapes)])
    return Planner(specs, roles, sizes, options)


_DIMS = st.sampled_from(["B", "T", "U", 1, 3, 640, 8198])


@given(
    shapes=st.lists(st.lists(_DIMS, min_size=0, max_size=4), min_size=1, max_size=3),
    memory=st.integers(min_value=2**10, max_value=2**31),
)
def test_the_plan_fits_the_budget_for_any_shape(shapes: list[list[int | str]], memory: int) -> None:
    """Whatever the outputs, a plan holds at most the budget, or is refused with the hint."""
    planner = _planner(shapes, memory)
    try:
        plan = plan_lengths(planner.specs, planner.options, planner.roles, planner.sizes)
    except InputError as err:
        assert err.hint is Hint.VERIFY_BUDGET
        return
    assert plan.runs and held(plan.runs) <= memory
    for run in plan.runs:
        assert run.dims["B"] == 1 and run.dims["T"] >= 8 and run.dims["U"] >= 1
        assert run.inputs + run.outputs == planner.run(run.length, run.dims).inputs + planner.sizes.bytes(
            run.dims
        )


def test_out_of_memory_in_the_candidate_is_exit_2_not_a_difference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 3: onnxruntime's bad_alloc in any run ends the check with exit 2 and the option."""
    src = _save(_time_model(False), tmp_path / "a.onnx")
    real = run_mod.run_feeds

    def failing(opened: object, feeds: object, label: str, where: str, hint: object) -> object:
        if label == "candidate":
            raise OutOfMemory(
                "out of memory running the candidate model: std::bad_alloc", hint=Hint.VERIFY_OUT_OF_MEMORY
            )
        return real(opened, feeds, label, where, hint)  # type: ignore[arg-type]

    monkeypatch.setattr(run_mod, "run_feeds", failing)
    code, _, stderr = _invoke("verify", src, src)
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert "out of memory" in stderr and "--verify-memory" in stderr and "FAILED" not in stderr


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status: std::bad_alloc"),
        RuntimeError("Failed to allocate memory for requested buffer of size 1228800000"),
        MemoryError(),
    ],
)
def test_what_onnxruntime_and_numpy_raise_when_memory_runs_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> None:
    src = _save(_time_model(False), tmp_path / "a.onnx")

    class Session:
        def __init__(self, inner: object) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> object:
            return getattr(self.inner, name)

        def run(self, *args: object) -> object:
            raise error

    real = run_mod.session
    monkeypatch.setattr(run_mod, "session", lambda path, options: Session(real(path, options)))
    with pytest.raises(OutOfMemory) as raised:
        verify_models(src, src)
    assert raised.value.hint is Hint.VERIFY_OUT_OF_MEMORY
    code, _, stderr = _invoke("verify", src, src)
    assert code == 2 and len(stderr.strip().splitlines()) == 1 and "--verify-memory" in stderr, stderr


def test_memory_error_while_comparing_is_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from onnx_conv2matmul.verify import check

    def out_of_memory(*_args: object, **_kwargs: object) -> object:
        raise MemoryError

    src = _save(_time_model(False), tmp_path / "a.onnx")
    monkeypatch.setattr(check, "compare_outputs", out_of_memory)
    code, _, stderr = _invoke("verify", src, src)
    assert code == 2 and "out of memory during the check" in stderr and "--verify-memory" in stderr


_LIMITED = textwrap.dedent(
    """
    import resource, sys
    from onnx_conv2matmul.cli.app import main
    import onnxruntime, numpy
    status = open("/proc/self/status").read().splitlines()
    size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize"))
    resource.setrlimit(resource.RLIMIT_AS, (size + 768 * 2**20, resource.RLIM_INFINITY))
    main(sys.argv[1:], prog_name="onnx-conv2matmul")
    """
)


def test_memory_that_really_runs_out_is_exit_2(tmp_path: Path) -> None:
    """Under an address-space limit: a 1.2 GB output the budget allows but memory does not."""
    graph = helper.make_graph(
        [
            helper.make_node(
                "ConstantOfShape", ["n"], ["y"], value=numpy_helper.from_array(np.ones(1, np.float32))
            )
        ],
        "big",
        [helper.make_tensor_value_info("n", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    src = _save(helper.make_model(graph, opset_imports=OPSET), tmp_path / "big.onnx")
    args = ["verify", src, src, "--verify-input", "n=300000000", "--verify-memory", "8GiB", "-q"]
    proc = subprocess.run(
        [sys.executable, "-c", _LIMITED, *args], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "out of memory" in lines[0] and "--verify-memory" in lines[0], proc.stderr


def _scales_whole(magnitude: np.ndarray) -> np.ndarray:
    """element_scales as it was, on the whole array at once."""
    scale = np.full(magnitude.shape, max(1.0, float(magnitude.max(initial=0.0))))
    for axis, size in enumerate(magnitude.shape):
        if size < 2:
            continue
        others = tuple(a for a in range(magnitude.ndim) if a != axis)
        np.minimum(scale, np.maximum(1.0, magnitude.max(axis=others, keepdims=True, initial=0.0)), out=scale)
    return scale


_VALUES = st.sampled_from([0.0, 0.5, -2.0, 3.0, 1e3, -7.5, float("nan"), float("inf"), float("-inf")])


@given(
    shape=st.lists(st.integers(min_value=0, max_value=5), min_size=0, max_size=4),
    data=st.data(),
    chunk=st.integers(min_value=1, max_value=40),
)
def test_block_by_block_is_the_whole_comparison(shape: list[int], data: st.DataObject, chunk: int) -> None:
    """Any cut into blocks gives the figures of the whole output at once."""
    from onnx_conv2matmul.verify import tally

    size = math.prod(shape)
    ref = np.array(data.draw(st.lists(_VALUES, min_size=size, max_size=size)), np.float32).reshape(shape)
    out = np.array(data.draw(st.lists(_VALUES, min_size=size, max_size=size)), np.float32).reshape(shape)
    magnitude = np.where(np.isfinite(ref), np.abs(ref), 0).astype(np.float64)
    np.testing.assert_array_equal(tally.element_scales(magnitude), _scales_whole(magnitude))
    cut, whole = tally._float_tally(ref, out, chunk), tally._float_tally(ref, out, 1 << 30)
    for name in ("count", "max_diff", "max_ref", "mismatches"):
        assert getattr(cut, name) == getattr(whole, name), name
    for name in ("sum_diff", "ref_sq", "out_sq", "diff_sq", "dot"):
        assert math.isclose(getattr(cut, name), getattr(whole, name), rel_tol=1e-12, abs_tol=1e-12), name
    seen = np.zeros(shape, np.int64)
    for index in tally.blocks(tuple(shape), chunk):
        block = seen[index] if index else seen[...]
        assert block.size <= chunk
        block += 1
    assert (seen == 1).all()  # every element in exactly one block
    exact_cut = tally._exact_tally(ref > 0, out > 0, chunk)
    exact_whole = tally._exact_tally(ref > 0, out > 0, 1 << 30)
    assert (exact_cut.count, exact_cut.mismatches, exact_cut.sum_diff) == (
        exact_whole.count,
        exact_whole.mismatches,
        exact_whole.sum_diff,
    )


def test_bad_alloc_outside_the_check_is_exit_2_not_a_bug(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """onnxruntime's bad_alloc raised anywhere (here: the rewrite) is memory, not an internal error."""
    from onnx_conv2matmul import api

    def exhausted(*_args: object, **_kwargs: object) -> object:
        raise RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : std::bad_alloc")

    src = _save(_time_model(False), tmp_path / "a.onnx")
    monkeypatch.setattr(api, "convert_file", exhausted)
    code, _, stderr = _invoke(src, str(tmp_path / "b.onnx"))
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert "out of memory" in stderr and "internal error" not in stderr
