"""The command a user runs, timed as they see it: `main.py ARGS` (full report) and the same with
`--report=none`, alternated, each in an 80-column pseudo-terminal. Per run: when the first
output reached the terminal, the longest silence (no new output), the wall, and how close the
stage seconds of summary.json come to its wall_seconds.

    PYTHONPATH=. python scripts/command_timing.py --repeats=3 -- --compute_dtype=bfloat16

Prints one JSON object: each variant's medians, the median ratio of their walls and every run.
The first pair warms the compilation cache and is not counted (--warm=0 counts it).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import pty
import select
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


def timed_run(args: list[str], workdir: pathlib.Path) -> dict[str, float]:
    """One `main.py ARGS` in a pseudo-terminal 80 columns wide: its output's arrival times."""
    leader, follower = pty.openpty()
    env = {**os.environ, "COLUMNS": "80", "LINES": "40", "PYTHONUNBUFFERED": "1"}
    began = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, str(REPO / "main.py"), *args, f"--workdir={workdir}"],
        stdin=subprocess.DEVNULL,
        stdout=follower,
        stderr=follower,
        env=env,
        cwd=REPO,
    )
    os.close(follower)
    arrivals, output = [], b""
    while True:
        ready, _, _ = select.select([leader], [], [], 0.05)
        if ready:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal closed: the process is gone
                break
            if not chunk:
                break
            arrivals.append(time.perf_counter() - began)
            output += chunk
        elif process.poll() is not None:
            break
    process.wait()
    wall = time.perf_counter() - began
    os.close(leader)
    if process.returncode:
        raise SystemExit(f"main.py {' '.join(args)} exited {process.returncode}: {output[-2000:]}")
    gaps = [b - a for a, b in zip([0.0, *arrivals], [*arrivals, wall], strict=True)]
    summary = json.loads((workdir / "summary.json").read_text())
    stages = sum(summary["stage_seconds"].values())
    return {
        "wall_s": wall,
        "first_output_s": arrivals[0] if arrivals else wall,
        "longest_silence_s": max(gaps),
        "summary_wall_s": summary["wall_seconds"],
        "stages_over_wall": stages / summary["wall_seconds"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warm", type=int, default=1, help="pairs run first and not counted")
    parser.add_argument("args", nargs="*", help="main.py's flags (after --)")
    options = parser.parse_args()
    variants = {"full": options.args, "none": [*options.args, "--report=none"]}
    runs = {name: [] for name in variants}
    with tempfile.TemporaryDirectory(prefix="command-timing-") as tmp:
        for repeat in range(options.warm + options.repeats):
            for name, args in variants.items():
                result = timed_run(args, pathlib.Path(tmp) / f"{name}-{repeat}")
                if repeat >= options.warm:
                    runs[name].append(result)
    medians = {
        name: {key: statistics.median(r[key] for r in results) for key in results[0]}
        for name, results in runs.items()
    }
    ratios = [f["wall_s"] / n["wall_s"] for f, n in zip(runs["full"], runs["none"], strict=True)]
    print(
        json.dumps(
            {
                "args": options.args,
                "median": medians,
                "full_over_none_wall": statistics.median(ratios),
                "runs": runs,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
