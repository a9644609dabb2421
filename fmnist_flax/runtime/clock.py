"""Where a run's time goes: the main thread is in one stage at a time (the data, compiling,
training, the demonstrations, ...), from the process's start, so the stages' seconds add up to
the wall's. Work on other threads (compiling ahead, drawing figures) shows as the main
thread's wait for it.
"""

from __future__ import annotations

import time

from . import console

START_UP = "start-up"  # the command's start to the run's: imports, flags, JAX's backend
SHOWN_SHARE = 0.03  # the closing line names the stages of at least this share of the wall
# What the status line says while a stage runs (a terminal's only; the set-up tables and the
# training's progress line show themselves).
DOING = {
    START_UP: "starting JAX's backend",
    "data": "checking the config, loading the data and placing it on the devices",
    "model": "building the model and its optimizer, restoring the newest checkpoint",
    "compilation": "compiling the training step",
    "checkpoint waits": "writing the last checkpoint",
    "final evaluation": "evaluating the test set",
    "demonstrations": "running the codelab's demonstrations",
    "report": "drawing the report's figures and writing report/ (--report=none skips it)",
}


class StageClock:
    """The seconds of each stage, in the order the stages first ran: `stage(name)` ends the
    current one and starts `name`; `move` re-attributes a part of one stage to another (an
    evaluation waited for inside training)."""

    def __init__(self, since: float | None = None):
        """`since`: the time.perf_counter() reading at which the command started (the time
        until now is START_UP's); None starts the clock now."""
        now = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self.current: str | None = None if since is None else START_UP
        self._since = self._started = now if since is None else since

    def stage(self, name: str) -> None:
        """End the current stage and start `name`, saying what it does on the status line."""
        self._count()
        self.current = name
        console.status(DOING.get(name, name))

    def _count(self) -> None:
        """Add the time since the last count to the current stage."""
        now = time.perf_counter()
        if self.current is not None:
            self.seconds[self.current] = self.seconds.get(self.current, 0.0) + now - self._since
        self._since = now

    def move(self, seconds: float, source: str, target: str) -> None:
        """Count `seconds` of `source` (at most what it has) as `target`'s."""
        self._count()
        seconds = min(seconds, self.seconds.get(source, 0.0))
        if seconds > 0:
            self.seconds[source] -= seconds
            self.seconds[target] = self.seconds.get(target, 0.0) + seconds

    def wall(self) -> float:
        """Seconds since the clock's start (the process's, when given)."""
        return time.perf_counter() - self._started

    def totals(self) -> dict[str, float]:
        """Every stage's seconds until now, the current one's included."""
        self._count()
        return {name: round(seconds, 3) for name, seconds in self.seconds.items()}

    def line(self) -> str:
        """The closing line: the wall and its larger stages, e.g. `time 7.4 s: start-up 2.1,
        data 0.3, training 2.0, demonstrations 2.5`."""
        totals, wall = self.totals(), self.wall()
        shown = [f"{name} {s:.1f}" for name, s in totals.items() if s >= SHOWN_SHARE * wall]
        return f"time {wall:.1f} s: {', '.join(shown)}"
