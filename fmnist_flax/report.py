"""The codelab's figures and one self-contained report.html: plain arrays in, files out."""

from __future__ import annotations

import base64
import html
import json
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np
from matplotlib.figure import Figure  # the Agg canvas, no pyplot state or display needed

from fmnist_flax.data import CLASS_NAMES, NUM_CLASSES
from fmnist_flax.tables import Table

BLUE, GREEN, RED = "#0969da", "#1a7f37", "#d1242f"
DPI = 100
CONFUSION_LABEL_AT = 0.08  # cells at or above this fraction (and the diagonal) show a percentage
PREDICTION_SAMPLES = 25
PREDICTION_SEED = 7
FIGURE_NAMES = (
    "examples_per_class.png",
    "training_curve.png",
    "predictions.png",
    "confusion_matrix.png",
    "dispatch_vs_jit.png",
    "precision.png",
)


def examples_per_class(images: np.ndarray, labels: np.ndarray) -> Figure:
    """Section 3: the first training example of each class, 2x5, titled with its class."""
    fig = Figure(figsize=(10, 5))
    for label, ax in enumerate(fig.subplots(2, 5).flat):
        ax.imshow(images[np.flatnonzero(labels == label)[0]], cmap="gray")
        ax.set_title(CLASS_NAMES[label], fontsize=10)
        ax.axis("off")
    fig.suptitle("One Fashion-MNIST example per class")
    fig.tight_layout()
    return fig


def training_curve(steps: Sequence[int], losses: Sequence[float], accuracies: Sequence[float]):
    """Section 9: loss and batch accuracy at the logged steps, on twin axes."""
    fig = Figure(figsize=(8, 4))
    ax1 = fig.subplots()
    ax1.plot(steps, losses, marker="o", color=BLUE, label="loss")
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss", color=BLUE)
    ax1.tick_params(axis="y", labelcolor=BLUE)
    ax1.grid(True, alpha=0.25)
    ax2 = ax1.twinx()
    ax2.plot(steps, accuracies, marker="s", color=GREEN, label="accuracy")
    ax2.set_ylabel("batch accuracy", color=GREEN)
    ax2.tick_params(axis="y", labelcolor=GREEN)
    ax2.set_ylim(0.0, 1.0)
    fig.suptitle("Fashion-MNIST training curve")
    fig.tight_layout()
    return fig


def sample_indices(num_examples: int) -> np.ndarray:
    """The codelab's 25 random test images (seed 7)."""
    rng = np.random.default_rng(PREDICTION_SEED)
    return rng.choice(num_examples, size=PREDICTION_SAMPLES, replace=False)


def prediction_grid(images: np.ndarray, labels: np.ndarray, predictions: np.ndarray) -> Figure:
    """Section 11: 5x5 images titled "pred / true", green when right and red when wrong."""
    fig = Figure(figsize=(10, 10.6))
    grid = zip(fig.subplots(5, 5).flat, images, labels, predictions, strict=True)
    for ax, image, true, pred in grid:
        ax.imshow(image, cmap="gray")
        ax.set_title(
            f"{CLASS_NAMES[pred]} / {CLASS_NAMES[true]}",
            fontsize=9,
            color=GREEN if pred == true else RED,
        )
        ax.axis("off")
    fig.suptitle("Sample test predictions (predicted / true)")
    fig.tight_layout()
    return fig


def row_normalise(counts: np.ndarray) -> np.ndarray:
    """counts[true, predicted] -> the fraction of each true class; an empty row stays zero."""
    totals = counts.sum(axis=1, keepdims=True)
    return np.divide(counts, totals, out=np.zeros(counts.shape), where=totals > 0)


def confusion_figure(counts: np.ndarray) -> Figure:
    """Section 12: row-normalised confusion matrix with percentages where they matter."""
    fractions = row_normalise(counts)
    fig = Figure(figsize=(8, 7))
    ax = fig.subplots()
    image = ax.imshow(fractions, cmap="Blues", vmin=0.0, vmax=1.0)
    ticks = np.arange(NUM_CLASSES)
    ax.set_xticks(ticks, CLASS_NAMES, rotation=45, ha="right")
    ax.set_yticks(ticks, CLASS_NAMES)
    ax.set_xlabel("Predicted label")
    ax.set_ylabel("True label")
    ax.set_title(f"Confusion matrix over {int(counts.sum()):,} test images")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="fraction of true class")
    for i in range(NUM_CLASSES):
        for j in range(NUM_CLASSES):
            value = fractions[i, j]
            if value >= CONFUSION_LABEL_AT or i == j:
                color = "white" if value > 0.45 else "black"
                ax.text(j, i, f"{100 * value:.0f}%", ha="center", va="center", fontsize=8,
                        color=color)  # fmt: skip
    fig.tight_layout()
    return fig


def bars(labels: Sequence[str], values: Sequence[float], title: str, unit: str) -> Figure:
    """Sections 7 and 13: horizontal bars, longest is fastest, values written at the bar ends."""
    fig = Figure(figsize=(8, 1.2 + 0.7 * len(labels)))
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


DISPATCH_TITLE = "Python dispatch vs jitted step"
PRECISION_TITLE = "Mixed-precision timing after warm-up"
TOKENS_PER_EXAMPLE = 16  # a 28x28 image cut into 7x7 patches, as a vision transformer would
PROJECTION_NOTE = (
    f"Projection, not a measurement: this MLP consumes whole images, not tokens. The figure "
    f"multiplies the measured examples/sec by an assumed {TOKENS_PER_EXAMPLE} tokens per example "
    "(7x7 patches of a 28x28 image). A model that really processes tokens spends different "
    "work per token (attention grows with sequence length, embeddings and wider layers add "
    "FLOPs), so its tokens/sec must be measured on that model."
)


def tokens_table(examples_per_sec: float) -> Table:
    """Section 15: examples/sec related to tokens/sec under a stated assumption."""
    return Table.of(
        "Throughput in tokens (projection)",
        ("Measured examples/sec", "Assumed tokens/example", "Projected tokens/sec"),
        [(f"{examples_per_sec:,.0f}", TOKENS_PER_EXAMPLE,
          f"{examples_per_sec * TOKENS_PER_EXAMPLE:,.0f}")],
    )  # fmt: skip


def timing_table(title: str, key: str, rows: Sequence[dict[str, Any]]) -> Table:
    """Sections 7 and 13: steps, final loss, seconds and examples/sec per variant."""
    return Table.of(
        title,
        (key.capitalize(), "Steps", "Final loss", "Accuracy", "Seconds", "Examples/sec"),
        [
            (r[key], r["steps"], f"{r['loss']:.4f}", f"{100 * r['accuracy']:.1f}%",
             f"{r['seconds']:.3f}", f"{r['examples_per_sec']:,.0f}")
            for r in rows
        ],
    )  # fmt: skip


def write_report(
    report_dir: pathlib.Path,
    *,
    tables: dict[str, Table],
    train_images: np.ndarray,
    train_labels: np.ndarray,
    test_images: np.ndarray,
    test_labels: np.ndarray,
    test_predictions: np.ndarray,
    confusion_counts: np.ndarray,
    history: Sequence[dict[str, float]],
    examples_per_sec: float,
    dispatch: Sequence[dict[str, Any]] | None,
    precision: Sequence[dict[str, Any]] | None,
    config: dict[str, Any],
) -> pathlib.Path:
    """Every figure as a PNG and report.html with every table, in the codelab's order."""
    report_dir.mkdir(exist_ok=True)

    def png(name: str, fig: Figure) -> pathlib.Path:
        return save_png(fig, report_dir / name)

    picks = sample_indices(len(test_images))
    per_class = png("examples_per_class.png", examples_per_class(train_images, train_labels))
    sections = [
        ("1. Set-up", [tables["setup"]]),
        ("2. Data", [tables["splits"], per_class]),
        ("3. Batches", [tables["batches"]]),
        ("4. Model", [tables["params"]]),
        ("5. Gradients", [tables["gradients"]]),
    ]  # fmt: skip

    def timing_section(heading: str, rows, key: str, name: str, title: str, bars_title: str):
        rates = [r["examples_per_sec"] for r in rows]
        figure = bars([r[key] for r in rows], rates, bars_title, "examples/s")
        return heading, [timing_table(title, key, rows), png(name, figure)]

    if dispatch:
        sections.append(
            timing_section("6. Python dispatch vs jit", dispatch, "mode", "dispatch_vs_jit.png",
                           DISPATCH_TITLE, "Examples per second")
        )  # fmt: skip
    steps = [h["step"] for h in history]
    curve = training_curve(steps, [h["loss"] for h in history], [h["accuracy"] for h in history])
    sections += [
        ("7. Training", [tables["training"], png("training_curve.png", curve)]),
        ("8. Evaluation", [
            tables["evaluation"],
            png("predictions.png", prediction_grid(
                test_images[picks], test_labels[picks], test_predictions[picks])),
            png("confusion_matrix.png", confusion_figure(confusion_counts)),
        ]),
    ]  # fmt: skip
    if precision:
        sections.append(
            timing_section("9. Precision", precision, "dtype", "precision.png", PRECISION_TITLE,
                           "Mixed-precision examples/sec")
        )  # fmt: skip
    sections += [
        ("10. Device placement", [tables["placement"]]),
        ("11. Throughput in tokens", [tokens_table(examples_per_sec), PROJECTION_NOTE]),
    ]
    return write_html(
        report_dir / "report.html",
        title="fmnist-flax: Fashion-MNIST with Flax NNX",
        sections=sections,
        config=config,
    )
