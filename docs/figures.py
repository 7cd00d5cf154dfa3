"""Draw the documentation's figures as SVG into docs/figures/: the chunked algorithm's phases
and the sequence-parallel data flow. Run it after changing a figure and commit its output:

    python docs/figures.py

Needs matplotlib (the ``test`` and ``plot`` extras). The files are reproducible: no date, fixed
ids, text kept as text.
"""

import pathlib

import matplotlib

matplotlib.use("svg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

OUT = pathlib.Path(__file__).resolve().parent / "figures"
BLUE, ORANGE, GREEN, GREY = "#4c72b0", "#dd8452", "#55a868", "#8c8c8c"
plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "rwkv_jax", "font.size": 10,
                     "font.family": "sans-serif"})


def canvas(width, height):
    fig = plt.figure(figsize=(width, height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.set_axis_off()
    return fig, ax


def box(ax, x, y, w, h, text, color, text_color="white", size=9):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="white", linewidth=1.5))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", color=text_color, fontsize=size)


def arrow(ax, start, end, color=GREY, style="-|>"):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=12, color=color,
                                 linewidth=1.3, shrinkA=0, shrinkB=0))


def save(fig, name):
    OUT.mkdir(exist_ok=True)
    fig.savefig(OUT / name, metadata={"Date": None})
    plt.close(fig)


def chunked_phases():
    """A sequence in chunks of C tokens: in-chunk matrices in parallel, one sequential pass
    over the chunks carrying the state, then every chunk's outputs in parallel."""
    chunks, width, left = 4, 1.9, 1.9
    fig, ax = canvas(left + chunks * width + 0.3, 3.6)
    rows = [(2.55, "1. in-chunk\n(parallel)", BLUE, "WY / UT transform\n(C × C matrices)"),
            (1.45, "2. state pass\n(sequential)", ORANGE, "H{i} → H{j}"),
            (0.35, "3. outputs\n(parallel)", GREEN, "o = in-chunk\n+ from H{i}")]
    ax.text(left + chunks * width / 2, 3.45, "T tokens in chunks of C", ha="center", va="center")
    for y, label, color, text in rows:
        ax.text(0.1, y + 0.35, label, ha="left", va="center", fontsize=9)
        for c in range(chunks):
            box(ax, left + c * width + 0.05, y, width - 0.1, 0.7,
                text.format(i=c, j=c + 1), color)
    for c in range(chunks - 1):   # the state carried from chunk to chunk
        x = left + (c + 1) * width
        arrow(ax, (x - 0.15, 1.8), (x + 0.15, 1.8), color="black")
    for c in range(chunks):       # each phase feeds the next one of the same chunk
        x = left + c * width + width / 2
        arrow(ax, (x, 2.55), (x, 2.15))
        arrow(ax, (x, 1.45), (x, 1.05))
    save(fig, "chunked_phases.svg")


def sequence_parallel():
    """n devices, each a block of T/n tokens: the block's transition and local state from zero,
    one all-gather, a scan to the incoming state, then the op on the block from it."""
    devices, top = 4, 3.7
    fig, ax = canvas(9.4, 4.2)
    columns = [(1.25, 1.7, "block of T/n\ntokens", GREY),
               (3.25, 1.9, "Φ, h_local\n(state from zero)", BLUE),
               (6.05, 1.4, "h_in\n(scan)", ORANGE),
               (7.75, 1.5, "op on the block\nfrom h_in", GREEN)]
    titles = ["input", "1. state-only pass", "3. exclusive scan", "4. one op call"]
    for (x, w, _, _), title in zip(columns, titles):
        ax.text(x + w / 2, top + 0.25, title, ha="center", va="center", fontsize=9)
    for d in range(devices):
        y = top - 0.85 * (d + 1)
        ax.text(0.1, y + 0.3, f"device {d}", ha="left", va="center", fontsize=9)
        for x, w, text, color in columns:
            box(ax, x, y, w, 0.6, text, color, size=8)
        arrow(ax, (2.95, y + 0.3), (3.25, y + 0.3))
        arrow(ax, (5.15, y + 0.3), (5.5, y + 0.3))
        arrow(ax, (5.75, y + 0.3), (6.05, y + 0.3))
        arrow(ax, (7.45, y + 0.3), (7.75, y + 0.3))
    # the all-gather: every device's (Φ, h_local) reaches every device
    y0, y1 = top - 0.85 * devices, top - 0.25
    ax.add_patch(Rectangle((5.5, y0), 0.25, y1 - y0, facecolor="#c44e52", edgecolor="white"))
    ax.text(5.625, y0 - 0.2, "2. all-gather", ha="center", va="center", fontsize=9)
    save(fig, "sequence_parallel.svg")


if __name__ == "__main__":
    chunked_phases()
    sequence_parallel()
    print("wrote", ", ".join(sorted(p.name for p in OUT.glob("*.svg"))), "in", OUT)
