"""How a run stops before its last step, always with one line and its checkpoints kept: on
SIGINT, SIGTERM, SIGHUP or SIGQUIT (`errors.STOP_SIGNALS`), or when the standard output cannot
be written, after saving the step it reached; when the loss or the parameters stop being
finite, keeping the last good checkpoint.
"""

from __future__ import annotations

import collections
import contextlib
import shlex
import signal
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from flax import nnx

from . import checkpoint as checkpoint_lib
from . import ema, errors, parallel
from .errors import UserError

# The longest a training call should run, and the most work queued ahead of the host once the
# devices' pace is known (two calls before): a signal is acted on within about a second on any
# backend, and on an accelerator, whose calls take milliseconds, the host can run far ahead.
CALL_SECONDS = 0.5
QUEUED_SECONDS = 0.75


# `Stop.signum` of a run whose standard output failed: above every signal's number, so that
# every process of a run stops with the one whose output failed.
OUTPUT_FAILED = 1 << 8


class Interrupted(UserError):
    """A signal or a failed output stopped training after a checkpoint of the current step
    was saved; `exit_code`: 128 + the signal's number, or the output's (`errors.output_status`)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class _SignalAfterTraining(KeyboardInterrupt):
    """A signal after training, raised by the handler; `Stop.after_training` says it."""

    def __init__(self, trained: tuple[int, checkpoint_lib.Checkpoints]):
        super().__init__()
        self.trained = trained


class Stop:
    """While active, `errors.STOP_SIGNALS` only set `signum`, and so does a failed write to
    the standard output (`OUTPUT_FAILED`); the loop saves and stops cleanly."""

    def __init__(self):
        self.signum = 0  # the signal this process got, or OUTPUT_FAILED (0: none)
        self.output_failure: OSError | None = None  # why this process's output failed
        self._previous = {}
        self._trained: tuple[int, checkpoint_lib.Checkpoints] | None = None  # `after_training`
        self._listening = contextlib.ExitStack()
        self._in_flight = collections.deque()  # the queued calls' outputs and last steps
        self._done: int | None = None  # the last step known done
        # The last step and time a call was seen to end, the devices busy with it till then.
        self._ended: tuple[int, float] | None = None
        self._step_seconds: float | None = None  # a step's time, once timed
        # The steps a call may run, from the devices' pace (one process; None: any): 1 until
        # the call after the compiling one is timed, as a first call of many slow steps would
        # keep a signal waiting.
        self.steps_per_call: int | None = 1 if jax.process_count() == 1 else None

    def __enter__(self) -> Stop:
        for sig in errors.STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        self._listening.enter_context(errors.output_listener(self._output_failed))
        return self

    def _handle(self, signum, frame) -> None:
        self.signum = signum
        if self._trained is not None and jax.process_count() == 1:
            self._trained, trained = None, self._trained  # one stop, however many signals
            # Raised wherever the main thread is: a KeyboardInterrupt, which no library's
            # `except Exception` takes for its own failure (JAX's compilation cache read one
            # as a damaged entry), to be said as an Interrupted by `after_training`.
            raise _SignalAfterTraining(trained)

    def _output_failed(self, cause: OSError) -> None:
        """The standard output failed (on any thread): stop as on a signal, saving first."""
        self.output_failure = cause
        self.signum = self.signum or OUTPUT_FAILED

    def cause(self, signum: int) -> tuple[str, int]:
        """What stopped the run, in words, and its exit status: a signal's name and 128 + its
        number, or what went wrong with the output."""
        if signum != OUTPUT_FAILED:
            return signal.Signals(signum).name, 128 + signum
        if self.output_failure is None:  # another process's
            return "the output of process 0 failed", 1
        failure = self.output_failure
        return errors.output_problem(failure), errors.output_status(failure)

    @property
    def requested(self) -> int:
        """The signal any process got (0: none): every process reads it at the same step, so
        all of them stop there together (saving is collective)."""
        return max(parallel.from_every_process(self.signum))

    def early_step(self, reached: int, output: Any) -> int | None:
        """After each training call in one process: wait for the oldest calls while more than
        `QUEUED_SECONDS` of work is queued (more than one call until a step is timed), and time
        them (`steps_per_call`); on a signal return the step this call ends at (`reached`),
        where the loop stops to save. Else None."""
        if jax.process_count() > 1:
            return None
        self._in_flight.append((output, reached))
        while len(self._in_flight) > 1 and self._queued_seconds(reached) > QUEUED_SECONDS:
            self._wait(*self._in_flight.popleft())
        if self._step_seconds is None and self._ended is not None:  # after the compiling one
            self._wait(output, reached, busy=True)
            self._in_flight.clear()
        return reached if self.signum else None

    def _queued_seconds(self, reached: int) -> float:
        """The devices' time for the steps queued up to `reached` (infinite until timed)."""
        if self._step_seconds is None or self._done is None:
            return float("inf")
        return (reached - self._done) * self._step_seconds

    def _wait(self, output: Any, ended: int, busy: bool | None = None) -> None:
        """Wait for a call's `output`; if the devices were `busy` with it (still running when
        looked at), time the steps since the last call seen to end so. A call found done
        ended at some unknown time before: the next timing starts from the one before it
        (too long, never too short, so the queue errs short)."""
        if busy is None:
            busy = not parallel.computed(output)
        jax.block_until_ready(output)
        now = time.perf_counter()
        if busy and self._ended is not None and ended > self._ended[0]:
            self._step_seconds = (now - self._ended[1]) / (ended - self._ended[0])
            self.steps_per_call = max(1, int(CALL_SECONDS / self._step_seconds))
        self._done = ended
        if busy or self._ended is None:
            self._ended = (ended, now)

    def before_training(self) -> None:
        """Before the loop a signal stops the run at once: nothing is trained yet, so nothing
        is lost. (A multi-process run's processes agree on when to stop only in the loop.)"""
        if self.signum and jax.process_count() == 1:
            cause, status = self.cause(self.signum)
            raise Interrupted(
                f"{cause} before training began: nothing was trained, checkpoints saved "
                "before are kept; run the same command to start again",
                status,
            )

    def interrupted(
        self, signum: int, step: int, checkpoints: checkpoint_lib.Checkpoints, unfinished: str = ""
    ) -> Interrupted:
        """The one line a signal or a failed output ends a run with, once the checkpoint of
        `step` is on disk: it names the --workdir to resume with (a run given none made
        runs/<date>-<time>, which the same command would not find again)."""
        checkpoints.wait()
        cause, status = self.cause(signum)
        return Interrupted(
            f"{cause} at step {step}: checkpoint {step} saved in {checkpoints.directory}"
            f"{unfinished}; resume by running the same command with "
            f"{workdir_flag(checkpoints)}",
            status,
        )

    @contextlib.contextmanager
    def after_training(self, step: int, checkpoints: checkpoint_lib.Checkpoints) -> Iterator[None]:
        """Within, training is done and its checkpoint of `step` on disk: a signal stops the
        run at once (not at the next look), with its line and exit code, and the same command
        finishes the outputs. A multi-process run's processes stop together, at `look()`."""
        if signum := self.requested:
            raise self._stopped_after_training(signum, step, checkpoints)
        self._trained = (step, checkpoints)
        try:
            yield
        except _SignalAfterTraining as signalled:
            raise self._stopped_after_training(self.signum, *signalled.trained) from None
        finally:
            self._trained = None

    def look(self) -> None:
        """Between the stages after training: where a multi-process run's processes stop
        together on a signal any of them got."""
        if self._trained is not None and (signum := self.requested):
            raise self._stopped_after_training(signum)

    def _stopped_after_training(
        self,
        signum: int,
        step: int | None = None,
        checkpoints: checkpoint_lib.Checkpoints | None = None,
    ) -> Interrupted:
        step, checkpoints = (step, checkpoints) if checkpoints else self._trained
        self._trained = None  # one line, however many signals come
        unfinished = "; its outputs (summary.json, the report) were not finished"
        return self.interrupted(signum, step, checkpoints, unfinished)

    def failed(
        self, failure: UserError, step: int, checkpoints: checkpoint_lib.Checkpoints
    ) -> UserError:
        """The one line a plug-in's failure at `step` ends the run with, once the checkpoint of
        that step (the steps since the save before) is on disk."""
        checkpoints.wait()
        return UserError(
            f"{failure}; checkpoint {step} saved in {checkpoints.directory}: fix it and run the "
            "same command to resume from there"
        )

    def __exit__(self, *exc) -> None:
        self._listening.close()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def workdir_flag(checkpoints: checkpoint_lib.Checkpoints) -> str:
    """`--workdir=DIR` of the run that `checkpoints` belong to, quoted for a shell."""
    return shlex.quote(f"--workdir={checkpoints.directory.parent}")


def diverged(
    what: str,
    last_finite: int,
    step: int,
    checkpoints: checkpoint_lib.Checkpoints,
    terms: Sequence[str] = (),
) -> UserError:
    """The one line a run stops with when the loss or the parameters stop being finite;
    `terms`: the loss terms that were not finite there, named with what to do."""
    checkpoints.wait()
    kept = checkpoints.steps()
    since = max(last_finite, kept[-1]) if kept else last_finite  # a saved step was finite
    named = f"term{'s' * (len(terms) > 1)} {', '.join(terms)}"
    return UserError(
        f"{what} between steps {since} and {step}{f' (its {named} too)' if terms else ''}; "
        f"training stopped, the last good checkpoint is {kept[-1] if kept else 'none'}; "
        f"{f'check the loss {named}, or ' if terms else ''}lower --learning_rate and retry"
    )


def save_if_finite(
    checkpoints: checkpoint_lib.Checkpoints,
    step: int,
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    state: Any,
    progress: dict[str, Any],
    failed: UserError | None = None,
) -> None:
    """Checkpoint the newest (donated-into) buffers `state`, unless the parameters or their
    EMA are no longer finite: then stop, the last good checkpoint (the last finite one) kept,
    after what `failed` says (a plug-in's failure, which stops the run here) where given."""
    nnx.update((model, optimizer), state)
    for what, kind in (("parameters", nnx.Param), ("parameters' EMA", ema.EMA)):
        if not parallel.all_finite(nnx.state(model, kind)):
            error = diverged(f"the {what} became non-finite", 0, step, checkpoints)
            raise UserError(f"{failed}; {error}") if failed else error
    checkpoints.save(step, model, optimizer, progress)
