"""What ``python -m lightning_mp compare`` prints: the table (format | memory | speed | stability), the notes under
it, the verdicts on noise and size, the recommendation with its confidence, and the JSON and PNG files.

Long texts (a mode's failure, unsupported hardware) never sit in a table cell: the cell names a numbered note and
the note, below the table, is wrapped at word boundaries, never cut.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import textwrap
from typing import Any, Optional, Sequence

from lightning_mp.tools.compare_engine import ModeResult
from lightning_mp.tools.compare_stats import Decision, Probe, mode_states, safety_rank, split_mode

#: the widest the report's texts are wrapped at (as the docs show it); a narrower terminal wraps them at its width
WIDTH = 118
FP16_MAX = 65504.0


def terminal_width() -> Optional[int]:
    """The width of the terminal the report goes to, less one column (at least 40; ``COLUMNS`` where set), or
    ``None`` when it goes to a file or a pipe."""
    if not os.environ.get("COLUMNS", "").strip().isdigit() and not sys.stdout.isatty():
        return None
    return max(40, shutil.get_terminal_size((WIDTH + 1, 24)).columns - 1)


def wrap(text: str, indent: str = "", first: Optional[str] = None) -> str:
    """``text`` wrapped at word boundaries (never inside a word, never cut), at :data:`WIDTH` or a narrower
    terminal's width."""
    width = min(WIDTH, terminal_width() or WIDTH)
    return textwrap.fill(text, width=width, initial_indent=indent if first is None else first,
                         subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def fmt_ms(ms: Optional[float]) -> str:
    if ms is None:
        return "—"
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


def fmt_mib(mib: Optional[float]) -> str:
    if mib is None:
        return "—"
    if mib >= 10240:
        return f"{mib / 1024:.1f} GiB"
    if mib < 1:
        return f"{mib * 1024:.0f} KiB"
    return f"{mib:,.0f} MiB" if mib >= 100 else f"{mib:.1f} MiB"


def _speed_cell(r: ModeResult, is_reference: bool) -> str:
    if r.step_ms is None:
        return "—"
    cell = f"{fmt_ms(r.step_ms)} ms (IQR {fmt_ms(r.step_iqr_ms)})"
    if is_reference:
        return cell + " · 1.00x"
    if r.speedup is not None:
        cell += f" · {r.speedup:.2f}x"
        if r.speedup_hi is not None and math.isinf(r.speedup_hi):
            cell += " [too few steps]"
        elif r.speedup_lo is not None and r.speedup_hi is not None and r.speedup_hi > r.speedup_lo:
            cell += f" [{r.speedup_lo:.2f}–{r.speedup_hi:.2f}]"
    return cell


def _memory_cell(r: ModeResult) -> str:
    if r.peak_mem_mib is None:
        return "—" if not r.ran else "n/a"
    cell = fmt_mib(r.peak_mem_mib) + (" est." if r.memory_kind == "estimate" else "")
    if r.mem_share is not None:
        cell += f" · {100 * r.mem_share:.0f} %"
    return cell


def fp8_lost_text(share: float, where: Optional[str]) -> str:
    """The FP8 layer whose cast lost the largest share of a tensor: ``where`` is "layer tensor saturated|underflow"."""
    if share <= 0 or not where:
        return "FP8 casts lost no values"
    place, _, kind = where.rpartition(" ")
    return f"FP8 layer losing most {place}: {100 * share:.3g} % {kind}"


def headroom_text(bits: Optional[float]) -> str:
    if bits is None:
        return "—"
    if math.isinf(bits):
        return "∞" if bits > 0 else "overflow"
    return f"{bits:.1f} b"


def _stability_cell(r: ModeResult, is_reference: bool, note: Optional[int]) -> str:
    if not r.ran:
        return f"{r.status} (note {note})" if note else r.status
    parts = [r.status if note is None else f"{r.status} (note {note})"]
    if is_reference:
        parts.append("reference")
    elif r.loss_drift is not None:
        parts.append(f"drift {100 * r.loss_drift:+.2f} %")
    if r.skipped_steps is not None:
        parts.append(f"skipped {r.skipped_steps}/{r.steps}")
    if r.act_headroom_bits is not None or r.grad_headroom_bits is not None:
        parts.append(f"fp16 headroom act {headroom_text(r.act_headroom_bits)},"
                     f" grad {headroom_text(r.grad_headroom_bits)}")
    if r.fp8_headroom is not None:
        clipped = " (clipped)" if r.fp8_headroom < 1 else ""
        parts.append(f"tightest FP8 layer {r.fp8_layer}: headroom {r.fp8_headroom:.3g}x{clipped}")
    if r.fp8_lost is not None:
        parts.append(fp8_lost_text(r.fp8_lost, r.fp8_lost_layer))
    if r.loss_scale is not None:
        parts.append(f"loss scale {r.loss_scale:g}")
    return " · ".join(parts)


def format_table(results: Sequence[ModeResult], reference: Optional[str] = None,
                 pick: Optional[str] = None, width: Optional[int] = None) -> tuple[str, list[str]]:
    """The markdown table and its numbered notes (full texts, to print wrapped under it). ``width``: a terminal's
    width; where the table is wider, each mode is a block of its own instead (its name, then one wrapped line per
    column), so that no row wraps across the terminal's edge."""
    notes: list[str] = []
    rows: list[tuple[str, str, str, str]] = []
    for r in results:
        note = None
        if r.reason:
            notes.append(f"{r.mode} {r.status}: {r.reason.rstrip('.')}.")
            note = len(notes)
        name = r.mode + (" (recommended)" if r.mode == pick else "")
        is_ref = r.mode == reference
        rows.append((name, _memory_cell(r), _speed_cell(r, is_ref), _stability_cell(r, is_ref, note)))
    lines = ["| format | memory | speed | stability |", "|---|---|---|---|"]
    lines += [f"| {' | '.join(row)} |" for row in rows]
    if width is None or max(len(line) for line in lines) <= width:
        return "\n".join(lines), notes
    blocks = []
    for name, *cells in rows:
        block = [name] + [textwrap.fill(cell, width=width, initial_indent=f"  {column:<10} ",
                                        subsequent_indent=" " * 13, break_long_words=False, break_on_hyphens=False)
                          for column, cell in zip(("memory", "speed", "stability"), cells)]
        blocks.append("\n".join(block))
    return "\n\n".join(blocks), notes


def format_notes(notes: Sequence[str]) -> str:
    if not notes:
        return ""
    return "\n".join(wrap(text, indent="    ", first=f"{i:>2}. ") for i, text in enumerate(notes, 1))


def legend(results: Sequence[ModeResult], reference: Optional[str], device_type: str, drift_tail: int) -> str:
    ref = reference or "the reference"
    tail = "the last step's loss" if drift_tail == 1 else f"mean of the last {drift_tail} steps"
    memory = ("peak CUDA memory allocated by the mode (torch.cuda.max_memory_allocated, reset per mode), and its"
              f" share of {ref}'s" if device_type == "cuda" else
              "estimated per mode on the CPU: weights, gradients, optimizer state and master copies, plus every"
              " tensor saved for backward in one step (the process's RSS is not per mode), and its share of"
              f" {ref}'s")
    fp8 = _FP8_LEGEND if any(r.fp8_lost is not None for r in results) else ""
    return "\n".join([
        wrap(f"memory: {memory}.", indent="  "),
        wrap(f"speed: median step time over the timed steps (IQR); speed-up over {ref}: the median of the"
             " per-round ratios, with its 95% bootstrap interval in brackets.", indent="  "),
        wrap(f"stability: final loss ({tail}) against {ref}'s; skipped steps; fp16"
             " headroom: log2(65504 / largest |value|) over the layers' outputs and gradients (PrecisionMonitor),"
             f" bits left before fp16 overflows (0 or less: it does).{fp8}", indent="  "),
    ])


_FP8_LEGEND = (" FP8 layer losing most: the largest share of an FP8 layer's input, weight or output gradient that its"
               " cast saturated (beyond the format's maximum once scaled) or rounded to zero (underflow), over the"
               " logged steps.")


def noise_text(results: Sequence[ModeResult], load: Optional[tuple[float, int]]) -> str:
    timed = [r for r in results if r.step_ms and r.step_iqr_ms is not None and not r.mode.startswith("lightning:")]
    if not timed:
        return "Timing: no mode was timed."
    worst = max(timed, key=_iqr_share)
    rel = _iqr_share(worst)
    busy = f"; load average {load[0]:.1f} on {load[1]} CPUs" if load is not None else ""
    if any(r.noisy for r in timed):
        return wrap(f"Timing: noisy — the IQR reached {100 * rel:.0f}% of the median step ({worst.mode}){busy}."
                    " Paired rounds cancel most of it; what they cannot, widens the intervals, and a close call"
                    " counts as a tie (which goes to the safer mode).")
    return wrap(f"Timing: steady — every IQR within {100 * rel:.0f}% of the median step{busy}.")


def _iqr_share(r: ModeResult) -> float:
    """The IQR of a timed mode's step time over its median."""
    assert r.step_iqr_ms is not None and r.step_ms
    return r.step_iqr_ms / r.step_ms


def probe_text(probe: Optional[Probe], why_not: Optional[str], device_type: str) -> str:
    if probe is None or probe.math_share is None:
        return wrap(f"Size: not checked ({why_not or 'no probe run'}).") if why_not != "off" else ""
    share, growth = probe.math_share, probe.growth
    assert growth is not None  # math_share: from the growth
    interval = f" [{growth.lo:.2f}–{growth.hi:.2f}]" if growth.hi > growth.lo else ""
    what = (f"the {probe.mode} step at batch {probe.batch} takes {growth.median:.2f}x{interval} the time of batch"
            f" {probe.probe_batch}: about {100 * share:.0f}% of it grows with the batch (the math) and"
            f" {100 * (1 - share):.0f}% is fixed")
    if not probe.overhead_bound:
        return wrap(f"Size: {what}, so the step is compute-bound and precision can matter.")
    bound = "launch-bound" if device_type == "cuda" else "overhead-bound"
    overhead = ("kernel launches, Python, optimizer bookkeeping" if device_type == "cuda" else
                "framework and Python overhead")
    at = probe.batch_to_matter
    later = (f"at a batch of about {at} or more (or a wider model) the math outweighs the overhead and precision"
             " starts to matter: rerun compare there" if at else
             "even at 64 times the batch the math would not outweigh it: only a much larger model would change that")
    return wrap(f"Size: {bound} — {what} ({overhead}). This model is too small for precision to matter on this"
                f" device; {later}.")


def recommendation_text(best: Optional[ModeResult], reason: str, confidence: Optional[str] = None) -> str:
    """The recommendation, its reason, and the lines to paste (Python and YAML)."""
    if best is None:
        return wrap(f"Recommendation: none — {reason}.")
    precision, master = split_mode(best.mode)
    states = mode_states(best.mode)
    master_arg = "" if master is None else f', master_weights="{master}"'
    master_arg += "" if states == "fp32" else f', optimizer_states="{states}"'
    head = f"Recommendation: {best.mode}" + (f" (confidence: {confidence})" if confidence else "")
    return (
        f"{head}\n{wrap(reason.rstrip('.') + '.', indent='  ')}\n\n"
        f'    Trainer(plugins=[MPPlugin("{precision}"{master_arg})])\n\n'
        "    trainer:\n"
        "      plugins:\n"
        "        - class_path: lightning_mp.MPPlugin\n"
        "          init_args:\n"
        f"            precision: {precision}\n"
        + ("" if master is None else f"            master_weights: {master}\n")
        + ("" if states == "fp32" else f"            optimizer_states: {states}\n")
    )


def explain(decision: Decision, results: Sequence[ModeResult], probe: Optional[Probe], noisy: bool) -> str:
    """Why the decision picked its mode, in sentences."""
    rows = {r.mode: r for r in results}
    pick, fastest = decision.mode, decision.fastest
    assert pick is not None  # (explained only where a mode was picked)
    need = f"{decision.min_speedup:.2f}x"
    safest = min(decision.tied + decision.beaten, key=_rank)
    out = []
    if pick == safest and pick == fastest:
        others = [m for m in decision.tied if m != pick]
        level = [m for m in others if not _slower(decision, m)]  # within noise
        slower = [m for m in others if _slower(decision, m)]  # its whole interval below the pick's speed
        if level:
            each = "; ".join(f"{m} {_inverse(decision.vs_fastest[m])}" for m in level)
            out.append(f"No mode is faster than {pick}, the numerically safest: {_join(level)}"
                       f" {'ties' if len(level) == 1 else 'tie'} with it within noise ({each}).")
        elif others or decision.beaten:
            out.append(f"{pick} is the fastest mode here and the numerically safest.")
        else:
            out.append(f"{pick} is the only mode that qualified.")
        if slower:
            each = "; ".join(f"{m} {_inverse(decision.vs_fastest[m])}" for m in slower)
            out.append(f"{_join(slower)} {'is' if len(slower) == 1 else 'are'} slower than {pick} ({each}).")
        if decision.beaten:
            gap = min(decision.vs_fastest[m].lo for m in decision.beaten)
            who = "Every other mode is" if not others else \
                f"{_join(decision.beaten)} {'is' if len(decision.beaten) == 1 else 'are'}"
            out.append(f"{who} at least {gap:.2f}x slower (lower end of the 95% interval).")
    elif pick == safest:
        lead = decision.vs_fastest[pick]
        measurably = "measurably faster, but " if lead.lo > 1.0 else ""
        head = f"No mode is faster than {pick} by the margin." if measurably else \
            f"No mode is measurably faster than {pick}."
        out.append(f"{head} The fastest, {fastest}, is {_x(lead)} its speed"
                   f" ({_interval(lead)}): {measurably}a less safe mode must gain at least {need} with 95% confidence,"
                   f" so the modes tie and the tie goes to {pick}, the numerically safest.")
    else:
        gain = decision.vs_pick[safest]
        beyond = f", beyond the {need} a less safe mode must gain" if gain.lo >= decision.min_speedup else ""
        out.append(f"{pick} is {_x(gain)} the speed of {safest} ({_interval(gain)}){beyond}.")
        if pick != fastest:
            lead = decision.vs_fastest[pick]
            how = f"measurably faster, but not surely by {need}" if lead.lo > 1.0 else "within noise"
            out.append(f"The fastest, {fastest}, is {_x(lead)} {pick}'s speed ({_interval(lead)}): {how},"
                       f" so they tie and {pick}, the numerically safer, is recommended.")
    if pick == safest and probe is not None and probe.overhead_bound:
        out.append("The step is mostly fixed overhead (see Size above): no precision can speed it up much, so"
                   f" {pick} costs nothing here.")
    also = [m for m in decision.tied if m not in (pick, fastest)] if pick != fastest else []
    level = [m for m in also if not _slower(decision, m)]
    if level:
        out.append(f"{_join(level)} {'ties' if len(level) == 1 else 'tie'} with the fastest too.")
    slower = [m for m in also if _slower(decision, m)]
    if slower:
        each = "; ".join(f"{m} {_inverse(decision.vs_fastest[m])}" for m in slower)
        out.append(f"{_join(slower)} {'is' if len(slower) == 1 else 'are'} slower than the fastest ({each}).")
    pick_row = rows.get(pick)
    lighter = [rows[m] for m in decision.tied if m != pick and m in rows and _lighter(rows[m], pick_row)]
    if lighter:
        best = min(lighter, key=_peak_mem)
        saved = 100 * (1 - _peak_mem(best) / _peak_mem(pick_row))
        how = "is slower but" if pick == fastest and _slower(decision, best.mode) else "ties with it on speed and"
        out.append(f"{best.mode} {how} needs {saved:.0f}% less memory: use it if memory is what limits you.")
    if decision.thin is not None:
        out.append(f"Confidence is {decision.confidence}: little was timed, {decision.thin}"
                   + ("; the timings were noisy too" if noisy else "")
                   + "; rerun with more --steps and --rounds for a firmer answer.")
    elif decision.confidence == "low":
        out.append("Confidence is low: " + ("the timings were noisy; " if noisy else "")
                   + "rerun on a quiet machine, or with more --steps and --rounds, for a sharper answer.")
    return " ".join(out)


def _slower(decision: Decision, mode: str) -> bool:
    """Whether ``mode`` is measurably slower than the fastest: the whole 95% interval of its speed relative to the
    fastest lies below 1.0 (it may still tie under the margin rule, but it is not "as fast")."""
    ratio = decision.vs_fastest.get(mode)
    return ratio is not None and ratio.lo > 1.0


def _x(ratio: Any) -> str:
    return f"{ratio.median:.2f}x"


def _inverse(ratio: Any) -> str:
    """``time(mode) / time(fastest)`` as the mode's speed relative to the fastest, with its interval."""
    if math.isinf(ratio.hi) or ratio.lo <= 0:
        return f"{1 / ratio.median:.2f}x, too few timed steps for an interval"
    return f"{1 / ratio.median:.2f}x, 95% interval {1 / ratio.hi:.2f}x–{1 / ratio.lo:.2f}x"


def _interval(ratio: Any) -> str:
    if math.isinf(ratio.hi):
        return f"too few timed steps ({ratio.n}) for an interval"
    where = f"{ratio.n} paired rounds" if ratio.paired else f"{ratio.n} steps"
    return f"95% interval {ratio.lo:.2f}x–{ratio.hi:.2f}x over {where}"


def _join(names: Sequence[str]) -> str:
    names = list(names)
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _rank(mode: str) -> tuple[int, int]:
    return safety_rank(mode)


def _lighter(r: ModeResult, pick: Optional[ModeResult]) -> bool:
    return (pick is not None and r.peak_mem_mib is not None and pick.peak_mem_mib is not None
            and r.memory_kind == pick.memory_kind and r.peak_mem_mib < 0.9 * pick.peak_mem_mib)


def _peak_mem(r: Optional[ModeResult]) -> float:
    """The peak memory of a row that :func:`_lighter` compared (known there)."""
    assert r is not None and r.peak_mem_mib is not None
    return r.peak_mem_mib


def write_plot(results: Sequence[ModeResult], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from err
    ran = [r for r in results if r.step_ms is not None]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    names = [r.mode for r in ran]
    if any(r.speedup is not None for r in ran):
        # the table's figure, so that both name the same mode faster: the paired speed-up over the reference (the
        # row without one) with its 95 % interval
        ups = [r.speedup if r.speedup is not None else 1.0 for r in ran]
        low = [u - r.speedup_lo if r.speedup_lo is not None and math.isfinite(r.speedup_lo) else 0.0
               for u, r in zip(ups, ran)]
        high = [r.speedup_hi - u if r.speedup_hi is not None and math.isfinite(r.speedup_hi) else 0.0
                for u, r in zip(ups, ran)]
        axes[0].bar(names, ups, yerr=[low, high], color="tab:blue", capsize=3)
        axes[0].axhline(1.0, color="grey", linewidth=0.8)
        reference = next((r.mode for r in ran if r.speedup is None), names[0])
        axes[0].set_title(f"speed-up over {reference} (95% interval; higher is faster)")
    else:
        iqr = any(r.step_iqr_ms is not None for r in ran)  # (a JSON from before compare kept it has none)
        axes[0].bar(names, [r.step_ms for r in ran], yerr=[(r.step_iqr_ms or 0) / 2 for r in ran] if iqr else None,
                    color="tab:blue", capsize=3)
        axes[0].set_title(f"median step time (ms{', IQR bars' if iqr else ''}; lower is faster)")
    axes[1].bar(names, [r.peak_mem_mib or 0 for r in ran], color="tab:orange")
    axes[1].set_title("peak memory (MiB)")
    for r in ran:
        axes[2].plot(range(1, len(r.losses) + 1), r.losses, label=r.mode)
    axes[2].set_title("training loss")
    axes[2].set_xlabel("step")
    axes[2].legend()
    for ax in axes[:2]:  # names such as 'lightning:bf16-mixed' end at their bar, not across the next one's
        ax.tick_params(axis="x", rotation=30)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
            label.set_rotation_mode("anchor")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
