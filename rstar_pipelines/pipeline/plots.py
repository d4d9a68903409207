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


def histogram(
    values: Sequence[float],
    title: str,
    xlabel: str,
    bins: int = 10,
    value_range: tuple[float, float] = (0.0, 1.0),
    ylabel: str = "problems",
) -> Markdown:
    """A histogram of `values`; `ylabel` says what each bar counts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 2.6))
    ax.hist(list(values), bins=bins, range=value_range, color="#4c72b0", edgecolor="white")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return _png_markdown(fig, title)


def line_plot(
    values: Sequence[float], title: str, xlabel: str, ylabel: str, first_x: int = 1
) -> Markdown:
    """`values` against consecutive x from `first_x` (steps from 1, iterations from 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 2.6))
    ax.plot(range(first_x, first_x + len(values)), list(values), color="#4c72b0")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return _png_markdown(fig, title)


def labelled_points(
    points: Sequence[tuple[str, float, float]], title: str, xlabel: str, ylabel: str
) -> Markdown:
    """One marked, labelled point per (label, x, y): methods set against each other."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 2.6))
    for label, x, y in points:
        ax.scatter([x], [y], color="#4c72b0")
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.margins(0.2)
    return _png_markdown(fig, title)
