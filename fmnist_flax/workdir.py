"""Where a run's outputs go: the work directory and its JSON files."""

from __future__ import annotations

import json
import os
import pathlib
import time
from typing import Any

from fmnist_flax.errors import UserError

RUNS_DIR = pathlib.Path("runs")
SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"


def prepare_workdir(workdir: str | os.PathLike | None) -> pathlib.Path:
    """Create the run's directory; without one, a fresh `runs/<date>-<time>` is made.

    A directory that already holds a finished run is refused so its outputs are not overwritten.
    """
    if workdir:
        path = pathlib.Path(workdir).expanduser()
    else:
        path = RUNS_DIR / time.strftime("%Y%m%d-%H%M%S")
        suffix = 1
        while path.exists():
            path = path.with_name(f"{path.name.split('.')[0]}.{suffix}")
            suffix += 1
    if (path / SUMMARY_FILE).exists():
        raise UserError(
            f"--workdir {path} already holds a finished run ({SUMMARY_FILE}); "
            "pass a new --workdir or move that one away"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create --workdir {path}: {exc.strerror}") from None
    if not os.access(path, os.W_OK):
        raise UserError(f"--workdir {path} is not writable; pick a directory you can write to")
    return path


def write_json(path: pathlib.Path, value: dict[str, Any]) -> None:
    """Write atomically: a crash leaves the old file or the new one, never half of one."""
    partial = path.with_suffix(path.suffix + ".tmp")
    partial.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
    partial.replace(path)


class MetricsLog:
    """metrics.jsonl: one JSON object per logged step, flushed as it is written."""

    def __init__(self, path: pathlib.Path):
        self._file = path.open("w")

    def write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
