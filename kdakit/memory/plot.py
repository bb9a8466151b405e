"""``kdakit mem plot``: stacked bars of the storage groups at the peak, one bar per backend.

Each bar is a :class:`kdakit.memory.model.MemoryModel` at one shape, stacked in the order
of :data:`kdakit.memory.model.GROUPS` and labelled with each group's GiB and the total.
A dashed line marks the floor (docs/spec.md §3); measured peaks (from ``kdakit mem measure --json``
records) can be drawn as markers beside the bars. matplotlib is imported only here, and
only when a plot is drawn (from the kdakit source tree: ``pip install -e '.[plot]'``).
"""

from __future__ import annotations

import os

from kdakit.memory.measure_worker import cell_of_record
from kdakit.memory.model import GROUPS, MemoryModel

# One colour per canonical group (colour-blind-safe palette), grey for anything else.
GROUP_COLORS = dict(zip(GROUPS, ("#4C72B0", "#DD8452", "#C44E52", "#8172B3", "#937860", "#55A868", "#8C8C8C")))
FORMATS = ("png", "svg")


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        # kdakit is not on PyPI: the extra is installed from the source tree (or matplotlib directly).
        raise ImportError("kdakit mem plot needs matplotlib, which is not installed: run "
                          "pip install -e '.[plot]' in the kdakit source tree (or pip install 'matplotlib>=3.7')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_groups(models: list[MemoryModel], out_stem: str, measured: dict[str, float] | None = None,
                formats=FORMATS, title: str | None = None) -> list[str]:
    """Draw the stacked group bars and write ``out_stem.png`` / ``out_stem.svg``; returns the paths.

    ``measured`` maps a backend name to its measured peak in GiB (drawn as a marker).
    All models must be at the same shape.
    """
    if not models:
        raise ValueError("plot_groups needs at least one model, got none")
    labels = {m.spec.label for m in models}
    if len(labels) != 1:
        raise ValueError(f"all models must be at one shape, got {sorted(labels)}")
    for fmt in formats:
        if fmt not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    plt = _pyplot()
    measured = measured or {}
    groups = list(GROUPS) + sorted({g for m in models for g in m.groups()} - set(GROUPS))
    top = max([m.peak_gib for m in models] + list(measured.values()))
    fig, ax = plt.subplots(figsize=(2.6 + 2.4 * len(models), 6.0))
    xs = range(len(models))
    for x, m in zip(xs, models):
        bottom = 0.0
        for g in groups:
            value = m.groups_gib().get(g, 0.0)
            if value <= 0:
                continue
            ax.bar(x, value, bottom=bottom, width=0.6, color=GROUP_COLORS.get(g, "#BBBBBB"), edgecolor="white",
                   linewidth=0.8, label=g)
            if value >= 0.025 * top:  # label segments tall enough to hold text
                ax.text(x, bottom + value / 2, f"{value:.3f}", ha="center", va="center", fontsize=8, color="white")
            bottom += value
        ax.text(x, bottom + 0.01 * top, f"{m.peak_gib:.3f} GiB", ha="center", va="bottom", fontsize=9, fontweight="bold")
        if m.backend in measured:
            ax.plot([x + 0.36], [measured[m.backend]], marker="<", color="black", markersize=9, linestyle="none",
                    label="measured peak")
            ax.text(x + 0.42, measured[m.backend], f"measured {measured[m.backend]:.3f}", va="center", fontsize=8)
    floor = models[0].floor_gib
    ax.axhline(floor, color="black", linestyle="--", linewidth=1, label=f"floor {floor:.3f} GiB")
    ax.set_xticks(list(xs), [m.backend for m in models])
    ax.set_xlim(-0.6, len(models) - 0.4 + 0.5)
    ax.set_ylim(0, top * 1.12)
    ax.set_ylabel("live storage at the peak (GiB = 2^30 B)")
    s = models[0].spec
    ax.set_title(title or f"KDA fwd+bwd peak by storage group: MBS {s.mbs} x {s.seq} tokens, "
                          f"{s.heads} heads, D {s.K}, {s.dtype}", fontsize=10)
    # Legend in stacking order (top group first, like the bars), then the floor and markers.
    handles, names = ax.get_legend_handles_labels()
    unique = dict(zip(names, handles))
    order = [g for g in reversed(groups) if g in unique] + [n for n in unique if n not in groups]
    ax.legend([unique[n] for n in order], order, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
              frameon=False)
    fig.tight_layout()
    paths = []
    for fmt in formats:
        path = f"{out_stem}.{fmt}"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        # SVG keeps its labels as text (searchable, editable) rather than glyph outlines.
        with plt.rc_context({"svg.fonttype": "none"}):
            fig.savefig(path, dpi=150 if fmt == "png" else None, bbox_inches="tight")
        paths.append(path)
    plt.close(fig)
    return paths


def measured_peaks(records: list[dict], cell: str | None) -> dict[str, float]:
    """Measured peaks (GiB) per backend at the cell labelled ``cell`` (``MBSxSEQ:H[/HV][:gate]``) from
    ``kdakit mem measure`` records (status ok only); none for ``cell=None`` (a call no cell measures)."""
    out = {}
    for r in records:
        if cell is not None and cell_of_record(r).label == cell and r.get("status") == "ok" \
                and r.get("peak_alloc_gib") is not None:
            out[r["backend"]] = float(r["peak_alloc_gib"])
    return out
