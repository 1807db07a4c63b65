"""Memory-over-time pictures (matplotlib, non-interactive backend).

One figure: simulated GPU memory over one training step without and with the plan, the budget
line, swap-out and swap-in traffic as marks along the bottom, and host memory on a second axis.
"""

from __future__ import annotations

import os

from lmscli.errors import InputError
from lmscli.units import format_size


def _step_series(curve, resident: int):
    xs, ys = [0.0], [resident / (1 << 30)]
    for t, b in curve:
        xs.append(t * 1e3)
        ys.append((b + resident) / (1 << 30))
    return xs, ys


def memory_plot(prepared, result, path: str, title: str | None = None) -> str:
    """Write the plot of a :class:`~lmscli.planner.TuneResult` to ``path`` (.png or .svg);
    ``result`` may also be a bare no-swap :class:`~lmscli.simulator.SimResult` (analyze)."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".png", ".svg"):
        raise InputError(f"{path}: the plot must be a .png or .svg file")
    try:
        import matplotlib
    except ImportError:
        raise InputError("plots need matplotlib: pip install 'lmscli[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lmscli.simulator import SimResult

    if isinstance(result, SimResult):
        baseline, after, plan, budget = result, None, None, None
    else:
        baseline, after, plan, budget = result.baseline, result.result, result.plan, result.budget
    swapped = bool(plan and plan.swaps)
    resident = baseline.resident_bytes
    fig, ax = plt.subplots(figsize=(10, 5.2), dpi=110)
    bx, by = _step_series(baseline.curve, resident)
    ax.step(bx, by, where="post", color="#9aa5b1", lw=1.2, label=f"without lms (peak {format_size(baseline.peak_bytes)})")
    if swapped:
        wx, wy = _step_series(after.curve, resident)
        ax.step(wx, wy, where="post", color="#1f6feb", lw=1.4, label=f"with lms (peak {format_size(after.peak_bytes)})")
        for direction, _tid, start, end in after.transfers:
            y = 0.0 if direction == "out" else 0.015 * max(by)
            ax.plot([start * 1e3, end * 1e3], [y, y], color="#d29922" if direction == "out" else "#2da44e", lw=3,
                    solid_capstyle="butt")
        ax.plot([], [], color="#d29922", lw=3, label="swap-out transfers")
        ax.plot([], [], color="#2da44e", lw=3, label="swap-in transfers")
    if budget is not None:
        ax.axhline(budget / (1 << 30), color="#cf222e", ls="--", lw=1.2, label=f"budget {format_size(budget)}")
    ax.axhline(resident / (1 << 30), color="#57606a", ls=":", lw=1, label=f"resident (variables) {format_size(resident)}")
    ax.set_xlabel("time in one training step (ms, simulated)")
    ax.set_ylabel("GPU memory (GiB)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.25)
    if swapped and after.host_curve:
        ax2 = ax.twinx()
        hx = [0.0] + [t * 1e3 for t, _ in after.host_curve]
        hy = [0.0] + [b / (1 << 30) for _, b in after.host_curve]
        ax2.step(hx, hy, where="post", color="#8250df", lw=1, alpha=0.7)
        ax2.set_ylabel("host memory for swapped tensors (GiB)", color="#8250df")
        ax2.set_ylim(bottom=0)
        ax.plot([], [], color="#8250df", lw=1, label="host memory (right axis)")
    if title is None and plan is not None:
        dev = plan.device
        title = (f"{plan.model}: {format_size(dev['gpu_mem_bytes'])} GPU, budget {format_size(budget)}, "
                 f"{dev['link']} ({plan.strategy} strategy)")
    ax.set_title(title or f"{prepared.model.name}: simulated GPU memory in one training step")
    ax.legend(loc="upper left", fontsize=8, framealpha=0.9)
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise InputError(f"{path}: the directory {directory} does not exist")
    tmp = os.path.join(directory, f".lms-plot-{os.getpid()}{ext}")
    fig.savefig(tmp, format=ext[1:])
    plt.close(fig)
    os.replace(tmp, path)
    return path
