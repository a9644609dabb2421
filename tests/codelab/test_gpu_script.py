"""scripts/gpu_benchmark.sh in its SMALL=1 mode: the GPU run's one command, checked on a CPU."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest
from conftest import REPO, env_without_device_count

from .test_benchmark import assert_every_field

DATA = pathlib.Path("/usr/share/datasets/fashion-mnist")


def run_script(
    tmp_path: pathlib.Path, data: pathlib.Path, timeout: int, **settings: str
) -> subprocess.CompletedProcess:
    """scripts/gpu_benchmark.sh with SMALL=1 on `data`, its outputs under tmp_path, `settings`
    added to its environment (without a CPU device count: the CLI makes what it needs)."""
    env = {
        **env_without_device_count(),
        "SMALL": "1",
        "PYTHON": sys.executable,
        "OUT": str(tmp_path / "out"),
        "DATA_DIR": str(data),
        "SITE": str(tmp_path / "site"),
        **settings,
    }
    return subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_benchmark.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.slow
@pytest.mark.skipif(not DATA.is_dir(), reason="needs Debian's dataset-fashion-mnist")
def test_small_mode_prints_the_table_and_the_benchmark_writes_every_field(tmp_path):
    """The script as a GPU host runs it, small; its benchmark as a user runs it: the CLI makes
    2 CPU devices (--bench_member_shards=2) for the rows with the members split over them,
    every other path runs on one device."""
    result = run_script(
        tmp_path,
        DATA,
        300,
        BATCH_SIZES="16",
        BENCH_STEPS="2",
        BENCH_REPEATS="1",
        WHOLE_RUN_STEPS="3",
        MEMBER_SHARDS="2",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    table = (tmp_path / "out" / "table.md").read_text()
    assert table in result.stdout
    assert "| run | batch | dtype | codelab loop (reference) ex/s |" in table
    assert "| ensemble of 2, shared data vs fused |" in table
    for dtype in ("float32", "bfloat16"):
        row = re.search(rf"^\| benchmark \| 16 \| {dtype} \|.*$", table, re.M)
        assert row and re.search(r"\*\*\d+\.\d\dx\*\*", row[0]), table  # fused vs codelab
        assert "not measured" not in row[0], row[0]  # kernels per step included
    assert re.search(r"^\| main.py --steps=20 --report=basic .*\*\*0\.\d{4}\*\* \|$", table, re.M)
    assert re.search(r"^training loop as main.py runs it: [\d,]+ ex/s, \d+\.\d\dx", table, re.M)
    threads = (
        r"\d threads [\d,]+ \(\d+\.\d\dx one, controls: SHA-256 \d+\.\d\dx, gather \d+\.\d\dx\)"
    )
    assert re.search(rf"^record reader alone, records/s: {threads}(; {threads})+$", table, re.M)
    bench = json.loads((tmp_path / "out" / "bench.json").read_text())
    stdout = (tmp_path / "out" / "bench.log").read_text()
    assert_every_field(bench, stdout, ["float32", "bfloat16"])


@pytest.mark.slow
def test_a_failing_first_run_stops_the_script_before_the_benchmark(tmp_path):
    """Files with the right names and wrong contents: the 20-step run fails, the script says so
    in its last line, exits 4 and starts nothing else (an image whose packages do not fit the
    code fails the same way, in seconds)."""
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train-images-idx3", "train-labels-idx1", "t10k-images-idx3", "t10k-labels-idx1"):
        (data / f"{name}-ubyte").write_bytes(b"not an IDX file")
    result = run_script(tmp_path, data, 120)
    assert result.returncode == 4, result.stderr[-2000:]
    assert result.stderr.rstrip().splitlines()[-1].startswith("gpu_benchmark: a 20-step run failed")
    assert not (tmp_path / "out" / "bench.log").exists()
    assert "MD5 mismatch" in (tmp_path / "out" / "smoke.log").read_text()
