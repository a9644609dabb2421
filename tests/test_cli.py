"""`python main.py` as a user runs it: outputs, and one clear line for each mistake."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO


def run_main(*args, cwd=REPO):
    return subprocess.run(
        [sys.executable, str(REPO / "main.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def assert_one_line_error(result, expected):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and expected in lines[0], lines[0]


def test_main_trains_with_shorthand_flags_and_config_overrides(tmp_path):
    args = (
        "--compute_dtype=bfloat16",
        "--steps=12",
        "--log_every=5",
        "--config.model.hidden=(64,32)",
        "--report=basic",
        f"--workdir={tmp_path / 'w'}",
    )
    result = run_main(*args)
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "w" / "summary.json").read_text())
    assert summary["compute_dtype"] == "bfloat16"
    assert summary["config"]["model"]["hidden"] == [64, 32]
    assert summary["steps"] == 12
    assert "Training metrics" in result.stdout and "Device placement" in result.stdout
    steps = [json.loads(r)["step"] for r in (tmp_path / "w" / "metrics.jsonl").open()]
    assert steps == [1, 5, 10, 12]
    # The same command again: nothing to do, and the finished run is left as it was.
    before = (tmp_path / "w" / "summary.json").read_bytes()
    again = run_main(*args)
    assert again.returncode == 0 and "nothing to do" in again.stdout
    assert (tmp_path / "w" / "summary.json").read_bytes() == before


def test_without_workdir_a_fresh_run_directory_is_made_and_printed(tmp_path):
    result = run_main("--steps=2", "--report=none", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert result.stdout.count(f"workdir: runs/{run_dir.name}") == 2  # at start and at end
    assert (run_dir / "summary.json").exists()


@pytest.mark.parametrize(
    ("flag", "expected"),
    [
        ("--compute_dtype=float16x", "--compute_dtype='float16x' is not one of"),
        ("--steps=-1", "--steps=-1 must be a positive"),
        ("--batch_size=0", "--batch_size=0 must be a positive"),
        ("--batch_size=60001", "is larger than the 60,000 training examples"),
        ("--steps=many", "--steps"),
        ("--no_such_flag=1", "no_such_flag"),
        ("--report=pretty", "--report='pretty' is not one of full, basic, none"),
        ("--mode=serve", "--mode"),
        ("--data_dir=/nonexistent/fmnist", "is not a directory"),
    ],
)
def test_bad_flags_exit_non_zero_with_one_line(flag, expected, tmp_path):
    assert_one_line_error(run_main(flag, f"--workdir={tmp_path / 'w'}"), expected)
