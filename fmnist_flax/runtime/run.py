"""One run as the stages of the template see it (`Run`), what an extension adds to it
(`Extension`), the thread drawing its report's figures, and `--init_from`'s value parsed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
from collections.abc import Callable
from typing import Any

import ml_collections
from flax import nnx

from . import checkpoint as checkpoint_lib
from . import ensemble, parallel, report
from .clock import StageClock
from .data_files import Dataset
from .device_batches import DeviceData
from .errors import is_digits
from .tables import Table


@dataclasses.dataclass
class Run:
    """Everything one run holds, handed from stage to stage and to the extensions."""

    config: ml_collections.ConfigDict
    workdir: pathlib.Path
    dataset: Dataset
    device_data: DeviceData
    checkpoints: checkpoint_lib.Checkpoints
    model: nnx.Module
    optimizer: nnx.Optimizer
    start_step: int
    sections: dict[str, list[report.Item]] = dataclasses.field(default_factory=dict)
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)  # extensions' entries
    history: list[dict[str, float]] = dataclasses.field(default_factory=list)
    examples_per_sec: float = float("nan")
    evaluation: tuple[int, dict[str, Any]] | None = None  # newest waited for: (step, full one)
    eval_seconds: float = 0.0  # waited for evaluations in training, outside examples_per_sec
    painter: report.Painter | None = None  # draws the figures where this process reports
    clock: StageClock = dataclasses.field(default_factory=StageClock)  # the stages' seconds

    @property
    def reporting(self) -> bool:
        """Whether this process writes report/ (`start_painter`)."""
        return self.painter is not None

    def figures_drawn(self) -> None:
        """Wait for the figures being drawn: before a timing that needs the CPU alone."""
        if self.painter:
            self.painter.wait()

    def show(self, heading: str, table: Table) -> None:
        """Print a table once (process 0) and keep it for the report's section `heading`."""
        self.sections.setdefault(heading, []).append(table)
        parallel.say(table.format())

    def figure(self, heading: str, name: str, make: Callable[[], report.Figure]) -> None:
        """Add the figure `make()` builds as `name` (a PNG) to a section, only when reporting.
        `make` runs later, on the painter's thread: give it values that stay as they are."""
        if self.painter:
            self.sections.setdefault(heading, []).append((name, self.painter.draw(make)))

    def note(self, heading: str, text: str) -> None:
        self.sections.setdefault(heading, []).append(text)


class Extension:
    """Something a run does besides training; override either hook."""

    def before_training(self, run: Run) -> None:
        """After the set-up tables, before the first step."""

    def evaluation_rows(self, run: Run, evaluation: dict[str, Any]) -> dict[str, dict]:
        """Rows to show above the test set's in the final Evaluation table, by label;
        `evaluation` is that one's, with each batch's sums (`batch_sums`)."""
        return {}

    def after_training(self, run: Run) -> None:
        """After the evaluation, before the summary and report are written."""


def start_painter(
    config: ml_collections.ConfigDict, cleanup: contextlib.ExitStack
) -> report.Painter | None:
    """The thread drawing the report's figures (closed on `cleanup`), where this process
    writes report/: process 0, unless --report=none."""
    if config.report == "none" or not parallel.is_primary():
        return None
    painter = report.Painter()
    cleanup.callback(painter.close)
    return painter


def parse_init_from(value: str) -> tuple[str, int | str | None, int | str | None]:
    """'runs/a' -> ('runs/a', None, None); 'runs/a:200' -> ('runs/a', 200, None);
    'runs/a:best'; an ensemble's member after '@': 'runs/a@3', 'runs/a:200@best'. A directory
    whose own name ends so ('runs/a:200' is one) is taken whole: the value is split only as
    far as it names no directory ('runs/a/:200' is step 200 of 'runs/a' beside it)."""
    base, at, member = value.rpartition("@")
    bases = [(value, None)]
    if at and (is_digits(member) or member in (ensemble.BEST_MEMBER, ensemble.ENSEMBLE)):
        bases.append((base, member))
    parses = []
    for whole, chosen in bases:
        parses.append((whole, None, chosen))
        workdir, _, step = whole.rpartition(":")
        if workdir and (is_digits(step) or step == checkpoint_lib.BEST):
            parses.append((workdir, int(step) if is_digits(step) else step, chosen))
    workdir, step, chosen = next(
        (parse for parse in parses if pathlib.Path(parse[0]).expanduser().is_dir()), parses[-1]
    )
    return workdir, step, ensemble.parse_member(chosen)
