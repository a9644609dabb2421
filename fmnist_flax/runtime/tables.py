"""The codelab's tables as plain data: built once, printed in the terminal, reused by reports."""

from __future__ import annotations

import dataclasses
import shutil
import sys
import textwrap
import time
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx

from .ensemble import MEMBER_SEPARATOR, member_values

MAX_WIDTH = 100  # a table's widest line on a wide terminal, in columns
NO_TERMINAL_WIDTH = 80  # the columns text is laid out for in a file, a pipe, an unknown terminal
MIN_WIDTH = 40  # the narrowest layout, however narrow the terminal
MIN_WRAPPED = 20  # a wrapped column keeps at least this width
# Where a word longer than its column may break, in order of preference: a path's `/`, then
# a name's punctuation.
BREAK_AFTER = ("/", "-_.,;:")


def text_width() -> int:
    """The columns the tables and --help are laid out for: the terminal's (or $COLUMNS), at
    most MAX_WIDTH; NO_TERMINAL_WIDTH where there is none."""
    columns = shutil.get_terminal_size((NO_TERMINAL_WIDTH, 24)).columns
    return max(MIN_WIDTH, min(MAX_WIDTH, columns))


def wrap(text: str, width: int) -> list[str]:
    """`text` in lines of at most `width` columns, broken between words; a word longer than
    that (a path) after the last mark of BREAK_AFTER that fits, else where it must."""
    lines = []
    for line in textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False):
        while len(line) > width:
            cuts = [max(line.rfind(mark, 1, width) for mark in marks) for marks in BREAK_AFTER]
            cut = next((cut + 1 for cut in cuts if cut > 0), width)
            lines.append(line[:cut])
            line = line[cut:]
        lines.append(line)
    return lines


@dataclasses.dataclass(frozen=True)
class Table:
    """A titled table of already formatted cells; numeric columns are right-aligned."""

    title: str
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]

    @classmethod
    def of(cls, title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
        """Every cell as printable text: names from data files are shown, never obeyed."""
        return cls(
            printable(title),
            tuple(printable(h) for h in headers),
            tuple(tuple(printable(c) for c in row) for row in rows),
        )

    def format(self, width: int | None = None) -> str:
        """The table as text at most `width` columns wide (default `text_width()`): the widest
        text columns' cells wrap onto lines of their own, between words (`wrap`), rather than
        the terminal wrapping every line mid-word; columns still too many (numbers, say one
        per class) go on in blocks below, each led by the first column."""
        width = width or text_width()
        columns = list(zip(self.headers, *self.rows, strict=True))
        widths = [max(len(c) for c in col) for col in columns]
        right = [bool(self.rows) and all(map(_numeric, col[1:])) for col in columns]
        # Only prose wraps: a column of text (not numbers, blanks among them) above its floor,
        # its header's width or MIN_WRAPPED, whichever is more; headers never wrap.
        floors = [max(MIN_WRAPPED, len(col[0])) for col in columns]
        prose = [not all(_numeric(c) or not c for c in col[1:]) for col in columns]
        while sum(widths) + 2 * (len(widths) - 1) > width:
            text = [k for k, w in enumerate(widths) if prose[k] and w > floors[k]]
            if not text:
                break
            widest = max(text, key=lambda k: widths[k])
            over = sum(widths) + 2 * (len(widths) - 1) - width
            widths[widest] = max(floors[widest], widths[widest] - over)

        def lines(cells: Sequence[str], block: list[int]) -> list[str]:
            parts = [wrap(cells[k], widths[k]) or [""] for k in block]
            return [
                "  ".join(
                    (p[i] if i < len(p) else "").rjust(widths[k])
                    if right[k]
                    else (p[i] if i < len(p) else "").ljust(widths[k])
                    for p, k in zip(parts, block, strict=True)
                ).rstrip()
                for i in range(max(map(len, parts)))
            ]

        text = wrap(self.title, width)
        for n, block in enumerate(_blocks(widths, width)):
            rule = "-" * (sum(widths[k] for k in block) + 2 * (len(block) - 1))
            body = [line for row in self.rows for line in lines(row, block)]
            text += ([""] if n else []) + [rule, *lines(self.headers, block), rule]
            text += body
        return "\n".join([*text, ""])


def _blocks(widths: list[int], width: int) -> list[list[int]]:
    """Column indices in blocks no wider than `width`, each after the first led by column 0."""
    blocks = [[0]]
    for k in range(1, len(widths)):
        block = blocks[-1]
        if len(block) > 1 and sum(widths[j] + 2 for j in block) + widths[k] > width:
            blocks.append(block := [0])
        block.append(k)
    return blocks


def printable(text: Any) -> str:
    """`text` with every character a terminal would act on (escape sequences, bell, carriage
    return, bidirectional overrides) written as its Python escape: a class name of
    "\x1b[2J" clears no screen."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def _numeric(cell: str) -> bool:
    """A number as `metric_cell` writes it: 1,234, 0.5432, 87.5%, -3, or nan, inf, nan%."""
    cell = cell.removesuffix("%").lstrip("-")
    return cell in ("nan", "inf") or cell.replace(",", "").replace(".", "").isdigit()


def device_names(devices: Any) -> str:
    """'cpu:0', 'cuda:0, cuda:1', or for more: '8 cuda devices (2 processes)'."""
    if len(devices) > 2:
        platforms = "/".join(sorted({d.platform for d in devices}))
        processes = len({d.process_index for d in devices})
        return f"{len(devices)} {platforms} devices" + (
            f" ({processes} processes)" if processes > 1 else ""
        )
    return ", ".join(sorted(f"{d.platform}:{d.id}" for d in devices))


def devices_of(tree: Any) -> str:
    """The devices a PyTree's arrays live on (see `device_names`)."""
    return device_names({d for leaf in jax.tree.leaves(tree) for d in leaf.devices()})


def layout_of(tree: Any) -> str:
    """How a PyTree's arrays are split over their devices: 'replicated', 'P(None, data)', ..."""
    specs = set()
    for leaf in jax.tree.leaves(tree):
        sharding = leaf.sharding
        if len(sharding.device_set) == 1:
            specs.add("one device")
        elif sharding.is_fully_replicated:
            specs.add("replicated")
        else:
            specs.add(str(getattr(sharding, "spec", sharding)).replace("'", ""))
    return ", ".join(sorted(specs))


def path_name(path: tuple) -> str:
    """('layers', 0, 'kernel') -> 'layers.0.kernel'."""
    return ".".join(str(p) for p in path)


def count_params(model: nnx.Module) -> int:
    """Total number of trainable scalars (235,146 for the codelab's MLP)."""
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def params_table(model: nnx.Module) -> Table:
    """Section 5: every parameter leaf, its shape, dtype and device, and the total count."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    total = count_params(model)
    rows = [
        (path_name(p), tuple(v.shape), v.dtype, devices_of(v[...]), layout_of(v[...]))
        for p, v in flat
    ]
    return Table.of(
        f"{type(model).__name__} parameters: {total:,} trainable values",
        ("Parameter", "Shape", "Dtype", "Device", "Layout"),
        rows,
    )


def setup_table(versions: dict[str, str], layout: str, compute_dtype: str) -> Table:
    """Section 1: versions, backend, devices, how the run is laid out over them and the dtype
    it computes in (the parameter table shows the parameters' own)."""
    rows = [(name, version) for name, version in versions.items()]
    kept = "" if compute_dtype == "float32" else " (parameters and optimizer state float32)"
    rows += [
        ("Default backend", jax.default_backend()),
        ("Devices", device_names(jax.devices())),
        ("Processes", f"{jax.process_count()} (this is process {jax.process_index()})"),
        ("Layout", layout),
        ("Compute dtype", f"{compute_dtype}{kept}"),
    ]
    return Table.of("Set-up", ("Item", "Value"), rows)


def splits_table(dataset: Any) -> Table:
    """Section 2: a loaded `datasets.Dataset`'s splits: counts, image shape and source, and
    whether MD5s were checked."""
    splits = (
        ("train", dataset.train_images, dataset.train_labels, dataset.sources[0]),
        ("test", dataset.test_images, dataset.test_labels, dataset.sources[1]),
    )
    rows = [
        (split, f"{len(images):,}", images.shape[1:], f"{len(labels):,}", source)
        for split, images, labels, source in splits
    ]
    checked = "MD5-checked" if dataset.checked else "not MD5-checked"
    return Table.of(
        f"{dataset.title} loaded from {dataset.origin} ({dataset.num_classes} classes, {checked})",
        ("Split", "Images", "Image shape", "Labels", "Source"),
        rows,
    )


def arrays_table(title: str, arrays: dict[str, Any]) -> Table:
    """Section 4: named device arrays with shape, dtype and device."""
    rows = [
        (name, tuple(a.shape), a.dtype, devices_of(a), layout_of(a)) for name, a in arrays.items()
    ]
    return Table.of(title, ("Array", "Shape", "Dtype", "Device", "Layout"), rows)


def metric_cell(name: str, value: float, percent_places: int = 1) -> str:
    """Accuracies as percentages, every other metric with 4 decimals."""
    return f"{100 * value:.{percent_places}f}%" if "accuracy" in name else f"{value:.4f}"


def metric_names(row: dict[str, float]) -> list[str]:
    """The metrics of a logged row: the loss first, the other training metrics by name, then
    the test set's (test_*); an ensemble's per-member columns (`name/k`) are left to
    `members_table`."""
    names = (n for n in row if n != "step" and MEMBER_SEPARATOR not in n)
    return sorted(names, key=lambda n: (n.startswith(("test_", "val_")), n != "loss", n))


def spread_cell(row: dict[str, Any], name: str) -> str:
    """A row's `name`, with the members' range after it for an ensemble. A training metric
    is the members' mean; a test metric is the ensemble's own (of the members' mean
    probabilities), which can lie outside their range, and says so."""
    cell = metric_cell(name, row[name])
    values = member_values(row, name)
    if not values:
        return cell
    spread = f"{metric_cell(name, min(values))}-{metric_cell(name, max(values))}"
    if name.startswith("test_"):
        return f"{cell} ensemble (members {spread})"
    return f"{cell} ({spread})"


def members_table(members: Sequence[dict[str, Any]], best: int) -> Table:
    """Each ensemble member's hyperparameters and results, the best (by test accuracy)
    marked."""
    names = [n for n in members[0] if n not in ("member", "seed")]
    rows = [
        (
            f"{m['member']}{' (best)' if m['member'] == best else ''}",
            m["seed"],
            *(
                metric_cell(n, m[n], 2) if n.startswith(("test_", "final_")) else f"{m[n]:g}"
                for n in names
            ),
        )
        for m in members
    ]
    headers = ("Member", "Seed", *(n.replace("_", " ").capitalize() for n in names))
    return Table.of(f"Ensemble members ({len(members)})", headers, rows)


def training_log_table(history: Sequence[dict[str, float]], examples_per_sec: float) -> Table:
    """Section 9: every metric pulled to the host at logging points, one column each (the
    test set's only at the steps it was evaluated; an ensemble's with its members' range)."""
    names = metric_names({n: 0.0 for h in history for n in h})
    rows = [(h["step"], *(spread_cell(h, n) if n in h else "" for n in names)) for h in history]
    return Table.of(
        f"Training metrics, {examples_per_sec:,.0f} examples/sec",
        ("Step", *(n.replace("_", " ").capitalize() for n in names)),
        rows,
    )


def evaluation_table(results: dict[str, dict[str, Any]]) -> Table:
    """Section 10: every metric and the example count per evaluated split (a metric a split
    lacks, such as training's gradient norm for the test set, is left blank)."""
    names = metric_names({n: 0.0 for r in results.values() for n in r if n != "examples"})
    rows = [
        (split, *(metric_cell(n, r[n], 2) if n in r else "" for n in names), f"{r['examples']:,}")
        for split, r in results.items()
    ]
    headers = ("Split", *(n.replace("_", " ").capitalize() for n in names), "Examples evaluated")
    return Table.of("Evaluation", headers, rows)


def placement_table(trees: dict[str, Any]) -> Table:
    """Section 14: where every part of the training state lives."""
    return Table.of(
        "Device placement",
        ("What", "Device", "Layout"),
        [(k, devices_of(v), layout_of(v)) for k, v in trees.items()],
    )


class ProgressBar:
    """Training progress, redrawn at logging points and, on a terminal, as steps go by (no host
    sync of its own): the step out of the total, elapsed time, examples/s and ETA, then the
    latest metrics.

    On a terminal one line is redrawn in place, fitted to the terminal's width: the bar and
    then the least telling fields are dropped rather than wrapped, and the newest test metrics
    stay shown between evaluations. In a log file each update is one whole line of its own.
    """

    WIDTH = 30
    # Kept longest when the terminal is narrow, most telling first (the rest after them).
    FIRST = ("step", "eta", "elapsed", "rate", "loss", "test_accuracy", "accuracy", "test_loss")

    def __init__(self, total: int, stream=None, examples_per_step: int = 0):
        self.total = total
        self.stream = stream or sys.stdout
        self.in_place = self.stream.isatty()
        self.examples_per_step = examples_per_step
        self.started = time.perf_counter()
        self.tested: dict[str, float] = {}  # the newest evaluation's metrics, on a terminal
        self._row: tuple[dict[str, float], float | None, float] | None = None  # newest drawn

    def tick(self, step: int) -> None:
        """On a terminal, show that training reached `step`, with the newest row's metrics and
        rate: the line moves between rows hundreds of steps apart. Where that rate is unknown
        (the first row's call compiled), the steps since that row are timed instead."""
        if not (self.in_place and self._row):
            return
        row, rate, drawn = self._row
        seconds = time.perf_counter() - drawn
        if rate is None and step > row["step"] and seconds > 0:
            rate = (step - row["step"]) * self.examples_per_step / seconds
        self._write(self._line({**row, "step": step}, rate))

    def update(self, *rows: dict[str, float], examples_per_sec: float | None = None) -> None:
        """Show `rows` (on a terminal, the last), in one write; `examples_per_sec`: the rate
        since the row before them (None: not known)."""
        if self.in_place:  # one line redrawn: the last row's, with the newest test metrics
            for row in rows:
                self.tested = {k: v for k, v in row.items() if k.startswith("test_")} or self.tested
            rows = rows[-1:]
        self._write("".join(self._line(row, examples_per_sec) for row in rows))
        self._row = (rows[-1], examples_per_sec, time.perf_counter())

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def _line(self, row: dict[str, float], examples_per_sec: float | None) -> str:
        """The progress line of `row`: in place on a terminal, else a line of its own."""
        if self.in_place:
            row = {**row, **self.tested}
        step = row["step"]
        fields = {"step": f"{step:>{len(str(self.total))}}/{self.total}"}
        fields["elapsed"] = f"elapsed {_clock(time.perf_counter() - self.started)}"
        if examples_per_sec:
            fields["rate"] = f"{_count(examples_per_sec)} ex/s"
            if self.examples_per_step and step < self.total:
                left = (self.total - step) * self.examples_per_step / examples_per_sec
                fields["eta"] = f"eta {_clock(left)}"
        fields |= {n: f"{n} {spread_cell(row, n)}" for n in metric_names(row)}
        done = int(self.WIDTH * step / self.total)
        bar = f"[{'#' * done}{'.' * (self.WIDTH - done)}]"
        if not self.in_place:
            return f"{bar} {'  '.join(fields.values())}\n"
        return f"\r{_fitted(bar, fields, self.FIRST)}\x1b[K"

    def close(self) -> None:
        if self.in_place and self._row:
            self.stream.write("\n")
            self.stream.flush()


def _fitted(bar: str, fields: dict[str, str], first: Sequence[str]) -> str:
    """`bar` and `fields` in order on one line narrower than the terminal: the bar goes first,
    then the fields least telling (those after `first`, then `first` from its end)."""
    width = shutil.get_terminal_size((80, 24)).columns - 1
    keep = [name for name in first if name in fields]
    keep += [name for name in fields if name not in keep]
    while True:
        line = "  ".join(fields[name] for name in fields if name in keep)
        if bar and len(bar) + 1 + len(line) <= width:
            return f"{bar} {line}"
        if len(line) <= width or len(keep) == 1:
            return line[:width]
        if bar:
            bar = ""
        else:
            keep.pop()


def _clock(seconds: float) -> str:
    """12:05 or 1:02:05."""
    minutes, secs = divmod(int(max(seconds, 0)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _count(value: float) -> str:
    """1.23M, 45.6k, 789."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.0f}"
