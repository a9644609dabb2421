"""Where a run's outputs go: the work directory, its JSON files and what they record."""

from __future__ import annotations

import json
import os
import pathlib
import resource
import tempfile
import time
from typing import Any

import flax
import jax
import optax

from fmnist_flax.errors import UserError

RUNS_DIR = pathlib.Path("runs")
SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"


def prepare_workdir(workdir: str | os.PathLike | None) -> pathlib.Path:
    """Create the run's directory; without one, a fresh `runs/<date>-<time>` is made.

    A directory with checkpoints is resumed; one that holds a finished run without checkpoints
    is refused so its outputs are not overwritten.
    """
    if workdir:
        path = pathlib.Path(workdir).expanduser()
    else:
        path = RUNS_DIR / time.strftime("%Y%m%d-%H%M%S")
        suffix = 1
        while path.exists():
            path = path.with_name(f"{path.name.split('.')[0]}.{suffix}")
            suffix += 1
    if (path / SUMMARY_FILE).exists() and not (path / "checkpoints").is_dir():
        raise UserError(
            f"--workdir {path} already holds a finished run ({SUMMARY_FILE}) and no checkpoints; "
            "pass a new --workdir or move that one away"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
        # A unique name: the processes of a multi-process run all probe the same directory.
        tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-").close()
    except OSError as exc:
        raise UserError(
            f"--workdir {path} is not writable ({exc.strerror}); pick a directory you can write to"
        ) from None
    return path


def check_output_path(output: str | None) -> None:
    """Refuse an --output whose directory does not exist, before any work is done."""
    if output and not pathlib.Path(output).expanduser().absolute().parent.is_dir():
        raise UserError(f"--output {output}: its directory does not exist")


def write_json(path: pathlib.Path, value: dict[str, Any]) -> None:
    """Write atomically: a crash leaves the old file or the new one, never half of one."""
    partial = path.with_suffix(path.suffix + ".tmp")
    partial.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
    partial.replace(path)


def read_json(path: pathlib.Path) -> dict[str, Any]:
    """A JSON file written by `write_json`, or {} when there is none."""
    return json.loads(path.read_text()) if path.exists() else {}


def read_jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsLog:
    """metrics.jsonl: one JSON object per logged step, flushed as it is written.

    A resumed run keeps the rows up to the step it resumes from and drops later ones (logged
    by a run that died before its next checkpoint), so each step appears once.
    """

    def __init__(self, path: pathlib.Path, keep_until: int = 0):
        kept = []
        if keep_until and path.exists():
            kept = [row for row in read_jsonl(path) if row["step"] <= keep_until]
        self._file = path.open("w")
        for row in kept:
            self.write(row)

    def write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def versions() -> dict[str, str]:
    """The library versions a summary records."""
    return {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__}


def peak_rss_mb() -> float:
    """This process's peak resident memory. Linux's VmHWM starts afresh at exec, unlike
    ru_maxrss, which a child inherits from the process that started it."""
    try:
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
