"""The quantize command's report: what was quantized, the search, the kernel choice, latency,
the accuracy check, and why nothing was written when so."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from onnx_conv2matmul.cli.render import human_bytes, latency_table, print_warnings, timing_title
from onnx_conv2matmul.cli.render.verify import print_verification
from onnx_conv2matmul.quantize.report import QuantizeReport
from onnx_conv2matmul.verify.check import Criterion


def print_transpose_trade(console: Console, trade: dict[str, Any]) -> None:
    """The pointwise convs whose rewrite adds Transposes: both models and the one kept."""
    table = Table(
        title=(
            f"{trade['convs']} pointwise convs add Transposes when rewritten; they hold"
            f" {trade['weight_share']:.0%} of the weights"
        ),
        title_justify="left",
    )
    for column in ("model", "size", "latency x original", "meets the criterion", "kept"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for model in trade["models"]:
        ratios = model["latency_ratios"]
        latency = "not timed" if ratios is None else " / ".join(f"{r:.2f}" for r in ratios)
        if model.get("as_original"):
            latency = "the original's"
        size = "-" if model["size_ratio"] is None else f"{model['size_ratio']:.3f}x"
        kept = "yes" if model["name"] == trade["kept"] else ""
        meets = "yes" if model["meets_criterion"] else "no"
        if model.get("not_made"):
            size, latency, meets = "not made", "-", "-"
        table.add_row(model["name"], size, latency, meets, kept)
    console.print(table)
    for model in trade["models"]:
        if model.get("none_quantized"):  # its reason begins "nothing quantized: "
            console.print(
                f"{escape(model['name'])}: {escape(model['none_quantized'])}",
                highlight=False,
                soft_wrap=True,
            )
    console.print(f"Kept: {escape(trade['reason'])}", highlight=False, soft_wrap=True)


def print_quantize_report(console: Console, report: QuantizeReport) -> None:
    """The quantize command's summary; its first line says why nothing was quantized, if so."""
    if report.unchanged is not None:
        console.print(f"[bold yellow]{escape(report.unchanged.message)}[/bold yellow]", soft_wrap=True)
    table = Table(title=f"Quantize ({report.mode})", title_justify="left")
    table.add_column("")
    table.add_column("value", justify="right")
    rewrite = report.rewrite
    by_op_type = rewrite.get("by_op_type") or {}
    if "Gemm" in by_op_type:
        for op_type, count in by_op_type.items():
            table.add_row(f"{op_type} rewritten", f"{count['converted']} of {count['nodes']}")
    else:
        converted, convs = rewrite.get("converted", 0), rewrite.get("convs", 0)
        table.add_row("pointwise convs rewritten", f"{converted} of {convs}")
    if report.mode == "matmul_nbits":
        table.add_row("MatMul -> MatMulNBits", f"{report.quantized_nodes} of {report.matmuls}")
        if report.excluded:
            table.add_row("left in float by the settings", str(len(report.excluded)))
        for setting, count in _setting_counts(report).items():
            table.add_row(f"  {setting}", str(count))
        before, after = report.weights_without_rewrite, report.weights_with_rewrite
        if before and after:
            table.add_row("quantizable weight share without the rewrite", f"{before.share:.1%}")
            table.add_row("quantizable weight share with the rewrite", f"{after.share:.1%}")
        if report.coverage is not None:
            from onnx_conv2matmul.quantize.inspection import coverage_text

            table.add_row("weights stored quantized, by kind", coverage_text(report.coverage))
    else:
        table.add_row("int8 dynamic nodes", str(report.quantized_nodes))
    if report.other_weights is not None:
        others = report.other_weights
        table.add_row(
            "other weights stored as int8",
            f"{len(others.stored)} ({human_bytes(others.saved_bytes)} saved; {len(others.kept)} kept)",
        )
    if report.auto is not None:
        found = report.auto
        if found.min_cosine is not None and found.reached_cosine is not None:
            table.add_row(
                "search: minimum cosine asked / reached", f"{found.min_cosine:g} / {found.reached_cosine:.5f}"
            )
        if found.metric is not None and found.original_score is not None and found.reached_score is not None:
            table.add_row(
                f"search: score of {found.metric.label}, original / reached",
                f"{found.original_score:.6g} / {found.reached_score:.6g}"
                f" (max drop {found.metric.max_drop_text})",
            )
        for label, count in found.config.counts().items():
            table.add_row(f"search: {label}", str(count))
        table.add_row(
            "search: full-model evaluations, time",
            f"{len(found.evaluations)}, {found.seconds:.1f} s"
            f" (sensitivity {found.sensitivity_seconds:.1f} s)",
        )
    if report.one_pass is not None:
        for candidate in report.one_pass["candidates"]:
            cosine = candidate["worst_cosine"]
            verdict = "meets the criterion" if candidate["passed"] else "below the criterion"
            shown = "no cosine" if cosine is None else f"worst cosine {cosine:.5f}"
            if "stopped_after_samples" in candidate:
                run, of = candidate["stopped_after_samples"]
                shown += f" (stopped at the first below the criterion: {run} of {of} samples run)"
            when = (
                "checked before the step back"
                if candidate.get("checked_before")
                else f"checked in {candidate['seconds']:.1f} s"
            )
            table.add_row(f"candidate: {candidate['candidate']}", f"{shown}, {verdict} ({when})")
    table.add_row("size before", human_bytes(report.input_bytes))
    ratio = f" ({report.ratio:.3f}x)" if report.ratio else ""
    table.add_row("size after", human_bytes(report.output_bytes) + ratio)
    table.add_row("time", f"{report.seconds:.1f} s")
    if report.seconds_by_phase:
        parts = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in report.seconds_by_phase.items())
        table.add_row("time by phase", parts)
    table.add_row("peak memory (RSS) until saved", human_bytes(report.peak_rss_quantize_bytes))
    table.add_row("peak memory (RSS) with the accuracy check", human_bytes(report.peak_rss_bytes))
    if report.bytes_written is not None:
        table.add_row("written to disk", human_bytes(report.bytes_written))
    console.print(table)
    if report.transposes is not None:
        print_transpose_trade(console, report.transposes.to_dict())
    if report.kernel_plan is not None:
        costs = report.kernel_plan.to_dict()
        console.print(
            f"Kernel choice from per-shape costs ({costs['measured']} kernel timings,"
            f" {costs['from_cache']} from the cache): {escape(costs['reason'])}",
            highlight=False,
            soft_wrap=True,
        )
        if costs["search"] is not None:
            console.print(f"Search: {escape(costs['search']['summary'])}", highlight=False, soft_wrap=True)
    if report.kernel_choice is not None:
        console.print(kernel_choice_table(report.kernel_choice))
        console.print(f"Chosen: {escape(report.kernel_choice['reason'])}", highlight=False, soft_wrap=True)
    if report.latency is not None:
        console.print(quantize_latency_table(report.latency))
    print_warnings(console, report.warnings)
    verification = report.verification
    if verification is not None:
        print_verification(console, verification, cosine=True)
    for line in _accuracy_lines(report):
        console.print(line, highlight=False, soft_wrap=True)
    failure = quantize_failure(report)
    if report.output_path:
        console.print(f"Wrote {report.output_path}", highlight=False, soft_wrap=True)
    elif failure is not None:
        console.print(escape(failure[0].upper() + failure[1:]) + ".", highlight=False, soft_wrap=True)
    else:
        console.print("Outputs that must match differ: nothing was written.", highlight=False)


def quantize_latency_table(latency: dict[str, Any]) -> Table:
    """The result against the original, one column per length."""
    title = timing_title("Latency", latency["cpu"], latency["lengths"], latency["options"], latency["mode"])
    rows = [((label,), latency[label]) for label in ("original", "result")]
    return latency_table(title, latency["lengths"]["used"], rows)


def kernel_choice_table(choice: dict[str, Any]) -> Table:
    """The kernel settings tried: accuracy, whether it met the target, latency ratios."""
    original = choice["original"]
    lengths = [lat["length"] for lat in original["latencies"]] if original else []
    where = f" on {choice['cpu']}" if choice["cpu"] else ""
    table = Table(title=f"Kernel settings tried{where} ({choice['target']})", title_justify="left")
    for name in ("candidate", "cosine", "meets target", *(f"x original at {n}" for n in lengths), "speed"):
        table.add_column(name, justify="left" if name == "candidate" else "right")
    for candidate in choice["candidates"]:
        ratios = {lat["length"]: lat["ratio"] for lat in candidate["latencies"] or ()}
        mark = "[bold]" if candidate["name"] == choice["winner"] else ""
        table.add_row(
            f"{mark}{escape(candidate['name'])}",
            f"{candidate['cosine']:.5f}",
            "yes" if candidate["meets_target"] else "no",
            *(f"{ratios[n]:.2f}x" if ratios.get(n) is not None else "-" for n in lengths),
            "-" if candidate["speed"] is None else f"{candidate['speed']:.3f}x",
        )
    return table


def quantize_failure(report: QuantizeReport) -> str | None:
    """The report's failure: the criterion missed, and what can help."""
    verification = report.verification
    if report.passed or verification is None:
        return None
    if report.held_out_missed:
        return report.held_out_failure(
            " (more --inputs, or a higher --min-cosine, leaves a margin for inputs the choice did not see)"
        )
    metric = report.accuracy.get("metric") or {}
    if metric.get("passed") is False:
        return (
            f"the score of --validate {metric['function']} dropped from {metric['original_score']:.6g}"
            f" to {metric['score']:.6g}, more than --max-drop {metric['max_drop']:g}"
            f"{' (relative)' if metric['relative'] else ''}; nothing was written"
            + ("" if report.auto is not None else " (--auto searches for settings that meet it)")
        )
    if verification.options.criterion is not Criterion.MIN_COSINE:
        return None
    worst = verification.worst_cosine
    floor = report.accuracy.get("min_cosine_source") == "default floor"
    measured = "" if worst is None else f" (worst sample {worst:.4f})"
    # An integer output judged by agreement (verify.compare.agreement_floor) that decided: named.
    decided = next((r for r in verification.results if not r.passed and r.cosine is None and r.note), None)
    if decided is not None and not any(not r.passed and r.cosine is not None for r in verification.results):
        measured = f" (output {decided.output!r}: {decided.note})"
    moved = next((t for t in verification.labels if not t.passed), None)
    if moved is not None and all(r.passed for r in verification.results):
        measured = f" ({moved.text()})"
    what = (
        f"the accuracy floor --min-cosine {verification.options.min_cosine:g}"
        if floor
        else (f"--min-cosine {verification.options.min_cosine:g}")
    )
    helps = []
    if report.mode == "matmul_nbits" and report.auto is None:
        helps.append("--auto searches for settings that meet it")
    if report.mode == "int8_dynamic":
        helps.append("MatMulNBits with --auto may meet it")
    if report.accuracy.get("inputs") == "synthesised":
        helps.append("--inputs checks on real inputs")
    if floor:
        helps.append("--min-cosine X sets another floor")
    return f"accuracy below {what}{measured}; nothing was written" + (
        f" ({'; '.join(helps)})" if helps else ""
    )


def _accuracy_lines(report: QuantizeReport) -> list[str]:
    """The criterion the output met (or missed), the user's score, and the synthetic-input caveat."""
    accuracy = report.accuracy
    lines = []
    if accuracy.get("min_cosine_source") == "default floor":
        lines.append(
            f"Criterion: the default accuracy floor, every sample's cosine >= {accuracy['min_cosine']:g}"
            " (--min-cosine sets another)."
        )
    metric = accuracy.get("metric")
    if metric and metric.get("score") is not None:
        verdict = "[green]ok[/green]" if metric.get("passed") else "[red]FAIL[/red]"
        relative = " (relative)" if metric["relative"] else ""
        lines.append(
            f"Score of {escape(metric['function'])}: {metric['original_score']:.6g} -> {metric['score']:.6g},"
            f" drop {metric['drop']:.4g}{relative}, at most {metric['max_drop']:g}: {verdict}"
        )
    held = accuracy.get("held_out")
    if held and held.get("passed") is not None:
        verdict = "[green]ok[/green]" if held["passed"] else "[red]FAIL[/red]"
        worst = "" if held["worst_cosine"] is None else f", worst cosine {held['worst_cosine']:.4f}"
        kept = "".join(
            f", {t['output']!r} kept {t['agreement']:.2%} of {t['labels']} labels" for t in held["labels"]
        )
        aimed = held.get("chosen_with_min_cosine")
        margin = "" if aimed is None else f" (with a minimum cosine of {aimed:g} there, a step back)"
        lines.append(
            f"Held out: chosen on {held['chosen_on_samples']} samples of --inputs{margin}, confirmed on the"
            f" other {held['held_out_samples']}{worst}{escape(kept)}: {verdict}"
        )
    elif held and held.get("note"):
        lines.append(f"[yellow]note:[/yellow] {escape(held['note'])}")
    if accuracy.get("inputs") == "synthesised":
        lines.append(
            "[yellow]note:[/yellow] measured on synthesised inputs, which can overstate accuracy"
            " (a trained model can do well on random inputs and badly on real ones): --inputs with"
            " real inputs, or --validate with your own measure, gives the true figure."
        )
    return lines


def _setting_counts(report: QuantizeReport) -> dict[str, int]:
    """How many MatMuls got each setting, when they did not all get the same."""
    counts: dict[str, int] = {}
    for setting in report.settings.values():
        kind = "symmetric" if setting.symmetric else "asymmetric"
        key = f"{setting.bits} bits, block {setting.block_size}, {kind}"
        counts[key] = counts.get(key, 0) + 1
    return counts if len(counts) > 1 else {}
