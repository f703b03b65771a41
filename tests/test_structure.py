"""The package's shape: no import circle (between stages or inside one, counting the imports made
for type annotations only), stage folders that import only downward at run time."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "onnx_conv2matmul"
SRC = Path(__file__).resolve().parent.parent / "src" / PACKAGE


def _module_name(path: Path) -> str:
    parts = [PACKAGE, *path.relative_to(SRC).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in SRC.rglob("*.py")}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(tree: ast.AST, *, typing: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that runs (at import or in a call), and with ``typing`` those under
    TYPE_CHECKING too."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if not typing and isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def imports_of(module: str, *, typing: bool = False) -> set[str]:
    """The package's modules that ``module`` imports at run time, and with ``typing`` for type
    annotations too (a package's names resolve to its ``__init__``, a submodule named in
    ``from pkg import sub`` to the submodule)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: set[str] = set()
    for node in _runtime_imports(ast.parse(path.read_text()), typing=typing):
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names if a.name in MODULES)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*anchor, *([base] if base else [])])
        if not base.startswith(PACKAGE):
            continue
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            targets.add(sub if sub in MODULES else base)
    targets.discard(module)
    return {t for t in targets if t in MODULES}


def _circles() -> list[list[str]]:
    """The import circles between the package's modules, an import for type annotations only
    counting as one that runs: a circle of types is still two modules that cannot be read (or
    moved) apart, and the next import that runs closes it."""
    return find_circles({m: imports_of(m, typing=True) for m in MODULES})


def find_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (its first node repeated at the end) for each edge closing one in a
    depth-first walk of ``graph``; none when the graph has none."""
    circles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, set())):
            if state.get(nxt) == 1:
                circles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return circles


def test_no_import_circle() -> None:
    assert _circles() == []


def test_the_check_finds_a_circle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader itself: two modules importing each other (one inside a function) are a circle;
    an import under TYPE_CHECKING is not one that runs."""
    (tmp_path / "a.py").write_text("from onnx_conv2matmul import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from onnx_conv2matmul.a import x\n")
    (tmp_path / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import onnx_conv2matmul.a\n"
    )
    (tmp_path / "d.py").write_text("from . import c\n")
    fake = {f"{PACKAGE}.{n}": tmp_path / f"{n}.py" for n in "abcd"}
    monkeypatch.setattr(f"{__name__}.MODULES", fake)
    monkeypatch.setattr(f"{__name__}.SRC", tmp_path)
    assert imports_of(f"{PACKAGE}.c") == set()
    assert imports_of(f"{PACKAGE}.c", typing=True) == {f"{PACKAGE}.a"}
    assert imports_of(f"{PACKAGE}.d") == {f"{PACKAGE}.c"}
    assert _circles() == [[f"{PACKAGE}.a", f"{PACKAGE}.b", f"{PACKAGE}.a"]]


def test_the_check_finds_a_circle_inside_a_stage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three modules of one stage folder in a ring (as files/ had: load -> output -> publish ->
    load), one arrow an import for type annotations only, one a relative import in a function:
    a circle, though no stage imports another."""
    stage = tmp_path / "s"
    stage.mkdir()
    (stage / "__init__.py").write_text('"""A stage."""\n')
    (stage / "load.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from onnx_conv2matmul.s.output import O\n"
    )
    (stage / "output.py").write_text("from onnx_conv2matmul.s import publish\n")
    (stage / "publish.py").write_text("def f():\n    from .load import mode\n")
    (stage / "paths.py").write_text("from . import load\n")
    fake = {f"{PACKAGE}.s": stage / "__init__.py"} | {
        f"{PACKAGE}.s.{p.stem}": p for p in stage.glob("*.py") if p.stem != "__init__"
    }
    monkeypatch.setattr(f"{__name__}.MODULES", fake)
    monkeypatch.setattr(f"{__name__}.SRC", tmp_path)
    ring = [f"{PACKAGE}.s.{n}" for n in ("load", "output", "publish", "load")]
    assert _circles() == [ring]
    assert imports_of(f"{PACKAGE}.s.paths") == {f"{PACKAGE}.s.load"}


def test_find_circles_on_small_graphs() -> None:
    assert find_circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert find_circles({"a": {"a"}}) == [["a", "a"]]
    assert find_circles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []  # a diamond is no circle
    assert find_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_circles({"x": {"y"}, "y": {"x", "z"}, "z": {"z"}}) == [["x", "y", "x"], ["z", "z"]]


# What each stage may import (besides the shared modules at the package's top).
SHARED = {"errors", "report", "_graphs", "_version"}
MAY_IMPORT = {
    "rewrite": set(),
    "files": set(),
    "verify": set(),
    "quantize": {"rewrite", "verify", "files", "speed"},
    "bundle": {"quantize", "rewrite", "verify", "files"},
    "speed": {"verify", "files"},
}


def test_the_stages_themselves_form_no_circle() -> None:
    graph = {stage: MAY_IMPORT[stage] - {stage} for stage in MAY_IMPORT}
    assert find_circles(graph) == []


@pytest.mark.parametrize("stage", sorted(MAY_IMPORT))
def test_stages_import_only_downward(stage: str) -> None:
    prefix = f"{PACKAGE}.{stage}"
    allowed = {stage, *MAY_IMPORT[stage], *SHARED}
    wrong = {
        (module, target)
        for module in MODULES
        if module == prefix or module.startswith(prefix + ".")
        for target in imports_of(module)
        if target != PACKAGE and target.split(".")[1] not in allowed
    }
    assert wrong == set()


def test_every_stage_says_what_it_does_and_may_import() -> None:
    for stage in ("rewrite", "verify", "quantize", "files", "bundle", "cli", "speed"):
        doc = ast.get_docstring(ast.parse((SRC / stage / "__init__.py").read_text()))
        assert (doc is not None and "May import" in doc) or "may import" in (doc or ""), stage


# The quantize workflow's modules: one plan and one run (both in quantize/plan.py), and the one
# pass's state (quantize/onepass.py), carry a quantize run, so no function there takes more than a
# handful of parameters.
WORKFLOW_MODULES = (
    "quantize/workflow.py",
    "quantize/plan.py",
    "quantize/onepass.py",
    "quantize/measure.py",
    "quantize/build.py",
    "quantize/check.py",
    "quantize/decide.py",
    "quantize/run_report.py",
    "quantize/check_publish.py",
    "quantize/int8_step.py",
    "quantize/kernel.py",
)
MAX_PARAMETERS = 5


def parameter_counts(source: str) -> dict[str, int]:
    """Every function's (and method's, nested or not) name with its number of parameters, ``self``,
    ``*args`` and ``**kwargs`` included."""
    counts: dict[str, int] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            count = len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs)
            count += (args.vararg is not None) + (args.kwarg is not None)
            name = node.name if not isinstance(node, ast.Lambda) else f"lambda at line {node.lineno}"
            counts[name] = max(count, counts.get(name, 0))
    return counts


def test_parameter_counts_are_counted() -> None:
    source = "def f(a, /, b, *c, d, **e):\n    g = lambda x, y: x\n\nclass K:\n    def m(self, z): ...\n"
    assert parameter_counts(source) == {"f": 5, "lambda at line 2": 2, "m": 2}


@pytest.mark.parametrize("module", WORKFLOW_MODULES)
def test_no_workflow_function_takes_more_than_five_parameters(module: str) -> None:
    counts = parameter_counts((SRC / module).read_text())
    assert counts  # the module is there and has functions
    assert {name: n for name, n in counts.items() if n > MAX_PARAMETERS} == {}


# Every module stays short enough to read whole.
MAX_LINES = 500


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_every_module_is_under_500_lines() -> None:
    long = {
        path.relative_to(SRC).as_posix(): _lines(path)
        for path in MODULES.values()
        if _lines(path) >= MAX_LINES
    }
    assert long == {}


def private_imports(module: str) -> list[tuple[str, str, bool]]:
    """Each private name (one leading underscore) ``module`` imports from the package: the module
    it comes from, the name, and whether it is re-exported (``import _x as _x``)."""
    found = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append((node.module or "", alias.name, alias.asname == alias.name))
    return found


def _stage(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def test_private_names_stay_in_their_stage_and_are_never_re_exported() -> None:
    """A name with a leading underscore is a module's own, shared at most with the modules of
    its stage folder; one that another stage needs, or that a module passes on, is public."""
    wrong = [
        (module, source, name)
        for module in MODULES
        for source, name, re_exported in private_imports(module)
        if re_exported or _stage(source) != _stage(module)
    ]
    assert wrong == []


def test_the_private_import_check_sees_both_faults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a.py").write_text(
        "from onnx_conv2matmul.verify.x import _y as _y\nfrom onnx_conv2matmul.files.z import _w\n"
    )
    monkeypatch.setattr(f"{__name__}.MODULES", {f"{PACKAGE}.rewrite.a": tmp_path / "a.py"})
    assert private_imports(f"{PACKAGE}.rewrite.a") == [
        (f"{PACKAGE}.verify.x", "_y", True),
        (f"{PACKAGE}.files.z", "_w", False),
    ]


def option_declarations(source: str) -> list[str]:
    """The long option names each ``click.option(...)`` call in ``source`` declares."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "option"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "click"
        ):
            names += [
                a.value
                for a in node.args
                if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("--")
            ]
    return names


def test_every_command_line_option_is_declared_once() -> None:
    """An option several commands take is one declaration (in cli/flags.py) that each command
    applies, with its own wording where its meaning differs: never a second ``click.option``."""
    counts: dict[str, list[str]] = {}
    for path in sorted((SRC / "cli").glob("*.py")):
        for name in option_declarations(path.read_text()):
            counts.setdefault(name, []).append(path.name)
    assert {name: where for name, where in counts.items() if len(where) > 1} == {}
    assert option_declarations('click.option("-q", "--quiet", is_flag=True)\nclick.option("--x")\n') == [
        "--quiet",
        "--x",
    ]


def documented_layout() -> dict[str, set[str]]:
    """The "may import" column of docs/development.md's layout table, by stage folder."""
    page = (SRC.parent.parent / "docs" / "development.md").read_text()
    table = page.split("## The layout", 1)[1].split("\n## ", 1)[0]
    layout: dict[str, set[str]] = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`") and cells[0].endswith("/`"):
            allowed = set() if cells[2] == "(none)" else {c.strip() for c in cells[2].split(",")}
            layout[cells[0].strip("`/")] = allowed
    return layout


def test_the_contributors_page_states_the_layout_the_code_has() -> None:
    """docs/development.md's table names each stage with what it may import: the same as
    :data:`MAY_IMPORT`, which test_stages_import_only_downward holds the code to."""
    documented = documented_layout()
    assert documented.pop("cli") == {"everything; nothing imports it"}
    assert documented == MAY_IMPORT
