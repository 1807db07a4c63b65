"""Memory-over-time pictures (matplotlib, non-interactive backend).

One figure: simulated GPU memory over one training step without and with the plan, the budget
line, and host memory for swapped tensors on a second axis; under it, a strip with the swap-out
and swap-in transfers on their two streams. Titled with the model, the device and the budget.
Byte axes are labelled through :func:`lmscli.units.format_size`.
"""

from __future__ import annotations

import io
import os

from lmscli.errors import InputError
from lmscli.units import format_size

WITHOUT, WITH, BUDGET, OUT, IN, HOST, RESIDENT = (
    "#8c959f", "#1f6feb", "#cf222e", "#d29922", "#2da44e", "#8250df", "#57606a")
# Deterministic SVG (no date, stable ids) with real <text> labels.
RC = {"svg.hashsalt": "lms", "svg.fonttype": "none"}


def _matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise InputError("plots need matplotlib: pip install 'lmscli[plot]'") from None
    matplotlib.use("Agg")
    return matplotlib


def _step_series(curve, resident: int):
    xs, ys = [0.0], [resident]
    for t, b in curve:
        xs.append(t * 1e3)
        ys.append(b + resident)
    return xs, ys


def _nice_step(top: float, ticks: int = 6) -> float:
    raw = top / ticks
    scale = 1.0
    while raw >= 10 * scale:
        scale *= 10
    while raw < scale:
        scale /= 10
    for mult in (1, 2, 2.5, 5, 10):
        if raw <= mult * scale:
            return mult * scale
    return 10 * scale  # pragma: no cover


def _byte_axis(axis, top: int) -> None:
    """Ticks at round multiples of the binary unit of ``top``, labelled with format_size."""
    from matplotlib.ticker import FixedLocator, FuncFormatter

    unit = 1
    for candidate in (1 << 10, 1 << 20, 1 << 30, 1 << 40):
        if top >= candidate:
            unit = candidate
    step = _nice_step(max(top, 1) / unit)
    precision = 0 if step == int(step) else (1 if step * 10 == int(step * 10) else 2)
    ticks = [k * step * unit for k in range(int(top / unit / step) + 2)]
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: "0" if v == 0 else format_size(v, precision)))


def _title(prepared, plan, budget, baseline) -> str:
    if plan is None:
        return (f"{prepared.model.name}: simulated GPU memory in one step, no swapping "
                f"(peak {format_size(baseline.peak_bytes)})")
    dev = plan.device
    gpu = dev.get("name") if dev.get("name") not in (None, "", "custom") else f"{format_size(dev['gpu_mem_bytes'])} GPU"
    return (f"{plan.model} on {gpu}: budget {format_size(budget)} ({dev.get('reserve', 0) * 100:.0f}% reserved), "
            f"link {dev.get('link')}, {plan.strategy} strategy")


def figure(prepared, result, title: str | None = None):
    """The matplotlib figure for a :class:`~lmscli.plan.planner.TuneResult`, or for a bare no-swap
    :class:`~lmscli.model.simulator.SimResult` (analyze)."""
    _matplotlib()
    import matplotlib.pyplot as plt

    from lmscli.model.simulator import SimResult

    if isinstance(result, SimResult):
        baseline, after, plan, budget = result, None, None, None
    else:
        baseline, after, plan, budget = result.baseline, result.result, result.plan, result.budget
    swapped = bool(plan and plan.swaps)
    resident = baseline.resident_bytes
    if swapped:
        fig, (ax, lanes) = plt.subplots(2, 1, figsize=(10, 6), dpi=110, sharex=True,
                                        gridspec_kw={"height_ratios": [5, 1]})
    else:
        fig, ax = plt.subplots(figsize=(10, 5.2), dpi=110)
        lanes = None
    peak = max(baseline.peak_bytes, after.peak_bytes if after is not None else 0)
    budget_shown = budget is not None and budget <= 1.25 * peak
    top = max(peak, budget if budget_shown else 0)

    bx, by = _step_series(baseline.curve, resident)
    ax.step(bx, by, where="post", color=WITHOUT, lw=1.2,
            label=f"{'without lms' if plan is not None else 'no swapping'} (peak {format_size(baseline.peak_bytes)})")
    if swapped:
        wx, wy = _step_series(after.curve, resident)
        ax.step(wx, wy, where="post", color=WITH, lw=1.5, label=f"with lms (peak {format_size(after.peak_bytes)})")
    if budget is not None:
        if budget_shown:
            ax.axhline(budget, color=BUDGET, ls="--", lw=1.3, label=f"budget {format_size(budget)}")
        else:
            ax.plot([], [], color=BUDGET, ls="--", lw=1.3, label=f"budget {format_size(budget)} (above the chart)")
    ax.axhline(resident, color=RESIDENT, ls=":", lw=1, label=f"resident (variables) {format_size(resident)}")
    ax.set_ylabel("GPU memory")
    ax.set_ylim(0, top * 1.32)  # headroom for the legend
    _byte_axis(ax.yaxis, int(top))
    ax.grid(alpha=0.25)
    if swapped and after.host_curve:
        host = ax.twinx()
        hx = [0.0] + [t * 1e3 for t, _ in after.host_curve]
        hy = [0] + [b for _, b in after.host_curve]
        host.fill_between(hx, hy, step="post", color=HOST, alpha=0.08, lw=0)
        host.step(hx, hy, where="post", color=HOST, lw=1, alpha=0.8)
        host.set_ylabel("host memory (swapped tensors)", color=HOST)
        host_top = max(top, after.host_peak_bytes)  # the GPU's scale unless the host needs more
        host.set_ylim(0, host_top * 1.32)
        _byte_axis(host.yaxis, host_top)
        host.tick_params(axis="y", colors=HOST)
        ax.plot([], [], color=HOST, lw=1, label=f"host memory, right axis (peak {format_size(after.host_peak_bytes)})")
        ax.set_zorder(host.get_zorder() + 1)
        ax.patch.set_visible(False)
    if lanes is not None:
        for direction, row, color in (("out", 1, OUT), ("in", 0, IN)):
            bars = [(s * 1e3, max((e - s) * 1e3, 1e-6)) for d, _tid, s, e in after.transfers if d == direction]
            lanes.broken_barh(bars, (row - 0.35, 0.7), color=color)
        lanes.set_yticks([1, 0])
        lanes.set_yticklabels([f"swap-out\n{format_size(after.swap_out_bytes)}", f"swap-in\n{format_size(after.swap_in_bytes)}"],
                              fontsize=8)
        lanes.set_ylim(-0.6, 1.6)
        lanes.grid(axis="x", alpha=0.25)
        lanes.set_xlabel("time in one step (ms, simulated)")
        ax.plot([], [], color=OUT, lw=5, label="swap-out transfers (to host)")
        ax.plot([], [], color=IN, lw=5, label="swap-in transfers (to GPU)")
    else:
        ax.set_xlabel("time in one step (ms, simulated)")
    ax.set_xlim(left=0)
    ax.set_title(title or _title(prepared, plan, budget, baseline), fontsize=11)
    ax.legend(loc="upper center", ncol=2 if swapped else 3, fontsize=8, framealpha=0.92)
    fig.tight_layout()
    return fig


def _render(fig, fmt: str) -> bytes:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt, metadata={"Date": None} if fmt == "svg" else None)
    plt.close(fig)
    return buffer.getvalue()


def memory_plot(prepared, result, path: str, title: str | None = None) -> str:
    """Write the plot of a :class:`~lmscli.plan.planner.TuneResult` (or a no-swap SimResult) to ``path``
    (.png or .svg), atomically."""
    from lmscli.loader import atomic_write, output_directory

    ext = os.path.splitext(path)[1].lower()
    if ext not in (".png", ".svg"):
        raise InputError(f"{path}: the plot must be a .png or .svg file")
    output_directory(path)  # (before rendering)
    with _rc():
        data = _render(figure(prepared, result, title), ext[1:])
    atomic_write(path, data)
    return path


def memory_svg(prepared, result, title: str | None = None) -> str:
    """The plot as SVG text (an ``<svg>`` element without XML prolog or RDF metadata), for embedding
    in HTML."""
    with _rc():
        text = _render(figure(prepared, result, title), "svg").decode("utf-8")
    text = text[text.index("<svg"):]
    start, end = text.find("<metadata>"), text.find("</metadata>")
    if 0 <= start < end:
        text = text[:start] + text[end + len("</metadata>"):]
    return text


def _rc():
    return _matplotlib().rc_context(RC)
