"""The metrics writer: where each logged row of training goes (metrics.jsonl, TensorBoard with
examples/sec, the progress bar), written on a thread of its own so the loop never waits for a
row's values to reach the host; a non-finite loss among them stops the run.
"""

from __future__ import annotations

import pathlib
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np
import optax

from . import checkpoint as checkpoint_lib
from . import ensemble, optimizers, parallel, summaries, tables
from . import workdir as workdir_lib
from .schedule import Schedule
from .stopping import Stop, diverged

Metrics = dict[str, jax.Array]
# The rows one compiled call ended: the steps, the rows' values (each metric's sum over its
# row's steps and the row's last `grad_norm`, slot j on their last axis), the step before the
# first row.
Parts = tuple[list[int], Metrics, int]
# The test metrics at a row's step: a dict, or a function that waits for them (an evaluation
# still running on the devices), called on the writer's thread.
Tested = dict[str, float] | Callable[[], dict[str, float]] | None


class RunningRow:
    """The metrics of the steps since the last logged row: their sums (on the device, added
    to by each chunk, which starts them again at each row it ends) and the step the row
    started after. A checkpoint keeps both, so a resumed run logs the same rows as an
    uninterrupted one."""

    def __init__(self, zeros: Metrics, start: int, saved: dict[str, Any] | None = None):
        self.start = start
        self.sums = zeros
        if saved:  # from a checkpoint's progress item: float32 sums, exact through JSON
            self.start = saved["start"]
            sums = {k: np.asarray(saved["sums"].get(k, 0.0), np.float32) for k in zeros}
            self.sums = jax.device_put(sums, {k: zero.sharding for k, zero in zeros.items()})

    def take(self, steps: list[int], rows: Metrics) -> Parts:
        """The parts of the rows logged at `steps` (their values `rows`); the next row starts
        after the last of them."""
        parts = (steps, rows, self.start)
        self.start = steps[-1]
        return parts

    def state(self) -> dict[str, Any]:
        """What a checkpoint's progress item keeps of it."""
        sums = parallel.to_host(self.sums)
        sums = {k: np.asarray(v).tolist() for k, v in sums.items()}
        return {"row": {"start": self.start, "sums": sums}}


def host_rows(steps: list[int], rows: Metrics, start: int) -> list[dict[str, float]]:
    """The rows logged at `steps`, on the host and JSON-ready: every metric's mean over the
    steps since the row before (slot j of `rows` holds row j's sums), and the row's last
    `grad_norm`."""
    values = parallel.to_host(rows)
    written = []
    for j, step in enumerate(steps):
        count, start = step - start, step
        row = {"step": step}
        for name in [*(k for k in values if k != "grad_norm"), "grad_norm"]:
            value = values[name][..., j]  # the grad_norm as it is, a sum as its mean
            mean = value if name == "grad_norm" else np.asarray(value, np.float64) / count
            row |= ensemble.columns(name, mean)
        written.append(row)
    return written


WAIT_SLICE = 0.1  # seconds between looks of a wait for the metrics writer
TICK_SECONDS = 1.0  # the progress line moves at least this often between rows, on a terminal


class MetricsWriter:
    """Where process 0 writes each logged row: metrics.jsonl, TensorBoard (with the examples/sec
    since the row before, evaluations left out) and the progress bar.

    It keeps the running row (`sums`). `write` takes the row at a step and hands it to a writer
    thread (`submit`), returning at once: the loop never waits for a row's values to reach the
    host. A row is timed when its values arrive, before it is
    written; an evaluation first waits for that (`wait_timed`), so its time is left out of the
    next row's interval and no other. `flush` waits until every row handed over is written; a
    loss that was not finite then stops the run, as `check` does without waiting. With several
    processes rows are written in the loop (fetching them may be a collective)."""

    def __init__(
        self,
        workdir: pathlib.Path,
        config: ml_collections.ConfigDict,
        start_step: int,
        per_step: int,
        checkpoints: checkpoint_lib.Checkpoints,
        learning_rate: optax.ScalarOrSchedule | None = None,
        *,
        zeros: Metrics | None = None,
        saved_row: dict[str, Any] | None = None,
        background: bool = True,
        stop: Stop | None = None,
        schedule: Schedule | None = None,
        loss_terms: tuple[str, ...] = (),
    ):
        """`per_step`: examples a step trains on; `learning_rate`: what TensorBoard plots
        (default: the config's, `optimizers.learning_rate`);
        `zeros`: a zero for each metric, where the running row's sums start (a checkpoint's
        `saved_row` restores them); `stop`: a signal ends a wait for rows to be timed;
        `schedule`: the steps whose rows `write` logs; `loss_terms`: the metrics added to the
        loss, named when the loss is not finite."""
        self.primary = parallel.is_primary()
        self.stop = stop
        self.schedule = schedule
        self.loss_terms = loss_terms
        self.row = RunningRow(zeros or {}, start_step, saved_row)
        self.checkpoints = checkpoints
        self.start_step = start_step
        self.per_step = per_step
        # Where the next row's interval starts: the step, time and evaluation seconds of the
        # last row whose values were seen arriving (`_write_batch`).
        self.last_step = start_step
        self.last_time = time.perf_counter()
        self.last_eval = 0.0
        self.last_finite = start_step  # the last step whose row had a finite loss
        # A non-finite loss, its step and the loss terms that were not finite there.
        self.failure: tuple[float, int, list[str]] | None = None
        self.error: BaseException | None = None  # what stopped the writer thread
        self.host_seconds = 0.0  # the loop's time in `submit`: what logging costs it
        self.ticked = time.perf_counter()  # when the progress line last moved without a row
        # The newest row handed over, the newest one timed, the newest one written or skipped.
        self.submitted = self.timed = self.handled = start_step
        self.timing = threading.Condition()
        if self.primary:
            path = workdir / workdir_lib.METRICS_FILE
            self.metrics = workdir_lib.MetricsLog(path, keep_until=start_step)
            self.progress = tables.ProgressBar(config.steps, examples_per_step=per_step)
            if learning_rate is None:
                learning_rate = optimizers.learning_rate(config)
            self.board = summaries.Summaries(workdir, config, start_step, learning_rate)
        self.queue: queue.Queue | None = None
        if background and jax.process_count() == 1:
            self.queue = queue.Queue()
            self.thread = threading.Thread(target=self._write_submitted, daemon=True)
            self.thread.start()

    @property
    def sums(self) -> Metrics:
        """The running row's sums: what the next compiled chunk adds its steps' metrics to."""
        return self.row.sums

    @sums.setter
    def sums(self, sums: Metrics) -> None:
        self.row.sums = sums

    def write(
        self,
        step: int,
        rows: Metrics,
        eval_seconds: float,
        tested: Tested = None,
    ) -> None:
        """Log the rows that training up to `step` ended since the last one written (the last
        call's `rows`: none, or several on an accelerator), the last with the test metrics
        evaluated at `step` (`tested`), without waiting for their values; `eval_seconds`: the
        run's time spent evaluating so far."""
        if steps := self.schedule.row_steps(self.row.start, step):
            self.submit(self.row.take(steps, rows), eval_seconds, tested)
        elif self.primary and time.perf_counter() - self.ticked > TICK_SECONDS:
            self.ticked = time.perf_counter()  # the progress line moves between rows
            if self.queue is None:
                self.progress.tick(step)
            else:
                self.queue.put(step)

    def submit(
        self,
        parts: Parts,
        eval_seconds: float,
        tested: Tested = None,
    ) -> None:
        """Log the rows of `parts` (`RunningRow.take`) without waiting for their values, the
        last with the test metrics evaluated at its step (`tested`); `eval_seconds`: the run's
        time spent evaluating so far."""
        began = time.perf_counter()
        self.submitted = parts[0][-1]
        if self.queue is None:
            self._handle([(parts, eval_seconds, tested)])
        else:
            self.queue.put((parts, eval_seconds, tested))
        self.host_seconds += time.perf_counter() - began

    def _write_submitted(self) -> None:
        """The writer thread. It fetches the oldest rows handed over together with the later
        ones already computed: one wait a fetch, and the rows are written as the calls end.
        (Fetching the whole backlog at once would wait for the newest call, leaving every row
        and evaluation to be written after training, with the loop waiting for them.)"""
        pending: list = []  # handed over, not yet written, oldest first; None: the end
        while True:
            if not pending:
                pending.append(self.queue.get())
            while not self.queue.empty():
                pending.append(self.queue.get_nowait())
            if ticks := [item for item in pending if isinstance(item, int)]:
                self.progress.tick(ticks[-1])
            pending = [item for item in pending if not isinstance(item, int)]
            if not pending:
                continue
            if pending[0] is None:
                return
            ready = 1  # the oldest, and the later ones whose rows are computed
            while (
                ready < len(pending)
                and pending[ready] is not None
                and parallel.computed(pending[ready][0][1])
            ):
                ready += 1
            batch, pending = pending[:ready], pending[ready:]
            oldest = batch[0][0][1]
            arriving = not parallel.computed(oldest)  # waited for: timed as they arrive
            try:
                # One array of the oldest call's outputs: they all come when it ends. Timed
                # before the fetch, whose every array takes the GIL again (slow beside a save).
                jax.tree.leaves(oldest)[0].block_until_ready()
                arrived = time.perf_counter()
                fetched = parallel.to_host([parts[1] for parts, *_ in batch])
            except Exception:  # each row's own fetch then reports it
                arrived, fetched = None, [parts[1] for parts, *_ in batch]
            self._handle(
                [
                    ((steps, rows, start), *rest)
                    for ((steps, _, start), *rest), rows in zip(batch, fetched, strict=True)
                ],
                arriving,
                arrived,
            )

    def _handle(
        self,
        batch: list[tuple[Parts, float, Tested]],
        arriving: bool = True,
        arrived: float | None = None,
    ) -> None:
        """Write the rows of `batch` (`submit`'s arguments, oldest first), or skip them once
        the run has failed; either way they count as timed and handled, so no wait for them
        outlasts a failure. `arriving`, `arrived`: whether their values were waited for, and
        when they came (None: when they are on the host), for `_write_batch`."""
        last = batch[-1][0][0][-1]
        try:
            if self.failure is None and self.error is None:
                self._write_batch(batch, arriving, arrived)
        except BaseException as exc:
            if self.queue is None:  # written in the loop: raised there
                raise
            self.error = exc  # raised in the loop by `check`
        finally:
            with self.timing:
                self.timed = max(self.timed, last)
                self.handled = last
                self.timing.notify_all()

    def _write_batch(
        self, batch: list[tuple[Parts, float, Tested]], arriving: bool, arrived: float | None
    ) -> None:
        """Write `batch`'s rows, each row's rate their steps over the time since the last row
        seen `arriving` (its values waited for: timed as they came), evaluations left out.
        Rows already computed when first looked at (the writer was held up: by the GIL, a
        save, an evaluation it waited for) came at some earlier time: their rate is an
        average over a longer interval, never too high, and the next interval starts where
        theirs did."""
        each = [host_rows(*parts) for parts, _, _ in batch]
        now = arrived or time.perf_counter()  # the rows' time: their values came
        with self.timing:
            self.timed = each[-1][-1]["step"]
            self.timing.notify_all()
        for rows, (_, _, tested) in zip(each, batch, strict=True):
            rows[-1] |= (tested() if callable(tested) else tested) or {}
        rows = [row for part in each for row in part]
        # Rows that reach the host together (one call's, or calls' fetched at once) share
        # their rate.
        eval_seconds = batch[-1][1]
        seconds = now - self.last_time - (eval_seconds - self.last_eval)
        rate = (rows[-1]["step"] - self.last_step) * self.per_step / seconds
        first = self.last_step == self.start_step  # its interval includes the compilation
        if arriving or first:
            self.last_step, self.last_time, self.last_eval = rows[-1]["step"], now, eval_seconds
        finite = []
        for row in rows:
            if not np.isfinite(row["loss"]):
                terms = [n for n in self.loss_terms if not np.isfinite(row.get(n, 0.0))]
                self.failure = (row["loss"], row["step"], terms)
                break
            finite.append(row)
        if finite:
            self._write_rows(finite, None if first else rate)

    def check(self) -> None:
        """Stop the run if a row written so far had a non-finite loss (or could not be
        written)."""
        if self.error is not None:
            raise self.error
        if self.failure is not None:
            loss, step, terms = self.failure
            raise diverged(
                f"the loss became {loss}", self.last_finite, step, self.checkpoints, terms
            )

    def wait_timed(self) -> None:
        """Wait until every submitted row's values have reached the writer and been timed
        (not written): an evaluation starting after that is left out of the next row's
        interval whole, never counted twice against a row timed while it ran. A signal ends
        the wait early (the loop acts on it at its next stop); a failed row stops the run."""
        self._wait(lambda: self.timed >= self.submitted, until_signal=True)
        self.check()

    def flush(self) -> None:
        """Wait until every submitted row is written (or skipped after a failure), then
        `check`."""
        self._wait(lambda: self.handled >= self.submitted, until_signal=False)
        self.check()

    def _wait(self, ready: Callable[[], bool], until_signal: bool) -> None:
        """Wait until `ready()` or the writer failed (or, `until_signal`, a stop signal came),
        looking again at least every `WAIT_SLICE` seconds."""
        with self.timing:
            while not (ready() or self.failure or self.error):
                if until_signal and self.stop is not None and self.stop.signum:
                    return
                self.timing.wait(WAIT_SLICE)

    def _write_rows(self, rows: list[dict[str, float]], rate: float | None) -> None:
        """Log finite `rows` trained at `rate` examples/s (None: unknown): one write to each
        output for them all, as each write waits for the GIL the loop dispatches with."""
        self.last_finite = rows[-1]["step"]
        if self.primary:
            self.metrics.write(*rows)
            self.board.write(*rows, examples_per_sec=rate)
            self.progress.update(*rows, examples_per_sec=rate)

    def state(self) -> dict[str, Any]:
        """What a checkpoint's progress item keeps of the running row."""
        return self.row.state()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        if self.queue is not None:  # rows already handed over are written, then it stops
            self.queue.put(None)
            self.thread.join()
        if self.primary:
            for output in (self.metrics, self.progress, self.board):
                output.close()
