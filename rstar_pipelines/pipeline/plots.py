"""Small plots for materialization metadata: a PNG inlined in Markdown, as the Dagster
UI shows it. Keep them small: metadata lives in the event log."""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence

from rstar_pipelines.pipeline.stage import Markdown


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> Markdown:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return Markdown("\n".join(lines))


def _png_markdown(fig, title: str) -> Markdown:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80, bbox_inches="tight")
    plt.close(fig)
    encoded = base64.b64encode(buffer.getvalue()).decode("ascii")
    return Markdown(f"![{title}](data:image/png;base64,{encoded})")


def _axes(size: tuple[float, float] = (4.5, 2.6)):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=size)


def histogram(
    values: Sequence[float],
    title: str,
    xlabel: str,
    ylabel: str,
    bins: int = 10,
    value_range: tuple[float, float] = (0.0, 1.0),
) -> Markdown:
    """How many of `values` fall in each bin; `ylabel` names what they count."""
    fig, ax = _axes()
    ax.hist(list(values), bins=bins, range=value_range, color="#4c72b0", edgecolor="white")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return _png_markdown(fig, title)


def line_plot(
    values: Sequence[float], title: str, xlabel: str, ylabel: str, first_x: int = 1
) -> Markdown:
    """`values` against consecutive x from `first_x` (steps from 1, iterations from 0)."""
    fig, ax = _axes()
    ax.plot(range(first_x, first_x + len(values)), list(values), color="#4c72b0")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return _png_markdown(fig, title)


def labelled_points(
    points: Sequence[tuple[str, float, float]], title: str, xlabel: str, ylabel: str
) -> Markdown:
    """One marked, labelled point per (label, x, y): methods set against each other."""
    fig, ax = _axes()
    for label, x, y in points:
        ax.scatter([x], [y], color="#4c72b0")
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.margins(0.2)
    return _png_markdown(fig, title)


def intervals(
    points: Sequence[tuple[str, str, float, float, float]], title: str, ylabel: str
) -> Markdown:
    """Per (series, category, value, low, high): the value with [low, high] as an error bar,
    the categories along x and the series side by side within each (rounds by method)."""
    categories = list(dict.fromkeys(category for _, category, *_ in points))
    series = list(dict.fromkeys(name for name, *_ in points))
    fig, ax = _axes((max(4.5, 0.7 * len(categories) + 1.5), 3.0))
    width = 0.8 / len(series)
    for k, name in enumerate(series):
        mine = [p for p in points if p[0] == name]
        offset = (k - (len(series) - 1) / 2) * width
        ax.errorbar(
            [categories.index(category) + offset for _, category, *_ in mine],
            [value for *_, value, _, _ in mine],
            yerr=[
                [value - low for *_, value, low, _ in mine],
                [high - value for *_, value, _, high in mine],
            ],
            fmt="o",
            capsize=3,
            label=name,
        )
    ax.set_xticks(range(len(categories)), categories, rotation=30, ha="right", fontsize=8)
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # off the bars
    return _png_markdown(fig, title)
