"""TensorBoard event files of a run: every logged metric, the test metrics, the learning rate,
examples/sec and the config, under <workdir>/tensorboard (process 0 writes them).

`tensorboard --logdir runs` shows every run under runs/ side by side. The events are built
with tensorboardX's protos and written here, synchronously and unbuffered, one write per
`write` call (a row's scalars in one event): a full disk or a file where the directory
should be is an OSError at once, in the thread that writes the row (the metrics writer's;
no tensorboardX writer thread to die and block it), and every event written before a kill
is in the file. Each start writes a purge marker, so TensorBoard drops the events a killed
run logged past the checkpoint this one resumes from: one event per tag and step.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import socket
import struct
import time
from typing import Any

import ml_collections
import optax
from tensorboardX import summary
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.proto.summary_pb2 import Summary
from tensorboardX.record_writer import masked_crc32c

from . import workdir as workdir_lib
from .errors import warning_line

TENSORBOARD_DIR = "tensorboard"
TEST_PREFIX = "test_"  # metrics.jsonl names the evaluation's metrics test_loss, test_accuracy
VAL_PREFIX = "val_"  # and a validation split's, which an after-evaluation hook adds, val_loss
INVALID_TAG = re.compile(r"[^-/\w\.]")  # what tensorboardX's summary.scalar turns into _


def tag(name: str) -> str:
    """The TensorBoard tag of a metrics.jsonl field: test_accuracy -> test/accuracy, val_loss
    -> val/loss, loss -> train/loss; a character a tag cannot hold becomes _, as tensorboardX's
    summary.scalar makes it."""
    split = next((p for p in (TEST_PREFIX, VAL_PREFIX) if name.startswith(p)), "")
    return INVALID_TAG.sub("_", f"{split[:-1] or 'train'}/{name.removeprefix(split)}")


def record(data: bytes) -> bytes:
    """One TFRecord: length, its masked CRC, the data, its masked CRC (what TensorBoard reads)."""
    header = struct.pack("<Q", len(data))
    crcs = struct.pack("<I", masked_crc32c(header)), struct.pack("<I", masked_crc32c(data))
    return header + crcs[0] + data + crcs[1]


class Summaries:
    """One run's event file. A write that fails (no space, no inodes, no permission, a file in
    the directory's place) is said once, in one line, and the run goes on without TensorBoard;
    metrics.jsonl holds every row anyway."""

    def __init__(
        self,
        workdir: pathlib.Path,
        config: ml_collections.ConfigDict,
        start_step: int,
        schedule: optax.ScalarOrSchedule,
    ):
        """`schedule`: the learning rate (a number or a function of the step) logged each row."""
        self.directory = workdir / TENSORBOARD_DIR
        self.schedule = schedule
        self._fd: int | None = None
        self._records: list[bytes] = []  # every event written: a removed file is written again
        name = f"events.out.tfevents.{time.time():.6f}.{socket.gethostname()}.{os.getpid()}"
        self.path = self.directory / name
        try:
            self._open()
        except OSError as exc:
            self._fail(exc)
        first = start_step + 1  # what this run logs first; TensorBoard drops older events from it
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
        self._write(
            Event(
                wall_time=time.time(), step=first, session_log=SessionLog(status=SessionLog.START)
            )
        )
        text = json.dumps(config.to_dict(), indent=2, sort_keys=True)
        self._summary(summary.text("config", f"```\n{text}\n```"), first)

    def _fail(self, exc: OSError) -> None:
        """Say once why TensorBoard stops, and stop writing it."""
        if self._fd is not None:
            os.close(self._fd)
        self._fd = None
        warning_line(
            f"cannot write TensorBoard events in {self.directory} "
            f"({workdir_lib.disk_problem(self.directory, exc)}); training goes on without them "
            f"(metrics.jsonl has every row)"
        )

    def _open(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_NOFOLLOW
        self._fd = os.open(self.path, flags, 0o666)

    def _write(self, *events: Event) -> None:
        if self._fd is None:
            return
        data = b"".join(record(event.SerializeToString()) for event in events)
        try:
            if os.fstat(self._fd).st_nlink == 0:  # removed (with tensorboard/ or the workdir)
                os.close(self._fd)
                self._fd = None
                warning_line(
                    f"{self.path} was removed while this run trained; it is written again with "
                    "every event so far"
                )
                self._open()
                os.write(self._fd, b"".join(self._records))
            os.write(self._fd, data)
            self._records.append(data)
        except OSError as exc:
            self._fail(exc)

    def _summary(self, value: Any, step: int) -> None:
        self._write(Event(wall_time=time.time(), step=step, summary=value))

    def write(self, *rows: dict[str, Any], examples_per_sec: float | None = None) -> None:
        """metrics.jsonl rows at their steps, each with the rate its step's update used: one
        event a row holding every scalar of its step, and one write for them all."""
        events = []
        for row in rows:
            step = row["step"]
            scalars = {tag(name): value for name, value in row.items() if name != "step"}
            rate = self.schedule(step - 1) if callable(self.schedule) else self.schedule
            scalars["train/learning_rate"] = rate
            if examples_per_sec is not None:
                scalars["train/examples_per_sec"] = examples_per_sec
            values = [Summary.Value(tag=t, simple_value=float(x)) for t, x in scalars.items()]
            events.append(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))
        self._write(*events)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


HPARAMS_EVENTS = "events.out.tfevents.hparams"  # one per member run, rewritten whole


def write_members(
    workdir: pathlib.Path, members: list[dict[str, Any]], step: int, prefix: str = "member_"
) -> None:
    """An ensemble's members as TensorBoard runs of their own (tensorboard/member_k): each an
    HParams session with its seed, learning rate and weight decay and its final metrics as
    `hparam/<metric>`, so the HParams dashboard compares a sweep. Each file is replaced whole
    (a resumed run writes it again); a write that fails is one warning line."""
    directory = workdir / TENSORBOARD_DIR
    for member in members:
        values = {k: v for k, v in member.items() if k not in ("member", "seed")}
        hparams = {"member": member["member"], "seed": member["seed"]}
        hparams |= {k: v for k, v in values.items() if not k.startswith(("test_", "final_"))}
        metrics = {f"hparam/{k}": v for k, v in values.items() if k not in hparams}
        events = [
            *summary.hparams(hparams, metrics),
            *(summary.scalar(k, v) for k, v in metrics.items()),
        ]
        data = record(
            Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString()
        )
        for value in events:
            data += record(
                Event(wall_time=time.time(), step=step, summary=value).SerializeToString()
            )
        path = directory / f"{prefix}{member['member']}" / HPARAMS_EVENTS
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            workdir_lib.write_atomically(path, data)
        except OSError as exc:
            warning_line(
                f"cannot write the members' TensorBoard HParams in {directory} "
                f"({workdir_lib.disk_problem(directory, exc)}); summary.json has them"
            )
            return
