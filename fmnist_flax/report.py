"""The figures and one self-contained report.html: plain arrays in, files out.

A report is a dict of sections (heading -> tables, figures, notes) that the run and its
extensions fill; `write_report` orders them, saves each figure as a PNG and inlines it.
"""

from __future__ import annotations

import base64
import html
import json
import pathlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from fmnist_flax.tables import Table

if TYPE_CHECKING:  # matplotlib, a slow import, is imported by the first figure drawn
    from matplotlib.figure import Figure

Item = Table | tuple[str, "Figure"] | str  # a table, (PNG file name, figure) or a note

BLUE = "#0969da"
GREEN = "#1a7f37"
RED = "#d1242f"
DPI = 100
CONFUSION_LABEL_AT = 0.08  # cells at or above this fraction (and the diagonal) show a percentage
PREDICTION_SAMPLES = 25
PREDICTION_SEED = 7
SUPTITLE_INCHES = 0.7  # room above a grid of images for the figure's title
# Where known sections go in the report; any other section follows them in the order added.
SECTION_ORDER = (
    "Set-up",
    "Data",
    "Batches",
    "Model",
    "Gradients",
    "Python dispatch vs jit",
    "Training",
    "Evaluation",
    "Precision",
    "Device placement",
    "Throughput in tokens",
)


def new_figure(width: float, height: float) -> Figure:
    """An empty figure on matplotlib's Agg canvas: no pyplot state or display needed."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height))


def image_grid(fig: Figure, rows: int, cols: int, hspace: float) -> list[Any]:
    """rows x cols axes for titled images under the figure's suptitle, laid out by fixed
    margins: `tight_layout` would draw the whole figure once more to measure it."""
    height = fig.get_figheight()
    margins = {"left": 0.015, "right": 0.985, "wspace": 0.08, "hspace": hspace}
    spec = {"bottom": 0.15 / height, "top": 1 - SUPTITLE_INCHES / height, **margins}
    return list(fig.subplots(rows, cols, squeeze=False, gridspec_kw=spec).flat)


def show_image(ax: Any, image: np.ndarray) -> None:
    """One (H, W, C) uint8 image: grayscale (C = 1) in grey, RGB or RGBA in colour, any other
    channel count by its first channel."""
    if image.shape[-1] in (3, 4):
        ax.imshow(image)
    else:
        ax.imshow(image[..., 0], cmap="gray")


def examples_per_class(
    images: np.ndarray, labels: np.ndarray, class_names: Sequence[str], title: str
) -> Figure:
    """Section 3: the first training example of each class, 5 a row, titled with its class."""
    rows = -(-len(class_names) // 5)
    fig = new_figure(10, 2.5 * rows)
    for label, ax in enumerate(image_grid(fig, rows, 5, hspace=0.0)):
        ax.axis("off")
        found = np.flatnonzero(labels == label)
        if label < len(class_names) and len(found):
            show_image(ax, images[found[0]])
        if label < len(class_names):
            ax.set_title(class_names[label], fontsize=10)
    fig.suptitle(f"One {title} example per class")
    return fig


def training_curve(
    steps: Sequence[int],
    losses: Sequence[float],
    accuracies: Sequence[float],
    title: str,
    test: tuple[Sequence[int], Sequence[float], Sequence[float]] = ((), (), ()),
) -> Figure:
    """Section 9: train loss and accuracy at the logged steps (row means), and the test set's
    (`test`: steps, losses, accuracies of the evaluations during training) on the same axes."""
    fig = new_figure(8, 4)
    ax1 = fig.subplots()
    ax1.plot(steps, losses, marker="o", color=BLUE, label="train loss")
    if len(test[0]):
        ax1.plot(test[0], test[1], marker="D", linestyle="--", color=BLUE, label="test loss")
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss", color=BLUE)
    ax1.tick_params(axis="y", labelcolor=BLUE)
    ax1.grid(True, alpha=0.25)
    ax2 = ax1.twinx()
    ax2.plot(steps, accuracies, marker="s", color=GREEN, label="train accuracy")
    if len(test[0]):
        ax2.plot(test[0], test[2], marker="D", linestyle="--", color=GREEN, label="test accuracy")
    ax2.set_ylabel("accuracy", color=GREEN)
    ax2.tick_params(axis="y", labelcolor=GREEN)
    ax2.set_ylim(0.0, 1.0)
    handles = [h for ax in (ax1, ax2) for h in ax.get_legend_handles_labels()[0]]
    ax1.legend(handles=handles, loc="center right", fontsize=8)
    fig.suptitle(f"{title} training curve")
    fig.tight_layout()
    return fig


def members_figure(
    steps: Sequence[int],
    losses: Sequence[Sequence[float]],
    members: Sequence[dict[str, Any]],
    title: str,
) -> Figure:
    """An ensemble: every member's train loss curve (`losses[k]` at `steps`, row means), and
    each member's test accuracy against its learning rate (a sweep's result; log scale)."""
    fig = new_figure(10, 4)
    curves, sweep = fig.subplots(1, 2)
    for member, loss in zip(members, losses, strict=True):
        curves.plot(steps, loss, linewidth=1, label=f"member {member['member']}")
    curves.set(xlabel="step", ylabel="train loss", yscale="log", title="each member's loss")
    curves.legend(fontsize=7, ncol=2)
    rates = [m["learning_rate"] for m in members]
    accuracies = [m["test_accuracy"] for m in members]
    sweep.scatter(rates, accuracies, color=GREEN)
    for member, rate, accuracy in zip(members, rates, accuracies, strict=True):
        sweep.annotate(
            str(member["member"]),
            (rate, accuracy),
            fontsize=7,
            xytext=(3, 3),
            textcoords="offset points",
        )
    sweep.set(
        xlabel="learning rate",
        ylabel="test accuracy",
        xscale="log",
        title="test accuracy by learning rate",
    )
    for ax in (curves, sweep):
        ax.grid(True, alpha=0.25)
    fig.suptitle(f"{title}: {len(members)} ensemble members")
    fig.tight_layout()
    return fig


def sample_indices(num_examples: int) -> np.ndarray:
    """The codelab's 25 random test images (seed 7); all of them in a smaller test set."""
    rng = np.random.default_rng(PREDICTION_SEED)
    return rng.choice(num_examples, size=min(PREDICTION_SAMPLES, num_examples), replace=False)


def prediction_grid(
    images: np.ndarray, labels: np.ndarray, predictions: np.ndarray, class_names: Sequence[str]
) -> Figure:
    """Section 11: up to 5x5 images titled "pred / true", green when right and red when wrong."""
    fig = new_figure(10, 10.6)
    axes = image_grid(fig, 5, 5, hspace=0.15)
    for ax in axes:
        ax.axis("off")
    for ax, image, true, pred in zip(axes, images, labels, predictions, strict=False):
        show_image(ax, image)
        ax.set_title(
            f"{class_names[pred]} / {class_names[true]}",
            fontsize=9,
            color=GREEN if pred == true else RED,
        )
        ax.axis("off")
    fig.suptitle("Sample test predictions (predicted / true)")
    return fig


def row_normalise(counts: np.ndarray) -> np.ndarray:
    """counts[true, predicted] -> the fraction of each true class; an empty row stays zero."""
    totals = counts.sum(axis=1, keepdims=True)
    return np.divide(counts, totals, out=np.zeros(counts.shape), where=totals > 0)


def confusion_figure(counts: np.ndarray, class_names: Sequence[str]) -> Figure:
    """Section 12: row-normalised confusion matrix with percentages where they matter."""
    fractions = row_normalise(counts)
    fig = new_figure(8, 7)
    ax = fig.subplots()
    image = ax.imshow(fractions, cmap="Blues", vmin=0.0, vmax=1.0)
    ticks = np.arange(len(class_names))
    ax.set_xticks(ticks, class_names, rotation=45, ha="right")
    ax.set_yticks(ticks, class_names)
    ax.set_xlabel("Predicted label")
    ax.set_ylabel("True label")
    ax.set_title(f"Confusion matrix over {int(counts.sum()):,} test images")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="fraction of true class")
    for i in range(len(class_names)):
        for j in range(len(class_names)):
            value = fractions[i, j]
            if value >= CONFUSION_LABEL_AT or i == j:
                color = "white" if value > 0.45 else "black"
                ax.text(
                    j, i, f"{100 * value:.0f}%", ha="center", va="center", fontsize=8, color=color
                )
    fig.tight_layout()
    return fig


def bars(labels: Sequence[str], values: Sequence[float], title: str, unit: str) -> Figure:
    """Sections 7 and 13: horizontal bars, longest is fastest, values written at the bar ends."""
    fig = new_figure(8, 1.2 + 0.7 * len(labels))
    ax = fig.subplots()
    positions = np.arange(len(labels))[::-1]
    ax.barh(positions, values, color=GREEN)
    ax.set_yticks(positions, labels)
    ax.set_xlabel(unit)
    ax.set_xlim(0, max(values) * 1.25)
    for y, value in zip(positions, values, strict=True):
        ax.text(value, y, f" {value:,.0f}", va="center", fontsize=9)
    ax.set_title(f"{title} (higher is better)")
    fig.tight_layout()
    return fig


def save_png(fig: Figure, path: pathlib.Path) -> pathlib.Path:
    fig.savefig(path, dpi=DPI)
    return path


def _table_html(table: Table) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in table.headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in table.rows
    )
    return f"<h3>{html.escape(table.title)}</h3><table><tr>{head}</tr>{body}</table>"


STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1000px; margin: 2em auto; color: #1f2328; }
table { border-collapse: collapse; margin-bottom: 1.5em; font-size: 13px; }
th, td { border-bottom: 1px solid #d0d7de; padding: 4px 10px; text-align: left; }
td { font-variant-numeric: tabular-nums; }
img { max-width: 100%; display: block; margin: 0.5em 0 1.5em; }
pre { background: #f6f8fa; padding: 1em; overflow-x: auto; }
.note { color: #57606a; }
"""


def write_html(
    path: pathlib.Path,
    *,
    title: str,
    sections: Sequence[tuple[str, Sequence[Table | pathlib.Path | str]]],
    config: dict[str, Any],
) -> pathlib.Path:
    """One page with no network resources: tables, figures inlined as data URIs, prose, config."""
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
        f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>",
    ]
    for heading, items in sections:
        parts.append(f"<h2>{html.escape(heading)}</h2>")
        for item in items:
            if isinstance(item, Table):
                parts.append(_table_html(item))
            elif isinstance(item, pathlib.Path):
                data = base64.b64encode(item.read_bytes()).decode("ascii")
                parts.append(f"<img alt='{item.name}' src='data:image/png;base64,{data}'>")
            else:
                parts.append(f"<p class='note'>{html.escape(item)}</p>")
    parts.append("<h2>Config</h2><pre>")
    parts.append(html.escape(json.dumps(config, indent=2, sort_keys=True), quote=False))
    parts.append("</pre></body></html>\n")
    path.write_text("".join(parts))
    return path


def write_report(
    report_dir: pathlib.Path,
    *,
    title: str,
    sections: dict[str, Sequence[Item]],
    config: dict[str, Any],
) -> pathlib.Path:
    """Every figure as a PNG and report.html with every section, known ones in SECTION_ORDER."""
    report_dir.mkdir(exist_ok=True)

    def section_rank(heading: str) -> int:
        return SECTION_ORDER.index(heading) if heading in SECTION_ORDER else len(SECTION_ORDER)

    numbered = []
    for number, heading in enumerate(sorted(sections, key=section_rank), start=1):
        items = [
            save_png(item[1], report_dir / item[0]) if isinstance(item, tuple) else item
            for item in sections[heading]
        ]
        numbered.append((f"{number}. {heading}", items))
    return write_html(report_dir / "report.html", title=title, sections=numbered, config=config)
