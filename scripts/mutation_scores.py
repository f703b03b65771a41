"""Print mutmut's score per module from its *.meta files (scripts/mutation.sh, docs/mutation.md).

Usage: python scripts/mutation_scores.py [--survivors] [MUTANTS_DIR...]

MUTANTS_DIR: where mutmut wrote its results; by default ``mutants/`` when there is one here
(scripts/mutation.sh runs this inside its copy), else ``.mutation/tree/mutants/``. Given several
(a run, then a rerun of its survivors by name with other tests), a mutant killed in any of them
is killed; otherwise the first verdict found stands, in the order given. Modules go by
their paths in the package (``rewrite/analysis``): those ``only_mutate`` names in pyproject.toml
(so a module split in two, with both halves named there, is followed), then any other module
mutmut left results for. Each stage folder with more than one module (``rewrite/``) is also
totalled.

``score`` is killed / total; ``non-eq`` is killed / (total - the equivalent mutants listed
in EQUIVALENT below that the run did not kill); ``of run`` is killed / the mutants that have a
verdict (a run stopped early leaves the others "not checked"). ``--survivors`` lists every
mutant not killed, marked ``equivalent`` when it is in EQUIVALENT.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

PACKAGE = "onnx_conv2matmul"
# mutmut's exit codes (mutmut.stats.status_by_exit_code): 1 and 3 killed, 37 caught by mypy.
KILLED = {1, 3, 37}
STATUS = {0: "survived", 5: "no tests", 33: "no tests", 34: "skipped", 36: "timeout", None: "not checked"}

_ASTYPE = "astype(None) is astype(float64)"
_STRICT = "zip(strict=...): the lengths were checked equal just before"
_INT64 = "np.array of Python ints is int64 (64-bit Linux and macOS, numpy 2)"
_BLOCK = "the rows copied per block: any whole step gives the same array (speed only)"
_AUTO_PAD = "auto_pad with a pads attribute is skipped before: pads are the default 0s"
_PART = "the per-tensor row: only .passed and .note are read, which do not depend on this"
# Mutants that cannot change behaviour, with the reason (docs/mutation.md), by mutmut's name less
# the package's ("rewrite.analysis.x__plan__mutmut_8"): a name holds while its function does not
# change (mutmut renumbers the mutants of a changed function). Where every mutant of a line is
# equivalent, the line has a "# pragma: no mutate" instead.
_BLOCK_EXACT = "a block's .exact is never read: _Tally.add keeps the total's"
_ASCII = "the journal is JSON written with ensure_ascii: the same bytes in any encoding"
_ERRNO = "use_errno only matters to ctypes.get_errno, never read"
_FALSY = "load_external_data=None is as false as False"
_DEFAULT = "a default changed in the mutant only: mutmut's trampoline passes the original's default"
_TENSOR_NAME = "the materialized tensor's name: never read (the initializer is named by its value)"
_TWICE = "a weight listed twice: remove_dead_weights skips it once removed (no graph any more)"
_CONV_LAST = "the last value's name: it takes the conv output's name"
_FORM = (
    "a conv's stored form is only compared with other convs' (a Gemm's B is 2-D), and stays apart for "
    "each group count"
)
_SAFE = "remove(safe=...): safe only adds checks, which pass (nothing reads the node)"
_NO_ATTRS = "ir.node(attributes=None) is ir.node(attributes={})"
_GEMM_LAST = "the last value's name: it takes the Gemm output's name"
_INFERRED = "the array is already of dtype's numpy type: ir.tensor infers the same dtype"
_NOT_UNARY = "only tested for being an elementwise unary op, which Add is not under any spelling"
_LOCALE = "open() in the locale's encoding: UTF-8 in every locale here (the C locale is coerced to UTF-8)"
_EQUIVALENT_BY_MODULE: dict[str, dict[str, str]] = {
    "quantize.options": {
        "x_resolve__mutmut_104": "search_below_by_default(auto=None): auto is only tested for truth",
        "x_resolve__mutmut_195": "Resolved's int8_dynamic defaults to False",
    },
    "quantize.settings": {
        "x_load_config__mutmut_2": _LOCALE,
        "x_load_config__mutmut_4": _LOCALE,
        "x_load_config__mutmut_6": 'encoding "UTF-8" is "utf-8"',
        "xǁQuantizeOptionsǁ_default__mutmut_1": "_check_algorithm reads only the default's symmetric",
    },
    "files.publish": {
        "x_publish_directory__mutmut_34": 'old "" is set only where no old folder exists: rmtree("") ignored',
        "x_publish_directory__mutmut_57": "renaming onto the empty folder mkdtemp made replaces it (POSIX)",
        "x_publish_directory__mutmut_58": "the old folder's name inside the hidden one: never read",
        "x_publish_directory__mutmut_59": "the old folder's name inside the hidden one: never read",
        "x_referenced_files__mutmut_5": _FALSY,
        "x_set_metadata__mutmut_3": _FALSY,
        "x__exchange__mutmut_8": "CDLL(None) is the program's own symbols, libc's renameat2 among them",
        "x__exchange__mutmut_9": _ERRNO,
        "x__exchange__mutmut_11": _ERRNO,
        "x__exchange__mutmut_12": _ERRNO,
        "x__ours__mutmut_1": "owned.is_marked refuses links; a link to an empty folder cannot be rmdir-ed",
        "x__read_journal__mutmut_2": _ASCII,
        "x__read_journal__mutmut_4": _ASCII,
        "x__read_journal__mutmut_10": _ASCII,
        "xǁDestinationǁpublish__mutmut_16": "referenced_files of a missing file is None, read as no file",
        "xǁDestinationǁpublish__mutmut_32": _ASCII,
        "xǁDestinationǁpublish__mutmut_35": _ASCII,
        "xǁDestinationǁpublish__mutmut_43": _ASCII,
        "xǁDestinationǁpublish__mutmut_61": "new_data is None exactly when data_path is None",
        "xǁDestinationǁrelease__mutmut_9": "-2 is as released as -1",
        "xǁDestinationǁremove_scratch__mutmut_2": "the path stays listed; removing it again does nothing",
        "xǁDestinationǁ_sweep__mutmut_9": "a non-directory is then refused by _ours",
        "xǁDestinationǁ_sweep__mutmut_40": "the name only goes into DestinationBusy's message, caught here",
    },
    "verify.tally": {
        "x__dot__mutmut_9": 'einsum "I,I->" is the same contraction as "i,i->"',
        "x__exact_block__mutmut_3": "np.asarray(ref != out, dtype=None): ref != out is already bool",
        "x__exact_block__mutmut_5": "np.asarray(ref != out): ref != out is already bool",
        "x__exact_block__mutmut_9": _ASTYPE,
        "x__exact_block__mutmut_13": _ASTYPE,
        "x__exact_block__mutmut_14": _ASTYPE,
        "x__exact_block__mutmut_15": _BLOCK_EXACT,
        "x__exact_block__mutmut_27": _BLOCK_EXACT,
        "x__float_block__mutmut_2": _ASTYPE,
        "x__float_block__mutmut_4": _ASTYPE,
        "x__float_block__mutmut_30": _BLOCK_EXACT,
        "x__float_block__mutmut_52": _BLOCK_EXACT,
        "x__float_tally__mutmut_7": "exact=None: _Tally.exact is only tested for truth",
        "x_element_scales__mutmut_3": "slice(None, n) is slice(0, n)",
        "x_element_scales__mutmut_4": "slice(0, None) over an axis of length n is slice(0, n)",
        "x_element_scales__mutmut_5": "slice(n) is slice(0, n)",
        "x__exact_tally__mutmut_3": "np.asarray(ref != out, dtype=None): ref != out is already bool",
        "x__exact_tally__mutmut_5": "np.asarray(ref != out): ref != out is already bool",
        "x__exact_tally__mutmut_9": _ASTYPE,
        "x__exact_tally__mutmut_13": _ASTYPE,
        "x__exact_tally__mutmut_14": _ASTYPE,
        "x__float_tally__mutmut_2": _ASTYPE,
        "x__float_tally__mutmut_4": _ASTYPE,
        "x__float_tally__mutmut_26": "exact=None: _Tally.exact is only tested for truth",
        "x_element_scales__mutmut_13": "max(initial=1.0) under max(1.0, ...)",
        "x_element_scales__mutmut_35": "max(initial=1.0) under np.maximum(1.0, ...)",
    },
    "verify.compare": {
        "x__cosine__mutmut_4": "reshape(-2) flattens as reshape(-1) does (numpy 2)",
        "x__cosine__mutmut_7": "reshape(-2) flattens as reshape(-1) does (numpy 2)",
        "x__cosine__mutmut_18": _ASTYPE,
        "x__cosine__mutmut_21": _ASTYPE,
        "x__rel_err__mutmut_2": _ASTYPE,
        "x__rel_err__mutmut_3": _ASTYPE,
        "x__rel_err__mutmut_25": 'float("INF") is float("inf")',
        "x_sample_cosines__mutmut_3": "one sample cut by the first axis of length 1 is the whole output",
        "x_sample_rel_errs__mutmut_4": "one sample cut by the first axis of length 1 is the whole output",
        "x_sample_rel_errs__mutmut_17": "size / count >= 8 exactly when size // count >= 8",
        "x_compare_sequences__mutmut_24": _STRICT,
        "x_compare_sequences__mutmut_27": _STRICT,
        "x_compare_sequences__mutmut_28": _STRICT,
        "x_compare_sequences__mutmut_62": _STRICT,
        "x_compare_sequences__mutmut_65": _STRICT,
        "x_compare_sequences__mutmut_66": _STRICT,
        "x_compare_sequences__mutmut_77": _PART,
        "x_compare_sequences__mutmut_78": _PART,
        "x_compare_sequences__mutmut_79": _PART,
        "x_compare_sequences__mutmut_80": _PART,
        "x_compare_sequences__mutmut_94": "the row's dtype only sets .passed and .note, overwritten next",
    },
    "rewrite.analysis": {
        "x__stored_form__mutmut_1": _FORM,
        "x__stored_form__mutmut_3": _FORM,
        "x__stored_form__mutmut_4": _FORM,
        "x__stored_form__mutmut_6": _FORM,
        "x__plan__mutmut_115": "a valid standard Conv has no activation attribute: (None, None) either way",
        "x__plan__mutmut_124": "a valid standard Conv has at most 3 inputs: no Z either way",
        "x__plan__mutmut_298": _AUTO_PAD,
        "x__plan__mutmut_306": _AUTO_PAD,
        "x__check_shapes__mutmut_51": "a bias's value shape is its constant's when both are known",
        "x__plan__mutmut_11": 'onnx_ir turns the domain "ai.onnx" into ""',
        "x__plan__mutmut_12": 'onnx_ir turns the domain "ai.onnx" into ""',
    },
    "rewrite.cleanup": {
        "x_cancel_transposes__mutmut_64": _SAFE,
        "x_cancel_transposes__mutmut_66": _SAFE,
        "x_cancel_transposes__mutmut_67": _SAFE,
        "x_remove_dead_weights__mutmut_13": _SAFE,
        "x_remove_dead_weights__mutmut_10": _SAFE,
        "x_remove_dead_weights__mutmut_12": _SAFE,
        "x_sink_transposes__mutmut_3": "_ours(every=None): every is only tested for truth",
    },
    "rewrite.weights": {
        "x_constant_tensor__mutmut_14": 'onnx_ir turns the domain "ai.onnx" into ""',
        "x_constant_tensor__mutmut_1": "onnx_ir sets const_value on initializers only",
        "x_constant_tensor__mutmut_13": 'onnx_ir turns the domain "ai.onnx" into ""',
    },
    "rewrite.fused": {
        "x_after_transpose_out__mutmut_6": _NOT_UNARY,
        "x_after_transpose_out__mutmut_7": _NOT_UNARY,
        "x_after_transpose_out__mutmut_8": _NOT_UNARY,
    },
    "rewrite.gemm": {
        "x_is_gemm__mutmut_8": 'onnx_ir turns the domain "ai.onnx" into ""',
        "x_is_gemm__mutmut_9": 'onnx_ir turns the domain "ai.onnx" into ""',
        "x__check_operands__mutmut_56": "zip(strict=None) is zip(strict=False)",
        "x__check_operands__mutmut_59": "zip() without strict is zip(strict=False)",
        "x__check_operands__mutmut_60": "zip(strict=True): a C of rank above 2 is refused before zip is read",
    },
    "rewrite.apply": {
        "xǁRewriterǁ_weight_value__mutmut_1": _DEFAULT,
        "xǁRewriterǁapply__mutmut_179": _NO_ATTRS,
        "xǁRewriterǁapply__mutmut_200": _NO_ATTRS,
        "xǁRewriterǁapply__mutmut_232": _NO_ATTRS,
        "xǁRewriterǁapply__mutmut_263": _NO_ATTRS,
        "xǁRewriterǁapply__mutmut_286": "zip(strict=None): activation() checked Clip's two params",
        "xǁRewriterǁapply__mutmut_289": "zip() without strict: activation() checked Clip's two params",
        "xǁRewriterǁapply__mutmut_294": "zip(strict=False): activation() checked Clip's two params",
        "xǁRewriterǁapply__mutmut_314": _CONV_LAST,
        "xǁRewriterǁapply__mutmut_324": _CONV_LAST,
        "xǁRewriterǁapply__mutmut_325": _CONV_LAST,
        "x__transposed_weight__mutmut_20": _TENSOR_NAME,
        "x__transposed_weight__mutmut_22": _TENSOR_NAME,
        "xǁRewriterǁmatmul_weight__mutmut_1": _DEFAULT,
        "xǁRewriterǁmatmul_weight__mutmut_31": _TENSOR_NAME,
        "xǁRewriterǁmatmul_weight__mutmut_53": _TWICE,
        "xǁRewriterǁmatmul_weight__mutmut_55": _TWICE,
        "x__scalar__mutmut_5": _INFERRED,
        "x__scalar__mutmut_8": _INFERRED,
        "x_apply_gemm__mutmut_70": _NO_ATTRS,
        "x_apply_gemm__mutmut_103": _NO_ATTRS,
        "x_apply_gemm__mutmut_140": _NO_ATTRS,
        "x_apply_gemm__mutmut_159": _NO_ATTRS,
        "x_apply_gemm__mutmut_160": _GEMM_LAST,
        "x_apply_gemm__mutmut_168": _GEMM_LAST,
        "x_apply_gemm__mutmut_169": _GEMM_LAST,
        "xǁRewriterǁ_const_node__mutmut_8": _INT64,
        "xǁRewriterǁ_const_node__mutmut_10": _INT64,
        "xǁRewriterǁ_grouped_matmul__mutmut_40": _NO_ATTRS,
        "x_transpose_2d__mutmut_12": _BLOCK,
        "x_transpose_2d__mutmut_14": _BLOCK,
        "x_transpose_2d__mutmut_19": _BLOCK,
        "x_transpose_2d__mutmut_25": _BLOCK,
        "xǁRewriterǁ_const_node__mutmut_9": _INT64,
        "xǁRewriterǁ_const_node__mutmut_11": _INT64,
    },
    "rewrite.layout": {
        "x__output_side__mutmut_20": "Link.node of the conv's own link: never read",
        "x_walk_up__mutmut_17": "Link.node of a converted producer: never read",
        "x__input_side__mutmut_17": "Link.node of the conv's own link: never read",
        "x__readers_leaving__mutmut_12": "Link.ours of a converted reader: never read there",
        "x__readers_leaving__mutmut_18": "Link.ours of a converted reader: never read there",
        "x__input_side__mutmut_4": "unreachable: the analysis plans no conv without input",
        "x__input_side__mutmut_49": "not through: readers is None or does not start with this conv",
        "x__input_side__mutmut_50": "through implies start and top not None; else as 49",
        "x_outcome__mutmut_24": (
            "through with a Transpose kept: _collapse returns before reading top, which keeps a "
            "reader; _readers_leaving wants (0, True)"
        ),
        "x_as_link__mutmut_7": "Link.ours None for False: only tested for truth",
        "x_is_sinkable__mutmut_9": 'onnx_ir turns the domain "ai.onnx" into ""',
        "x_is_sinkable__mutmut_10": 'onnx_ir turns the domain "ai.onnx" into ""',
        "x_is_transpose__mutmut_10": 'onnx_ir turns the domain "ai.onnx" into ""',
        "x_is_transpose__mutmut_11": 'onnx_ir turns the domain "ai.onnx" into ""',
    },
}
EQUIVALENT = {
    f"{module}.{name}": why for module, names in _EQUIVALENT_BY_MODULE.items() for name, why in names.items()
}


def configured(pyproject: Path) -> list[str]:
    """The modules ``only_mutate`` names in ``pyproject`` (``rewrite/analysis``), in its order.

    Read with a pattern rather than a TOML parser (Python 3.10 has none): the entries are
    ``"*/onnx_conv2matmul/<module>.py"`` strings inside ``only_mutate = [...]``.
    """
    if not pyproject.is_file():
        return []
    block = re.search(r"^only_mutate\s*=\s*\[(.*?)\]", pyproject.read_text(encoding="utf-8"), re.M | re.S)
    if block is None:
        return []
    return re.findall(rf'"[^"]*/{PACKAGE}/([^"*]+)\.py"', block.group(1))


def modules(root: Path, pyproject: Path) -> list[str]:
    """The configured modules, then those with results under ``root`` that are not configured."""
    named = configured(pyproject)
    base = root / "src" / PACKAGE
    found = sorted(str(meta.relative_to(base))[: -len(".py.meta")] for meta in base.rglob("*.py.meta"))
    return named + [m for m in found if m not in named]


def groups(names: list[str]) -> dict[str, list[str]]:
    """Each stage folder (``rewrite/``) with more than one of ``names``."""
    by_folder: dict[str, list[str]] = {}
    for name in names:
        folder, _, _ = name.rpartition("/")
        if folder:
            by_folder.setdefault(folder + "/", []).append(name)
    return {folder: members for folder, members in by_folder.items() if len(members) > 1}


def _codes(roots: list[Path], module: str) -> dict[str, int | None] | None:
    merged: dict[str, int | None] | None = None
    for root in roots:
        meta = root / "src" / PACKAGE / f"{module}.py.meta"
        if not meta.exists():
            continue
        codes: dict[str, int | None] = json.loads(meta.read_text())["exit_code_by_key"]
        if merged is None:
            merged = codes
            continue
        for key, code in codes.items():
            if key in merged and (code in KILLED or (merged[key] is None and code is not None)):
                merged[key] = code
    return merged


def _row(name: str, codes: dict[str, int | None]) -> tuple[str, list[str]]:
    killed = sum(code in KILLED for code in codes.values())
    equivalent = [
        key for key, code in codes.items() if code not in KILLED and key.partition(".")[2] in EQUIVALENT
    ]
    other = Counter(STATUS.get(code, "suspicious") for code in codes.values() if code not in KILLED)
    rest = ", ".join(f"{n} {what}" for what, n in sorted(other.items()))
    score = 100 * killed / len(codes) if codes else 0.0
    relevant = len(codes) - len(equivalent)
    non_eq = 100 * killed / relevant if relevant else 100.0
    checked = sum(code is not None for code in codes.values())
    of_run = f"{100 * killed / checked:>6.1f}%" if checked else "      -"
    counts = f"{killed:>7} {len(codes):>6} {score:>6.1f}% {len(equivalent):>6} {non_eq:>6.1f}% {of_run}"
    return f"{name:<17} {counts}  {rest}", equivalent


def main() -> int:
    args = [a for a in sys.argv[1:] if a != "--survivors"]
    show = "--survivors" in sys.argv
    roots = [Path(a) for a in args] or [Path("mutants")]
    if not args and not roots[0].is_dir():
        roots = [Path(".mutation/tree/mutants")]
    head = f"{'killed':>7} {'total':>6} {'score':>7} {'equiv':>6} {'non-eq':>7} {'of run':>7}"
    print(f"{'module':<17} {head}  other")
    names = modules(roots[0], Path("pyproject.toml"))
    found = {}
    for module in names:
        codes = _codes(roots, module)
        if codes is None:
            print(f"{module:<17} (not run)")
            continue
        found[module] = codes
        line, equivalent = _row(module, codes)
        print(line)
        if show:
            for key, code in sorted(codes.items()):
                if code not in KILLED:
                    mark = "equivalent" if key in equivalent else STATUS.get(code, "suspicious")
                    print(f"    {mark:<12} {key}")
    for group, members in groups(names).items():
        run = [m for m in members if m in found]
        if run:
            merged = {key: code for m in run for key, code in found[m].items()}
            line, _ = _row(group + " (all run)", merged)
            print(line + ("" if len(run) == len(members) else f" [{len(run)} of {len(members)} modules]"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
