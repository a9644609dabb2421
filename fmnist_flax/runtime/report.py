"""The figures and one self-contained report.html: plain arrays in, files out.

A report is a dict of sections (heading -> tables, figures, notes) that the run and its
extensions fill; a `Painter` draws each figure into PNG bytes on its own thread while the run
goes on, and `write_report` orders the sections, writes each PNG and inlines it.
"""

from __future__ import annotations

import base64
import concurrent.futures
import html
import io
import json
import pathlib
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .tables import Table

if TYPE_CHECKING:  # matplotlib, a slow import, is imported by the first figure drawn
    from matplotlib.figure import Figure

# A table, (PNG file name, the PNG's bytes to come) or a note.
Item = Table | tuple[str, concurrent.futures.Future[bytes]] | str

BLUE = "#0969da"
GREEN = "#1a7f37"
RED = "#d1242f"
DPI = 100
CONFUSION_LABEL_AT = 0.08  # cells at or above this fraction (and the diagonal) show a percentage
PREDICTION_SAMPLES = 25
PREDICTION_SEED = 7
# A grid of images: room above it for the figure's title, above each image for its own, below
# it, and beside it (a fraction of the width); the gap between columns (of an image's width).
SUPTITLE_INCHES = 0.7
TITLE_INCHES = 0.3
BOTTOM_INCHES = 0.15
SIDE_MARGIN = 0.015
COLUMN_GAP = 0.08
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


def image_grid(
    fig: Figure,
    images: Sequence[np.ndarray | None],
    titles: Sequence[tuple[str, str]],
    cols: int,
    fontsize: int,
) -> Any:
    """(H, W, C) uint8 images in rows of `cols` under the figure's title, each under its (title,
    colour); `None` leaves a cell empty. One picture in one axes: an axes an image took many
    times as long. Grey images (C not 3 or 4: their first channel) are each scaled to their own
    range, as `imshow` scales one image; colour ones are shown as they are."""
    h, w, channels = next(i.shape for i in images if i is not None)
    colour = channels in (3, 4)
    rows = -(-len(titles) // cols)
    width, height = fig.get_size_inches()
    across = width * (1 - 2 * SIDE_MARGIN)
    down = height - SUPTITLE_INCHES - BOTTOM_INCHES
    gap = max(1, round(COLUMN_GAP * w))
    per_pixel = min(across / (cols * (w + gap) - gap), (down / rows - TITLE_INCHES) / h)
    band = int(np.ceil(TITLE_INCHES / per_pixel))  # the pixels above an image for its title
    size = (rows * (band + h), cols * (w + gap) - gap)
    # Empty cells stay transparent: NaN (masked) in a grey picture, alpha 0 in a colour one.
    canvas = np.zeros((*size, 4), np.uint8) if colour else np.full(size, np.nan)
    ax = fig.add_axes((SIDE_MARGIN, BOTTOM_INCHES / height, across / width, down / height))
    ax.axis("off")
    for cell, (image, (title, color)) in enumerate(zip(images, titles, strict=True)):
        top, left = (cell // cols) * (band + h) + band, (cell % cols) * (w + gap)
        if image is not None:
            tile = canvas[top : top + h, left : left + w]
            if colour:
                tile[..., :channels] = image
                tile[..., 3:] = image[..., 3:] if channels == 4 else 255
            else:
                grey = image[..., 0].astype(np.float64)
                span = grey.max() - grey.min()
                tile[...] = (grey - grey.min()) / span if span else 0.0
        x, y = left + (w - 1) / 2, top - 1
        ax.text(x, y, title, ha="center", va="bottom", fontsize=fontsize, color=color)
    if colour:
        ax.imshow(canvas)
    else:
        ax.imshow(np.ma.masked_invalid(canvas), cmap="gray", vmin=0.0, vmax=1.0)
    return ax


def examples_per_class(
    images: np.ndarray, labels: np.ndarray, class_names: Sequence[str], title: str
) -> Figure:
    """Section 3: the first training example of each class, 5 a row, titled with its class."""
    rows = -(-len(class_names) // 5)
    fig = new_figure(10, 2.5 * rows)
    firsts = [np.flatnonzero(labels == label) for label in range(len(class_names))]
    shown = [images[found[0]] if len(found) else None for found in firsts]
    image_grid(fig, shown, [(name, "black") for name in class_names], cols=5, fontsize=10)
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
    titles = [
        (f"{class_names[pred]} / {class_names[true]}", GREEN if pred == true else RED)
        for true, pred in zip(labels, predictions, strict=True)
    ]
    image_grid(fig, list(images), titles, cols=5, fontsize=9)
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


def png_bytes(fig: Figure) -> bytes:
    """The figure drawn and encoded as a PNG at `DPI`."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


class Painter:
    """Draws a run's figures into PNG bytes on one thread, in the order asked for.

    matplotlib's import and drawing hold the GIL for seconds, while XLA's compiles and the
    device's steps mostly do not: on the thread, the set-up's figures and matplotlib's import
    overlap the compiles. `make` runs later, on that thread: give it values that stay as they
    are. Every figure of a run is drawn here, so matplotlib is used by one thread at a time.
    """

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="figures")
        self._pool.submit(new_figure, 1, 1)  # imports matplotlib now, beside the set-up

    def draw(self, make: Callable[[], Figure]) -> concurrent.futures.Future[bytes]:
        """The PNG of the figure `make()` builds, drawn on the thread."""
        return self._pool.submit(lambda: png_bytes(make()))

    def wait(self) -> None:
        """Return once every figure asked for is drawn: before a timing that needs the CPU."""
        self._pool.submit(lambda: None).result()

    def close(self) -> None:
        """Stop: the figure being drawn is finished, those not started are dropped."""
        self._pool.shutdown(wait=True, cancel_futures=True)


def _write(path: pathlib.Path, data: bytes) -> pathlib.Path:
    path.write_bytes(data)
    return path


def _table_html(table: Table) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in table.headers)
    body = "".join("<tr>" + "".join(_cell_html(c) for c in row) + "</tr>" for row in table.rows)
    return f"<h3>{html.escape(table.title)}</h3><table><tr>{head}</tr>{body}</table>"


NUMBER = re.compile(r"^[-+]?[\d,]*\.?\d+(e[-+]?\d+)?%?$")  # 87.28%, 10,000, 0.3528, 1e-05


def _cell_html(cell: str) -> str:
    """A table cell; a number is right-aligned, so a column's digits line up."""
    numeric = " class='num'" if NUMBER.match(cell.strip()) else ""
    return f"<td{numeric}>{html.escape(cell)}</td>"


STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1000px; margin: 2em auto; color: #1f2328; }
table { border-collapse: collapse; margin-bottom: 1.5em; font-size: 13px; }
th, td { border-bottom: 1px solid #d0d7de; padding: 4px 10px; text-align: left; }
td { font-variant-numeric: tabular-nums; }
td.num { text-align: right; }
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
    about: dict[str, str] | None = None,
) -> pathlib.Path:
    """One page with no network resources: what run it is (`about`: workdir, date, ...),
    tables, figures inlined as data URIs, prose, config."""
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
        f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>",
    ]
    if about:
        rows = "".join(
            f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in about.items()
        )
        parts.append(f"<table class='about'>{rows}</table>")
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
    about: dict[str, str] | None = None,
) -> pathlib.Path:
    """Every figure as a PNG and report.html with every section, known ones in SECTION_ORDER,
    under `about` (what run it is); waits for the figures still being drawn."""
    report_dir.mkdir(exist_ok=True)

    def section_rank(heading: str) -> int:
        return SECTION_ORDER.index(heading) if heading in SECTION_ORDER else len(SECTION_ORDER)

    numbered = []
    for number, heading in enumerate(sorted(sections, key=section_rank), start=1):
        items = [
            _write(report_dir / item[0], item[1].result()) if isinstance(item, tuple) else item
            for item in sections[heading]
        ]
        numbered.append((f"{number}. {heading}", items))
    return write_html(
        report_dir / "report.html", title=title, sections=numbered, config=config, about=about
    )
