"""The benchmark: a tiny configuration runs every path and writes valid JSON with every field.

Speed itself is never asserted here (shared, noisy machines); ratios come from one run.
"""

from __future__ import annotations

import json

import pytest
from conftest import load_config

from fmnist_flax import benchmark, profiling
from fmnist_flax.errors import UserError

PATHS = {
    "codelab loop (reference)", "nnx.jit step", "fused (default)", "fused + saves (default)",
    "fused + saves, no floor", "grain pipeline", "grain, record files", "grain pipeline alone",
    "ensemble of 2, shared data",
    "ensemble of 2, own data", "Python dispatch",
}  # fmt: skip
ROW_FIELDS = {
    "path", "batch_size", "dtype", "steps", "seconds", "first_call_s", "examples_per_sec",
    "ratio_to_codelab", "ratio_to_fused", "gflops", "share_of_matmul_peak", "device_peak_mb",
    "process_peak_rss_mb",
}  # fmt: skip


def test_flops_per_example_matches_the_hand_count():
    # forward 2 * 234,752; weight grads the same; activation grads of layers 2 and 3.
    assert benchmark.flops_per_example((784, 256, 128, 10)) == 1_007_104


@pytest.mark.slow
def test_tiny_benchmark_writes_every_field(tmp_path, capsys):
    output = tmp_path / "bench.json"
    benchmark.run_benchmark(
        load_config("default"),
        batch_sizes=[16],
        dtypes=["bfloat16"],
        steps=2,
        repeats=1,
        whole_run_steps=3,
        output=str(output),
        members=2,
    )
    result = json.loads(output.read_text())
    assert result["matmul_peak_gflops"] > 0
    assert result["flops_per_example"] == 1_007_104
    assert set(result["versions"]) == {"jax", "flax", "optax"}
    rows = result["results"]
    assert len(rows) == len(PATHS)
    assert {r["path"] for r in rows} == PATHS
    for row in rows:
        assert set(row) == ROW_FIELDS
        assert row["examples_per_sec"] > 0 and row["seconds"] > 0
    rate = {r["path"]: r["examples_per_sec"] for r in rows}
    for row in rows:
        if row["path"] == "codelab loop (reference)":
            assert row["ratio_to_codelab"] == 1.0
        if row["path"].startswith("ensemble"):  # member-examples/s against one fused member
            assert row["ratio_to_fused"] == row["examples_per_sec"] / rate["fused (default)"]
            assert row["examples_per_sec"] == 2 * 2 * 16 / row["seconds"]  # members x steps x B
    # The profile maps the trace's events to the compiled module's ops: each kind shows up.
    [profile] = result["profiles"]
    assert (profile["batch_size"], profile["dtype"]) == (16, "bfloat16")
    assert set(profile["op_us_per_step"]) == set(profiling.OP_KINDS)
    assert all(us > 0 for us in profile["op_us_per_step"].values())
    assert profile["wall_us_per_step"] > 0
    whole = result["whole_run"]
    assert set(whole) == {"steps", "runs", "wall_ratio_cold", "wall_ratio_warm", "fused_reference"}
    assert len(whole["runs"]) == 3 and whole["fused_reference"] > 0
    for name, run in whole["runs"].items():
        assert run["wall_seconds"] > 0 and run["peak_rss_mb"] > 100
        if name.startswith("main.py"):  # its own rate against the fused path's, same minutes
            assert run["vs_fused"] == run["train_examples_per_sec"] / whole["fused_reference"]
    out = capsys.readouterr().out
    assert "Training step throughput" in out and "main.py / plain JAX wall time" in out
    assert "Where the fused step's time goes" in out


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtypes": ["float16"]}, "'float16' is not one of"),
        ({"batch_sizes": [0]}, "must be >= 1"),
        ({"output": "/nonexistent/dir/b.json"}, "its directory does not exist"),
    ],
)
def test_bad_benchmark_options_are_one_line(kwargs, message):
    """Each mistake is refused before anything is measured."""
    options = {
        "batch_sizes": [16], "dtypes": ["float32"], "steps": 1, "repeats": 1,
        "whole_run_steps": 0, "output": None, **kwargs,
    }  # fmt: skip
    with pytest.raises(UserError, match=message):
        benchmark.run_benchmark(load_config("default"), **options)


def test_benchmark_refuses_a_non_mlp_config():

    with pytest.raises(UserError, match="compares against the codelab's two-hidden-layer MLP"):
        benchmark.run_benchmark(
            load_config("cnn"), batch_sizes=[16], dtypes=["float32"], steps=1, repeats=1,
            whole_run_steps=0, output=None,
        )  # fmt: skip


def test_benchmark_refuses_an_ensemble_config():
    config = load_config("default")
    config.ensemble.size = 2
    with pytest.raises(UserError, match=r"builds its own ensembles \(--bench_members\); drop"):
        benchmark.run_benchmark(
            config, batch_sizes=[16], dtypes=["float32"], steps=1, repeats=1,
            whole_run_steps=0, output=None,
        )  # fmt: skip
