"""The postmortem's PNGs: the loss curve with what happened to it, the step rate, and where the time went.

Figures are drawn without pyplot (no global state; Agg through Figure.savefig). Long curves are reduced to
at most MAX_POINTS buckets (the mean as a line, the min-max band shaded) so a million-step history draws as
fast as a short one.
"""

from pathlib import Path

import numpy as np
import numpy.typing as npt
from matplotlib.figure import Figure

from flightdeck.events.checkpoint import CheckpointCommitted
from flightdeck.events.findings import LossSpikeDetected, NonFiniteLoss
from flightdeck.services.tools.postmortem.analysis import Postmortem, resumes
from flightdeck.services.tools.postmortem.goodput import PARTS, final_mask

MAX_POINTS = 2000
PIXELS = 1200  # columns of the time strip
COLORS = {"useful": "#2a9d8f", "redone": "#e9c46a", "detection": "#e63946", "restart": "#f4a261",
          "restore": "#9b5de5", "checkpoint_stall": "#457b9d", "startup": "#a8dadc", "queued": "#cccccc",
          "shutdown": "#8d99ae", "idle": "#eeeeee"}
DPI = 110

Floats = npt.NDArray[np.float64]


def reduce(x: Floats, y: Floats, n: int = MAX_POINTS) -> tuple[Floats, Floats, Floats, Floats]:
    """(x, mean, min, max) over at most n buckets of consecutive points; NaN gaps stay gaps."""
    if x.size <= n:
        return x, y, y, y
    edges = np.linspace(0, x.size, n + 1).astype(np.int64)
    starts = edges[:-1][np.diff(edges) > 0]
    counts = np.diff(np.append(starts, x.size))
    finite = np.where(np.isfinite(y), y, 0.0)
    mean = np.add.reduceat(finite, starts) / counts
    lo = np.fmin.reduceat(y, starts)
    hi = np.fmax.reduceat(y, starts)
    return np.add.reduceat(x, starts) / counts, mean, lo, hi


def loss_plot(pm: Postmortem, path: Path) -> Path:
    return _save(loss_figure(pm), path)


def loss_figure(pm: Postmortem) -> Figure:
    lead = pm.scan.lead
    fig = Figure(figsize=(10, 4.8))
    ax = fig.subplots()
    final = final_mask(lead.step)
    order = np.argsort(lead.step[final], kind="stable")
    x, y = lead.step[final][order].astype(np.float64), lead.loss[final][order]
    rx, mean, lo, hi = reduce(x, y)
    ax.plot(rx, mean, color=COLORS["useful"], lw=1.2, label="loss (rank 0, final timeline)")
    if rx.size < x.size:
        ax.fill_between(rx, lo, hi, color=COLORS["useful"], alpha=0.25, lw=0)
    thrown = ~final
    if thrown.any():
        tx, ty = lead.step[thrown].astype(np.float64), lead.loss[thrown]
        breaks = np.flatnonzero(np.diff(tx) != 1) + 1  # each thrown-away run is its own line
        tx, ty = np.insert(tx, breaks, np.nan), np.insert(ty, breaks, np.nan)
        ax.plot(tx, ty, color="#999999", lw=1.0, label="thrown away (redone)")
    top = float(np.nanmax(np.where(np.isfinite(lead.loss), lead.loss, np.nan))) if len(lead) else 1.0
    events = [c.event for c in pm.scan.control]
    spikes = [e for e in events if isinstance(e, LossSpikeDetected)]
    if spikes:
        ax.scatter([e.step for e in spikes], [e.loss for e in spikes], marker="x", s=60, color=COLORS["detection"],
                   zorder=5, label="loss spike detected")
    nonfinite = [e for e in events if isinstance(e, NonFiniteLoss)]
    if nonfinite:
        ax.scatter([e.step for e in nonfinite], [top] * len(nonfinite), marker="v", s=50, color="black", zorder=5,
                   label="non-finite loss")
    for k, inc in enumerate(i for i in pm.incidents if i.decision == "rollback" and i.rollback_to is not None):
        assert inc.rollback_to is not None
        ax.axvline(inc.rollback_to, color=COLORS["restore"], ls="--", lw=1, label="rollback to" if k == 0 else None)
        if inc.skip and inc.skip[1] > inc.skip[0]:  # batch indices, not steps: written at the rollback, not drawn
            ax.annotate(f"skips batches [{inc.skip[0]}, {inc.skip[1]})", (inc.rollback_to, 0.02),
                        xycoords=("data", "axes fraction"), fontsize=7, color=COLORS["restore"], rotation=90,
                        ha="right", va="bottom")
    for k, (_, step, attempt) in enumerate(resumes(pm)):
        ax.axvline(step, color=COLORS["restart"], ls=":", lw=1.4, label="restart (resumed from)" if k == 0 else None)
        ax.annotate(f"a{attempt}", (step, 1.0), xycoords=("data", "axes fraction"), fontsize=7,
                    color=COLORS["restart"], ha="left", va="top")
    failed = [i for i in pm.incidents if i.decision == "fail"]
    if failed and len(lead):
        ax.axvline(float(lead.step[-1]), color="black", lw=1.5, label="job failed")
    commits = [e.step for e in events if isinstance(e, CheckpointCommitted)]
    if commits:
        ax.plot(commits, np.zeros(len(commits)), "|", color=COLORS["checkpoint_stall"], ms=8,
                transform=ax.get_xaxis_transform(), label="checkpoint committed")
    ax.set_xlabel("step")
    # A log axis: a spike of x10 would flatten a linear one's curve to a line (a loss that is not positive cannot be)
    shown = lead.loss[np.isfinite(lead.loss)]
    log = bool(shown.size) and float(shown.min()) > 0
    if log:
        ax.set_yscale("log")
    ax.set_ylabel("loss (log scale)" if log else "loss")
    ax.set_title(f"{pm.summary.job_id}: loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    return fig


def step_rate_plot(pm: Postmortem, path: Path) -> Path:
    lead, t0, wall = pm.scan.lead, pm.scan.t0, max(pm.goodput.wall_s, 1e-9)
    fig = Figure(figsize=(10, 3.6))
    ax = fig.subplots()
    bins = int(min(MAX_POINTS // 4, max(20, len(lead) // 3)))
    width = wall / bins
    counts, edges = np.histogram(lead.end - t0, bins=bins, range=(0.0, wall))
    ax.step(edges[:-1], counts / width, where="post", color=COLORS["useful"], lw=1.2, label="steps/s (rank 0)")
    for k, part in enumerate(("detection", "restart", "restore")):
        for j, inc in enumerate(i for i in pm.incidents if i.decision != "none"):
            span = {"detection": (inc.fault_at, inc.detected_at), "restart": (inc.detected_at, inc.restart_end),
                    "restore": (inc.restart_end, inc.restore_end)}[part]
            if span[1] > span[0]:
                ax.axvspan(*span, color=COLORS[part], alpha=0.35, lw=0, label=part if j == 0 else None)
        del k
    ax.set_xlim(0, wall)
    ax.set_xlabel("seconds since submission")
    ax.set_ylabel("steps/s")
    ax.set_title(f"{pm.summary.job_id}: step rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    return _save(fig, path)


def strip(edges: Floats, labels: npt.NDArray[np.int64], wall: float, pixels: int = PIXELS) -> npt.NDArray[np.int64]:
    """The dominant part in each of `pixels` equal slices of the wall time."""
    grid = np.linspace(0.0, wall, pixels + 1)
    length = np.diff(edges)
    share = np.empty((len(PARTS), pixels))
    for k in range(len(PARTS)):
        cum = np.concatenate([[0.0], np.cumsum(np.where(labels == k, length, 0.0))])
        share[k] = np.diff(np.interp(grid, edges, cum))
    return np.argmax(share, axis=0)


def time_plot(pm: Postmortem, path: Path) -> Path:
    g = pm.goodput
    fig = Figure(figsize=(10, 3.8))
    top, bottom = fig.subplots(2, 1, gridspec_kw={"height_ratios": [1, 2]})
    if g.wall_s > 0 and g.labels.size:
        from matplotlib.colors import ListedColormap
        cmap = ListedColormap([COLORS[p] for p in PARTS])
        top.imshow(strip(g.edges, g.labels, g.wall_s)[None, :], aspect="auto", cmap=cmap, vmin=0,
                   vmax=len(PARTS) - 1, extent=(0, g.wall_s, 0, 1), interpolation="nearest")
    top.set_yticks([])
    top.set_xlabel("seconds since submission")
    top.set_title(f"{pm.summary.job_id}: where the wall time went (goodput {g.goodput:.1%})")
    shown = [p for p in PARTS if g.parts[p] > 0]
    left = 0.0
    for p in shown:
        bottom.barh(0, g.parts[p], left=left, color=COLORS[p], label=f"{p} {g.parts[p]:.3g} s")
        left += g.parts[p]
    bottom.set_xlim(0, max(g.wall_s, 1e-9))
    bottom.set_yticks([])
    bottom.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    fig.subplots_adjust(hspace=0.9, bottom=0.3)
    return _save(fig, path)


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout() if fig.get_figheight() > 4 else None
    fig.savefig(path, dpi=DPI, format="png")
    return path


PLOTS = {"loss.png": loss_plot, "step_rate.png": step_rate_plot, "time.png": time_plot}


def draw_all(pm: Postmortem, out: Path) -> list[Path]:
    return [draw(pm, out / name) for name, draw in PLOTS.items()]
