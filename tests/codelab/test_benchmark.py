"""The benchmark: a tiny configuration runs every path and writes valid JSON with every field
(`assert_every_field`, on the run tests/test_gpu_script.py makes through the GPU script).

Speed itself is never asserted here (shared, noisy machines); ratios come from one run.
"""

from __future__ import annotations

import pytest
from conftest import REPO, load_config

from fmnist_flax.codelab import benchmark, profiling
from fmnist_flax.runtime import records
from fmnist_flax.runtime.errors import UserError

PATHS = {
    "codelab loop (reference)",
    "nnx.jit step",
    "fused (default)",
    "fused + saves (default)",
    "fused + saves, no floor",
    "grain pipeline",
    "grain, record files",
    "grain pipeline alone",
    "ensemble of 2, shared data",
    "ensemble of 2, own data",
    "Python dispatch",
}
SPLIT_PATHS = {"ensemble of 2, shared data, 2 devices", "ensemble of 2, own data, 2 devices"}
ROW_FIELDS = {
    "path",
    "batch_size",
    "dtype",
    "steps",
    "seconds",
    "first_call_s",
    "examples_per_sec",
    "fused_beside_per_sec",
    "ratio_to_codelab",
    "ratio_to_fused",
    "gflops",
    "share_of_matmul_peak",
    "device_peak_mb",
    "process_peak_rss_mb",
}


def test_flops_per_example_matches_the_hand_count():
    # forward 2 * 234,752; weight grads the same; activation grads of layers 2 and 3.
    assert benchmark.flops_per_example((784, 256, 128, 10)) == 1_007_104


def assert_every_field(result_json: dict, stdout: str, dtypes: list[str]) -> None:
    """A tiny benchmark's JSON, as a user's run writes it (scripts/gpu_benchmark.sh's run in
    tests/test_gpu_script.py: one batch size, `dtypes`, 2 members also split over the 2 CPU
    devices the CLI makes, 3-step whole runs): every path, every field, consistent ratios."""
    assert result_json["matmul_peak_gflops"] > 0
    assert result_json["flops_per_example"] == 1_007_104
    assert set(result_json["versions"]) == {"jax", "flax", "optax"}
    rows = result_json["results"]
    assert len(rows) == (len(PATHS) + len(SPLIT_PATHS)) * len(dtypes)
    assert {r["path"] for r in rows} == PATHS | SPLIT_PATHS
    for row in rows:
        assert set(row) == ROW_FIELDS
        assert row["examples_per_sec"] > 0 and row["seconds"] > 0
    for dtype in dtypes:
        of_dtype = [r for r in rows if r["dtype"] == dtype]
        rate = {r["path"]: r["examples_per_sec"] for r in of_dtype}
        for row in of_dtype:
            if row["path"] == "codelab loop (reference)":
                assert row["ratio_to_codelab"] == 1.0
            if row["path"].startswith("ensemble"):  # member-examples/s against one fused member
                beside = row["fused_beside_per_sec"]  # timed alternating with the ensemble
                assert beside > 0  # one repeat: the median of the pairs' ratios is its ratio
                assert row["ratio_to_fused"] == pytest.approx(row["examples_per_sec"] / beside)
                members_steps_batch = 2 * row["steps"] * row["batch_size"]
                assert row["examples_per_sec"] == members_steps_batch / row["seconds"]
            else:
                assert row["fused_beside_per_sec"] is None
                if row["ratio_to_fused"] is not None:
                    fused = rate["fused (default)"]
                    assert row["ratio_to_fused"] == row["examples_per_sec"] / fused
    # The profile maps the trace's events to the compiled module's ops: each kind shows up.
    profiles = result_json["profiles"]
    assert [p["dtype"] for p in profiles] == dtypes
    for profile in profiles:
        assert set(profile["op_us_per_step"]) == set(profiling.OP_KINDS)
        assert all(us > 0 for us in profile["op_us_per_step"].values())
        assert profile["wall_us_per_step"] > 0
    whole = result_json["whole_run"]
    assert set(whole) == {"steps", "runs", "wall_ratio_cold", "wall_ratio_warm", "fused_reference"}
    assert len(whole["runs"]) == 3 and whole["fused_reference"] > 0
    for name, run in whole["runs"].items():
        assert run["wall_seconds"] > 0 and run["peak_rss_mb"] > 100
        if name.startswith("main.py"):  # its own rate against the fused path's, same minutes
            assert run["vs_fused"] == run["train_examples_per_sec"] / whole["fused_reference"]
    # The loop main.py runs, alternated with the fused path in the benchmark's process, and
    # what a logged row costs the loop: handed to the log's thread, or written in the loop.
    loop, logging = result_json["loop"], result_json["logging"]
    assert loop["loop_examples_per_sec"] > 0 and loop["fused_examples_per_sec"] > 0
    assert loop["ratio"] == pytest.approx(
        loop["loop_examples_per_sec"] / loop["fused_examples_per_sec"]
    )
    assert logging["handed_over_us"] > 0 and logging["in_loop_us"] > 0
    assert logging["ratio"] == pytest.approx(logging["handed_over_us"] / logging["in_loop_us"])
    assert "training loop as main.py runs it" in stdout
    assert "Training step throughput" in stdout and "main.py / plain JAX wall time" in stdout
    assert "Where the fused step's time goes" in stdout


def test_without_the_devices_the_split_rows_are_left_out(capsys):
    """In a process that has started JAX on one device, the CLI cannot make more: the rows with
    the members split over 2 devices are left out, with a line that says why; asked for no
    split (1) or no ensembles (members < 2), there are none either."""
    assert benchmark.member_mesh(2, 2) is None
    assert "(no rows with 2 members over 2 devices: 1 device(s) here)" in capsys.readouterr().out
    assert benchmark.member_mesh(2, 1) is None and benchmark.member_mesh(1, 2) is None
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtypes": ["float16"]}, "'float16' is not one of"),
        ({"batch_sizes": [0]}, "must be >= 1"),
        ({"member_shards": 0}, "--bench_member_shards must be >= 1"),
        ({"members": 3, "member_shards": 2}, "=2 does not divide --bench_members=3"),
        ({"output": "/nonexistent/dir/b.json"}, "its directory does not exist"),
    ],
)
def test_bad_benchmark_options_are_one_line(kwargs, message):
    """Each mistake is refused before anything is measured."""
    options = {
        "batch_sizes": [16],
        "dtypes": ["float32"],
        "steps": 1,
        "repeats": 1,
        "whole_run_steps": 0,
        "output": None,
        **kwargs,
    }
    with pytest.raises(UserError, match=message):
        benchmark.run_benchmark(load_config("default"), **options)


def run_tiny(config) -> None:
    """One step of one batch size and dtype, no whole runs: what the refusals need."""
    benchmark.run_benchmark(
        config,
        batch_sizes=[16],
        dtypes=["float32"],
        steps=1,
        repeats=1,
        whole_run_steps=0,
        output=None,
    )


def test_benchmark_refuses_a_non_mlp_config():

    with pytest.raises(UserError, match="compares against the codelab's two-hidden-layer MLP"):
        run_tiny(load_config("cnn"))


def test_benchmark_refuses_an_ensemble_config():
    config = load_config("default")
    config.ensemble.size = 2
    with pytest.raises(UserError, match=r"builds its own ensembles \(--bench_members\); drop"):
        run_tiny(config)


def test_the_benchmark_times_the_reader_alone_by_thread_count(fmnist_records):
    """`--mode=benchmark`'s reader rows: one a thread count, rates against one thread's, and
    the SHA-256 and bare-gather controls' ratios beside them."""
    source = records.load_dataset(fmnist_records).train_images.source
    rows = benchmark.record_reads(source, block=256, repeats=2)
    assert [r["threads"] for r in rows] == [1, 2] and rows[0]["ratio_to_one"] == 1.0
    assert rows[0]["control_ratio"] == 1.0 and rows[1]["control_ratio"] > 0
    assert rows[0]["gather_ratio"] == 1.0 and rows[1]["gather_ratio"] > 0
    assert all(r["range"][0] <= r["records_per_sec"] <= r["range"][1] for r in rows)
    assert "Record reader alone" in benchmark.record_reads_table(rows)


@pytest.mark.slow
def test_the_loop_against_the_fused_path_script_prints_its_ratio():
    """scripts/loop_vs_fused.py as docs/performance.md runs it, shortened: one JSON object
    whose ratio is its two rates' (both trained the real data here)."""
    import json
    import os
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "scripts/loop_vs_fused.py", "--steps=30", "--repeats=1"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    measured = json.loads(result.stdout)
    assert measured["steps"] == 30 and measured["device"] == "cpu:0"
    assert measured["loop_examples_per_sec"] > 0 and measured["fused_examples_per_sec"] > 0
    ratio = measured["loop_examples_per_sec"] / measured["fused_examples_per_sec"]
    assert measured["ratio"] == pytest.approx(ratio)
