"""Pictures of a mask and of each head's attention weights (matplotlib heatmaps).

Legend: B batch, H heads, S query length, Sk key length.
"""

from __future__ import annotations

import math

from torch import Tensor

__all__ = ["figure_size", "plot_attention", "plot_tile_map", "DPI"]

DPI = 100
_PANEL_INCHES = 2.6
_MAX_COLUMNS = 4


def _grid(heads: int) -> tuple[int, int]:
    panels = heads + 1  # the mask, then one panel per head
    cols = min(_MAX_COLUMNS, panels)
    return math.ceil(panels / cols), cols


def figure_size(heads: int) -> tuple[int, int]:
    """The PNG's (width, height) in pixels for ``heads`` heads."""
    rows, cols = _grid(heads)
    return round(cols * _PANEL_INCHES * DPI), round(rows * _PANEL_INCHES * DPI)


def _pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display); ImportError with the remedy."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError("plots need matplotlib: pip install 'headwise[plot]'") from exc
    return plt


def plot_attention(allowed: Tensor, weights: Tensor, path: str, *, title: str = "") -> tuple[int, int]:
    """Draw the expanded mask and every head's weights for one batch row into a PNG.

    Args:
        allowed: (S, Sk) bool, True where a query may attend a key.
        weights: (H, S, Sk) probabilities of that batch row.
        path: where to write the PNG.
        title: the figure's title.

    Returns:
        The image's (width, height) in pixels.

    Raises:
        ImportError: matplotlib is missing (``pip install headwise[plot]``).
    """
    plt = _pyplot()
    import matplotlib
    import numpy as np

    heads = weights.shape[0]
    rows, cols = _grid(heads)
    width, height = figure_size(heads)
    fig, axes = plt.subplots(rows, cols, figsize=(width / DPI, height / DPI), dpi=DPI,
                             squeeze=False, layout="constrained")  # constrained: room for the colour bar
    blocked = ~allowed.cpu().numpy()
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="lightgrey")  # masked cells: grey
    ax = axes[0][0]
    ax.imshow(allowed.cpu().numpy(), cmap="Greys_r", vmin=0, vmax=1)
    ax.set_title("mask (white = attend)", fontsize=9)
    for h in range(heads):
        ax = axes[(h + 1) // cols][(h + 1) % cols]
        data = np.ma.masked_array(weights[h].detach().float().cpu().numpy(), mask=blocked)
        image = ax.imshow(data, cmap=cmap, vmin=0.0, vmax=1.0)
        ax.set_title(f"head {h}", fontsize=9)
    for ax in axes.flat:
        ax.set_xlabel("key", fontsize=7)
        ax.set_ylabel("query", fontsize=7)
        ax.tick_params(labelsize=6)
    for extra in axes.flat[heads + 1:]:
        extra.axis("off")
    if heads:  # one scale for every head: a weight is a probability, 0 to 1
        bar = fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.6, aspect=30)
        bar.set_label("attention weight (grey: masked)", fontsize=8)
        bar.ax.tick_params(labelsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return width, height


def plot_tile_map(states: Tensor, path: str, *, block: tuple[int, int], title: str = "") -> tuple[int, int]:
    """Draw a tile map's states (nq, nk) into a PNG: empty tiles white, partial grey, full black.

    Args:
        states: (nq, nk) int8 tile states of one (b, h): 0 empty, 1 partial, 2 full
            (:class:`headwise.masks.TileMap`'s ``states``).
        path: where to write the PNG.
        block: the (bq, bk) tile, for the axis labels.
        title: the figure's title.

    Returns:
        The image's (width, height) in pixels.

    Raises:
        ImportError: matplotlib is missing (``pip install headwise[plot]``).
    """
    plt = _pyplot()
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    width = height = round(2 * _PANEL_INCHES * DPI)
    fig, ax = plt.subplots(figsize=(width / DPI, height / DPI), dpi=DPI, layout="constrained")
    colours = ListedColormap(["white", "darkgrey", "black"])
    ax.imshow(states.cpu().numpy(), cmap=colours, vmin=0, vmax=2)
    nq, nk = states.shape
    ax.set_xticks(range(0, nk, max(1, nk // 8)))
    ax.set_yticks(range(0, nq, max(1, nq // 8)))
    ax.set_xlabel(f"key tile ({block[1]} keys)", fontsize=8)
    ax.set_ylabel(f"query tile ({block[0]} queries)", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.legend(handles=[Patch(facecolor=c, edgecolor="grey", label=n) for c, n in
                       (("white", "empty: skipped"), ("darkgrey", "partial: masked"), ("black", "full: no mask"))],
              loc="upper right", fontsize=7)
    if title:
        ax.set_title(title, fontsize=9)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return width, height
