"""scripts/gpu_benchmark.sh in its SMALL=1 mode: the GPU run's one command, checked on a CPU."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest
from conftest import REPO

DATA = pathlib.Path("/usr/share/datasets/fashion-mnist")


@pytest.mark.slow
@pytest.mark.skipif(not DATA.is_dir(), reason="needs Debian's dataset-fashion-mnist")
def test_small_mode_prints_the_table(tmp_path):
    env = {**os.environ, "SMALL": "1", "PYTHON": sys.executable, "OUT": str(tmp_path / "out"),
           "DATA_DIR": str(DATA), "SITE": str(tmp_path / "site"), "BATCH_SIZES": "64"}  # fmt: skip
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_benchmark.sh")],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    table = (tmp_path / "out" / "table.md").read_text()
    assert table in result.stdout
    assert "| run | batch | dtype | codelab loop (reference) ex/s |" in table
    assert "| ensemble of 2, shared data vs fused |" in table
    for dtype in ("float32", "bfloat16"):
        row = re.search(rf"^\| benchmark \| 64 \| {dtype} \|.*$", table, re.M)
        assert row and re.search(r"\*\*\d+\.\d\dx\*\*", row[0]), table  # fused vs codelab
        assert "not measured" not in row[0], row[0]  # kernels per step included
    assert re.search(r"^\| main.py --steps=20 --report=basic .*\*\*0\.\d{4}\*\* \|$", table, re.M)
