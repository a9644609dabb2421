"""The status line: on a terminal, shown in place and cleared before any other output; none
elsewhere."""

from __future__ import annotations

import io
import os
import pathlib
import pty
import select
import subprocess
import sys
import time

import pytest
from conftest import REPO

from fmnist_flax.runtime import console, errors


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_status_shows_in_place_and_any_output_clears_it_first(monkeypatch):
    terminal, errors = Terminal(), Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", errors)
    console.status("loading the data")
    console.status("compiling the training step")
    print("Set-up")
    print("warning: a line", file=sys.stderr)
    shown = terminal.getvalue()
    assert shown == ("\rloading the data\x1b[K\rcompiling the training step\x1b[K\r\x1b[KSet-up\n")
    assert errors.getvalue() == "warning: a line\n"  # the status was cleared already
    console.status("x" * 500)  # fitted to the terminal's width
    assert max(len(line) for line in terminal.getvalue().split("\r")) < 200
    console.clear()


def test_a_status_that_stays_counts_its_seconds_until_the_next_output(monkeypatch):
    """The timings' eager warm-up left the screen still for 2.5-3.4 s; a status that stays
    now shows its seconds, so nothing stands still much longer than a second."""
    terminal = Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", Terminal())
    console.status("warming up")
    time.sleep(1.6)
    print("Timings")
    shown = terminal.getvalue()
    assert shown.startswith("\rwarming up\x1b[K\rwarming up [1 s]\x1b[K")
    assert shown.endswith("\r\x1b[KTimings\n")
    time.sleep(0.6)  # cleared: never drawn again
    assert terminal.getvalue() == shown


def test_a_status_through_the_output_guard_is_cleared_before_an_error_line(monkeypatch):
    """The command line guards stdout after the first status; a status drawn through the
    guard was forgotten as it was drawn, and an error line then followed it on its line."""
    terminal = Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", terminal)
    console.status("starting")
    monkeypatch.setattr(sys, "stdout", errors.GuardedOutput(sys.stdout))
    console.status("warming up")
    errors.error_line("SIGINT at step 400")
    assert terminal.getvalue().endswith("\rwarming up\x1b[K\r\x1b[Kerror: SIGINT at step 400\n")


def test_no_status_where_stdout_is_no_terminal(monkeypatch):
    written = io.StringIO()
    monkeypatch.setattr(sys, "stdout", written)
    console.status("loading the data")
    print("Set-up")
    assert written.getvalue() == "Set-up\n"


@pytest.mark.slow
def test_the_first_thing_a_terminal_shows_is_that_the_command_started(tmp_path):
    """Before JAX is imported, main.py says it started; the run's last line says where its
    time went."""
    leader, follower = pty.openpty()
    process = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "main.py"),
            "--steps=2",
            "--report=none",
            f"--workdir={tmp_path}",
        ],
        stdout=follower,
        stderr=follower,
        cwd=REPO,
        env={**os.environ, "COLUMNS": "80"},
    )
    os.close(follower)
    output = b""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if select.select([leader], [], [], 0.1)[0]:
            try:
                chunk = os.read(leader, 65536)
            except OSError:
                break
            if not chunk:
                break
            output += chunk
        elif process.poll() is not None:
            break
    process.wait()
    os.close(leader)
    text = output.decode()
    assert process.returncode == 0, text[-2000:]
    assert text.startswith("\rstarting: importing JAX, Flax, Optax and Orbax\x1b[K"), text[:200]
    assert text.rstrip().splitlines()[-1].startswith("time ")
    summary = pathlib.Path(tmp_path, "summary.json").read_text()
    assert '"stage_seconds"' in summary
