"""The doc's generated section: the tables and the reading, every sentence computed from the report."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

from hf_geosharp import durable

from .config import BEGIN, CALIBRATED_BALL, END, GAPS, HIDDEN, PLAN, TRIVIAL


def _cell(t: dict[str, Any] | None, value: str = "tau") -> str:
    """A tau (or, with ``value="difference"``, a difference of taus) with its interval, and its p-value if it has
    one."""
    if t is None:
        return "-"
    ci = "" if math.isnan(t["ci_low"]) else f" [{t['ci_low']:+.2f}, {t['ci_high']:+.2f}]"
    return f"{t[value]:+.2f}{ci}" + (f", p={t['p_value']:.2g}" if "p_value" in t else "")


def _excludes_zero(low: float, high: float) -> int:
    """+1 if a 95 % interval lies above zero, -1 below, 0 if it includes zero or there is none (too few members)."""
    return 0 if not (math.isfinite(low) and math.isfinite(high)) else (low > 0) - (high < 0)


def _by_side(table: dict[str, dict[str, Any]], value: str) -> dict[int, list[tuple[str, float]]]:
    """``(name, value)`` of each entry, by the side of zero its interval lies on (:func:`_excludes_zero`)."""
    sides: dict[int, list[tuple[str, float]]] = {1: [], -1: [], 0: []}
    for name, t in table.items():
        sides[_excludes_zero(t["ci_low"], t["ci_high"])].append((name, t[value]))
    return sides


def _listed(entries: list[tuple[str, float]], empty: str) -> str:
    """``"name +0.12, name -0.03"``, or ``empty``."""
    return ", ".join(f"{name} {v:+.2f}" for name, v in entries) or empty


#: The paired comparisons the report makes: (report key, title in the reading, the baseline as the text names it).
VERSUS = (("versus_param_norm", "Against the parameter norm", "the parameter norm"),
          ("versus_adaptive_clean", "Geodesic against clean adaptive", "clean adaptive sharpness"))


def reading(out: dict[str, Any]) -> list[str]:
    """What the intervals allow, as bullet lines computed from the report (no sentence here is written by hand)."""
    gaps, config = list(GAPS), out["config"]
    lines = []
    worst = {c: n for c, n in out["convergence"].items() if not c.endswith(("relative_flatness", "adaptive_as23"))}
    uncertified = {c: n["n"] - n["certified"] for c, n in worst.items() if n["n"] > n["certified"]}
    total = sum(n["n"] for n in worst.values())
    as23 = out["convergence"].get("adaptive_as23", {"n": 0, "certified": 0})
    again = out["measured_again"]
    retried = "".join(
        f" {n['member']} {n['column']}: {n['first']['value']:.4g} ({n['first']['max_steps']} steps) -> "
        + ("not yet measured again" if n["again"] is None else f"{n['again']['value']:.4g}, " + (
            "certified" if n["again"]["converged"] else f"not certified: {n['again']['convergence_note']}")) + ";"
        for n in again["numbers"])
    lines.append(f"* **Certificates**: {total - sum(uncertified.values())} of the {total} worst-case numbers measured "
                 "with `steps=\"auto\"` are certified" + ("" if not uncertified else "; not: " + ", ".join(
                     f"{c} ({k})" for c, k in uncertified.items()))
                 + (f". {len(again['numbers'])} that the engine's default budget left uncertified are measured again "
                    f"with {again['max_steps']} steps per batch, and the tables use the second number once it exists:"
                    + retried.rstrip(";") if again["numbers"] else "")
                 + f". AS23's {config['as23_steps']}-step numbers: {as23['certified']} of {as23['n']} certified (its "
                 "fixed points are not stationary).")
    raised = [f"{c} ({t['n'] - t['n_certified']} of {t['n']}): " + ", ".join(
        f"{gap} {taus[c]['tau']:+.2f} -> {taus[c]['tau_if_raised'][0]:+.2f} to {taus[c]['tau_if_raised'][1]:+.2f}"
        for gap, taus in table.items() if c in taus)
        for table in (out["taus"], out["adversarial"]["taus"], *out["rho_sweep"].values())
        for c, t in table.get(gaps[0], {}).items() if "tau_if_raised" in t]
    if raised:
        lines.append("* **Uncertified numbers are lower bounds** (the largest value found; the maximum is at least "
                     "it). Tau as measured -> the smallest to the largest tau with each of them raised anywhere above "
                     "its value: " + "; ".join(dict.fromkeys(raised)) + ".")
    for gap in gaps:
        sides = _by_side(out["taus"][gap], "tau")
        lines.append(f"* **{gap}**: interval above 0: {_listed(sides[1], 'none')}; below 0: "
                     f"{_listed(sides[-1], 'none')}; including 0 (or too few members): "
                     f"{', '.join(name for name, _ in sides[0]) or 'none'}.")
    for key, title, baseline in VERSUS:
        versus = out[key]
        if not versus["with_baseline"]:
            continue
        by_gap = {gap: _by_side(versus["differences"][gap], "difference") for gap in gaps}
        found = "; ".join(f"{gap}: better {_listed(s[1], '-')}, worse {_listed(s[-1], '-')}"
                          for gap, s in by_gap.items() if s[1] or s[-1])
        alike = ", ".join(f"{c} {t['tau']:+.2f}" for c, t in versus["with_baseline"].items())
        lines.append(f"* **{title}** (paired intervals that exclude 0): "
                     + (found if found else f"none, against any gap: no measure ranks the members better or worse "
                        f"than {baseline} by an interval that excludes 0")
                     + f". Tau of each measure with {baseline}: {alike}.")
    hide_gap = config["hide_gap"]
    adv, before = (out["adversarial"][k].get(hide_gap, {}) for k in ("taus", "taus_unmoved"))
    if adv:
        pairs = ", ".join(f"{c.removeprefix('hidden_')} {_cell(before.get(c.removeprefix('hidden_')))} -> {_cell(t)}"
                          for c, t in adv.items())
        lines.append(f"* **Adversarial control**, tau against {hide_gap} on the {next(iter(adv.values()))['n']} "
                     f"members moved, before -> after moving each against it: {pairs}.")
    for col in out.get("calibrated_columns", []):
        name, taus = col.removesuffix(f"_{CALIBRATED_BALL}"), out["taus"].get(hide_gap, {})
        paper, calibrated = taus.get(name), taus.get(col)
        if calibrated is None:
            continue
        lines.append(f"* **Radius convention**, {name} at rho {config['rho']:g}, tau against {hide_gap}: paper ball "
                     f"{_cell(paper)} ({out['convergence'][name]['certified']} of "
                     f"{out['convergence'][name]['n']} certified), calibrated ball {_cell(calibrated)} "
                     f"({out['convergence'][col]['certified']} of {out['convergence'][col]['n']} certified).")
    sweep = []
    for name in config["sweep_measures"]:
        cells = []
        for rho, taus in sorted(out["rho_sweep"].items(), key=lambda kv: float(kv[0])):
            t = taus.get(hide_gap, {}).get(name if float(rho) == config["rho"] else f"{name}@{rho}")
            cells.append(f"rho {rho}: {_cell(t)}" + ("" if t is None else f", n={t['n']}"))
        sweep.append(f"{name} ({'; '.join(cells)})")
    lines.append(f"* **rho sweep**, tau against {hide_gap}: " + ", ".join(sweep) + ".")
    return lines


def tables_markdown(out: dict[str, Any], figure_link: bool = True, versions: bool = False) -> str:
    """The doc's generated section: progress, taus against the four gaps (original, hidden, sweep), convergence,
    the adversarial check and the cost per stage. The library versions are the JSON's (``library``); with
    ``versions``, also the batch-by-batch comparison with a previous version's numbers (``--report --previous``
    prints it; the doc states the current results only)."""
    p, gaps = out["progress"], list(GAPS)
    lines = [f"Generated from the result store by `python -m experiments.minilm_family --report` (protocol "
             f"{out['protocol']}): {p['trained']} of {p['members']} members trained, {p['main_complete']} with every "
             f"main number, {p['complete']} complete.", ""]
    if out.get("calibrated_columns"):
        names = ", ".join(f"`{c}`" for c in out["calibrated_columns"])
        lines += [f"Every number is measured under the paper ball (`ball=\"paper\"`) but {names}: the same measure "
                  f"at the same rho under the calibrated ball (`ball=\"calibrated\"`, [method.md](method.md), \"Radius "
                  f"convention\"), measured on {p['calibrated']} of the {p['trained']} members.", ""]
    if not any(out["taus"][g] for g in gaps):
        lines += ["**The run at honest settings is under way; no tau is reported yet.** The tables appear here when "
                  "the store holds the numbers.", ""]
    else:
        if p["measured"] < p["members"]:
            lines += ["**Partial**: the run is not finished; each tau is over the `n` members measured so far.", ""]
        elif p["complete"] < p["members"]:
            waiting = sum(n["again"] is None for n in out["measured_again"]["numbers"])
            lines += [f"**Partial**: every member has every number, but {waiting} that the engine's default budget "
                      f"left uncertified {'is' if waiting == 1 else 'are'} still to be measured again with "
                      f"{out['measured_again']['max_steps']} steps per batch (\"Certificates\" below); the tables "
                      "use their first measurement until then.",
                      ""]
        header = "| predictor | n | certified | " + " | ".join(gaps) + " |"
        rule = "|---|---:|---:|" + "---|" * len(gaps)
        lines += ["Kendall tau [bootstrap 95 % CI], p-value, against each gap:", "", header, rule]

        def block(table: dict[str, dict[str, Any]], cols: list[str], label: Any = None) -> None:
            for col in cols:
                first = next((table[g][col] for g in gaps if col in table[g]), None)
                if first is None:
                    continue
                cert = f"{first['n_certified']}/{first['n']}" if col not in TRIVIAL else "-"
                name = label(col) if label else col
                lines.append(f"| {name} | {first['n']} | {cert} | " +
                             " | ".join(_cell(table[g].get(col)) for g in gaps) + " |")

        block(out["taus"], [*PLAN, *out.get("calibrated_columns", []), *TRIVIAL],
              lambda c: f"{c.removesuffix('_' + CALIBRATED_BALL)} ({CALIBRATED_BALL} ball)"
              if c.endswith("_" + CALIBRATED_BALL) else c)
        block(out["adversarial"]["taus"], [f"hidden_{n}" for n in HIDDEN],
              lambda c: f"{c.removeprefix('hidden_')} (adversarially hidden)")
        for rho, taus in out["rho_sweep"].items():
            if float(rho) != out["config"]["rho"]:
                block(taus, [f"{n}@{rho}" for n in out["config"]["sweep_measures"]],
                      lambda c: c.replace("@", " @ rho "))
        lines.append("")
        for key, _, baseline in VERSUS:
            versus = out[key]
            if not versus["with_baseline"]:
                continue
            lines += [f"Each measure against {baseline}, over the same members: Kendall tau of the two with each "
                      f"other, and the measure's tau against each gap minus that of {baseline}, with a paired "
                      "bootstrap 95 % interval (the same resampled members for both; an interval above zero says the "
                      f"measure ranks the members by that gap better than {baseline} does):", "",
                      f"| measure | tau with {versus['baseline']} | " + " | ".join(gaps) + " |",
                      "|---|---|" + "---|" * len(gaps)]
            for col, alike in versus["with_baseline"].items():
                lines.append(f"| {col} | {_cell(alike)} | " + " | ".join(
                    _cell(versus["differences"][g].get(col), "difference") for g in gaps) + " |")
            lines.append("")
        adv = out["adversarial"]
        if adv.get("n"):
            parts = [f"Adversarial control on {adv['n']} members: outputs moved by at most "
                     f"{adv['max_output_deviation']:.2g} (relative), group elements of condition <= "
                     f"{adv['max_condition']:.0f}"]
            if "max_geodesic_inv_relative_change" in adv:
                parts.append(f"geodesic inv changed by at most {adv['max_geodesic_inv_relative_change']:.2g} "
                             "(relative)")
            for target in ("flat", "sharp"):
                f = adv.get(f"adaptive_clean_factor_{target}")
                if f:
                    parts.append(f"clean adaptive x{f['min']:.3g} to x{f['max']:.3g} (median x{f['median']:.3g}) on "
                                 f"the {f['n']} member{'s' if f['n'] != 1 else ''} moved towards {target}")
            lines += ["; ".join(parts) + ".", ""]
        if figure_link:
            lines += ["![MiniLM family](results/minilm_family.png)", ""]
        lines += ["What the intervals allow" + (" so far" if p["complete"] < p["members"] else "") + ":", "",
                  *reading(out), ""]
    if versions and (versus := out.get("against_previous")) and versus["columns"]:
        before, now = versus["versions"]
        lines += [f"The main numbers that hf_geosharp {before} also stored, batch by batch (a batch value differs "
                  "where the two versions' code paths differ, or where another machine's kernels round differently):",
                  "",
                  f"| measure | members | batch values bit-equal | certified ({before} -> {now}) | changed members |",
                  "|---|---:|---:|---:|---|"]
        for col, c in versus["columns"].items():
            changed = ", ".join(f"{ch['member']} {ch['value'][0]:.4g} -> {ch['value'][1]:.4g}" for ch in c["changed"])
            lines.append(f"| {col} | {c['members']} | {c['batches_bit_equal']}/{c['batches']} | "
                         f"{c['certified_before']} -> {c['certified_now']} | {changed or '-'} |")
        lines.append("")
    lines += cost_table(out["cost"])
    wrapped = [line if line.startswith(("|", "!")) else
               textwrap.fill(line, 120, subsequent_indent="  " if line.startswith("* ") else "") for line in lines]
    return "\n".join(wrapped).rstrip() + "\n"


def cost_table(cost: dict[str, Any]) -> list[str]:
    """The cost as one table: hours per stage (wall, and CPU on one thread) from the records, and the total; a
    number measured again with a larger budget counts in its stage."""
    if not cost["per_task"]:
        return []
    lines = ["Cost, from the records (hours; CPU on one thread):", "", "| stage | tasks | wall h | CPU h |",
             "|---|---:|---:|---:|"]
    for stage, agg in cost["per_stage"].items():
        n = sum(slot["n"] for kind, slot in cost["per_task"].items() if kind.split("/")[0] == stage)
        lines.append(f"| {stage} | {n} | {agg['seconds'] / 3600:.2f} | {agg['cpu_seconds'] / 3600:.2f} |")
    n = sum(slot["n"] for slot in cost["per_task"].values())
    lines += [f"| total | {n} | {cost['total_seconds'] / 3600:.2f} | {cost['total_cpu_seconds'] / 3600:.2f} |", ""]
    return lines


def write_generated(doc: Path, text: str) -> None:
    """Replace what lies between the doc's ``BEGIN``/``END`` markers with ``text``."""
    current = doc.read_text()
    start, end = current.find(BEGIN), current.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{doc} has no generated section (the lines {BEGIN!r} ... {END!r}).")
    durable.write_text(doc, current[: start + len(BEGIN)] + "\n" + text + current[end:])


def doc_problem(doc: Path) -> str | None:
    """Why ``doc`` cannot take the generated report, or None."""
    if not doc.is_file():
        return "does not exist"
    text = doc.read_text(errors="replace")
    start, end = text.find(BEGIN), text.find(END)
    return None if 0 <= start < end else f"has no generated section (the lines {BEGIN!r} ... {END!r})"
