"""`--mode=benchmark`'s own flags, defined by the command line when it starts while the codelab
exists (`cli.BENCHMARK`), and read into `benchmark.run_benchmark`'s arguments."""

from __future__ import annotations

from typing import Any

from absl import flags

from fmnist_flax.runtime.errors import UserError

flags.DEFINE_list("bench_batch_sizes", ["32", "512", "4096"], "benchmark: batch sizes.")
flags.DEFINE_list("bench_dtypes", ["float32", "bfloat16"], "benchmark: dtypes.")
flags.DEFINE_integer(
    "bench_steps", None, "benchmark: timed steps per run; default 131072 examples' worth."
)
flags.DEFINE_integer("bench_repeats", 3, "benchmark: repeats (median kept).")
flags.DEFINE_integer(
    "bench_members", 8, "benchmark: members of the ensemble rows (shared and own data); <2 skips."
)
flags.DEFINE_integer(
    "bench_member_shards",
    2,
    "benchmark: also time the ensembles split over this many devices (on a CPU, one device per "
    "core is made for it); 1 skips.",
)
flags.DEFINE_integer(
    "bench_whole_run_steps", 400, "benchmark: steps of the whole-run comparison; 0 skips it."
)


def options() -> dict[str, Any]:
    """The flags as `benchmark.run_benchmark`'s keyword arguments."""
    values = flags.FLAGS
    try:
        batch_sizes = [int(b) for b in values.bench_batch_sizes]
    except ValueError:
        raise UserError(
            f"--bench_batch_sizes={','.join(values.bench_batch_sizes)}: whole numbers"
        ) from None
    return {
        "batch_sizes": batch_sizes,
        "dtypes": values.bench_dtypes,
        "steps": values.bench_steps,
        "repeats": values.bench_repeats,
        "whole_run_steps": values.bench_whole_run_steps,
        "members": values.bench_members,
        "member_shards": values.bench_member_shards,
    }
