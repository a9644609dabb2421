"""`--mode=benchmark`: every training path timed side by side in one process (warm up, then
`block_until_ready`), ratios to the codelab's pure-PyTree loop, and whole runs start to exit."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import itertools
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from fmnist_flax import config as config_lib
from fmnist_flax import datasets, input_pipeline, train
from fmnist_flax import model as model_lib
from fmnist_flax import optimizer as optimizer_lib
from fmnist_flax.codelab import profiling, reference
from fmnist_flax.runtime import (
    checkpoint,
    compile_ahead,
    device_batches,
    ensemble,
    errors,
    grain_pipeline,
    metrics_writer,
    parallel,
    records,
    stopping,
)
from fmnist_flax.runtime import workdir as workdir_lib
from fmnist_flax.runtime.errors import UserError
from fmnist_flax.runtime.schedule import Schedule
from fmnist_flax.runtime.tables import Table

COMPARISON_SEED = 10  # fresh models, never a trained one

# --- The benchmark suite: `python main.py --mode=benchmark` --------------------------------

BENCH_EXAMPLES = 2**17  # examples per timed run; steps = this / batch size
BENCH_EAGER_STEPS = 10  # Python dispatch is far slower; fewer steps tell the same story
MATMUL_SIZE = 2048
FUSED = "fused (default)"  # the path main.py trains on: the ratios' second reference
GRAIN_RECORDS = "grain, record files"
GRAIN_ALONE = "grain pipeline alone"  # reading and placing batches, no training


def flops_per_example(sizes: Sequence[int]) -> float:
    """Forward 2*sum(in*out); backward the same for weight grads plus the activation grads of
    every layer but the first: ~1.007 MFLOP for 784-256-128-10."""
    layers = list(itertools.pairwise(sizes))
    forward = 2 * sum(a * b for a, b in layers)
    return forward + forward + 2 * sum(a * b for a, b in layers[1:])


def matmul_peak_gflops(repeats: int = 10) -> float:
    """What XLA reaches on a large float32 matmul on this device (best of `repeats`): the
    roofline the MLP's GFLOP/s are compared with."""
    a = jax.random.normal(jax.random.key(0), (MATMUL_SIZE, MATMUL_SIZE), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    jax.block_until_ready(matmul(a, a))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(matmul(a, a))
        times.append(time.perf_counter() - start)
    return 2 * MATMUL_SIZE**3 / min(times) / 1e9


def fresh_state(config: ml_collections.ConfigDict, device_data: input_pipeline.DeviceData):
    """A new model and optimizer from COMPARISON_SEED for the dataset on the device."""
    return train.create_train_state(
        config,
        device_data.image_shape,
        reference.NUM_CLASSES,
        device_data.mesh,
        seed=COMPARISON_SEED,
    )


Runner = Callable[[int], Any]  # run_steps(steps) -> something to block on


def codelab_runner(config: ml_collections.ConfigDict, fixed: tuple[jax.Array, jax.Array]) -> Runner:
    """The codelab's pure-PyTree jitted Optax step over fixed host-made batches."""
    fixed_x, fixed_y = fixed
    tx = optax.adamw(config.optimizer.learning_rate, weight_decay=config.optimizer.weight_decay)
    step = reference.make_train_step(tx, model_lib.COMPUTE_DTYPES[config.compute_dtype])
    params = reference.init_mlp_params(jax.random.key(COMPARISON_SEED), *config.model.hidden)
    carry = [params, tx.init(params), 0]

    def run_steps(steps):
        params, opt_state, i = carry
        for _ in range(steps):
            j = i % fixed_x.shape[0]
            params, opt_state, metrics = step(params, opt_state, (fixed_x[j], fixed_y[j]))
            i += 1
        carry[:] = params, opt_state, i
        return params, metrics

    return run_steps


def per_step_runner(step_fn, config, device_data, fixed) -> Runner:
    """One call of `step_fn` (the nnx.jit step, or the same step dispatched op by op) a batch."""
    fixed_x, fixed_y = fixed
    model, optimizer = fresh_state(config, device_data)
    frozen = ml_collections.FrozenConfigDict(config)
    counter = [0]

    def run_steps(steps):
        for _ in range(steps):
            j = counter[0] % fixed_x.shape[0]
            metrics = step_fn(model, optimizer, fixed_x[j], fixed_y[j], frozen)
            counter[0] += 1
        return metrics, nnx.state(model)

    return run_steps


def fused_runner(
    config, device_data: input_pipeline.DeviceData, save_floor: float | None = None
) -> Runner:
    """The default path: `log_every` steps per compiled call, batches gathered on the device.

    With a `save_floor`, an Orbax checkpoint at each `checkpoint_every` step that main.py's
    policy finds due (none being written, the last at least `save_floor` seconds old; 0: every
    time); each timed run waits for its last save to be written, so the whole cost is timed.
    """
    model, optimizer = fresh_state(config, device_data)
    graphdef, state = train.split_state(model, optimizer)
    scratch = tempfile.TemporaryDirectory(prefix="bench-ckpt-") if save_floor is not None else None
    checkpoints = scratch and checkpoint.Checkpoints(
        scratch.name, metadata={"config": config.to_dict()}, min_interval_secs=save_floor
    )
    chunk, sums = chunk_for(config, device_data, graphdef, model)
    seeds = [COMPARISON_SEED + k for k in range(len(ensemble.data_seeds(config)))]
    order = device_batches.epoch_orders(seeds, 0, len(device_data.train_labels))
    per_epoch = device_data.batches_per_epoch
    schedule = Schedule(config, per_epoch)
    carry = [state, 0]

    def run_steps(steps):
        state, i = carry
        while steps:
            index = i % per_epoch
            count = min(config.log_every, steps, per_epoch - index)
            at = [parallel.device_int(n, device_data.mesh) for n in (index, count)]  # as the loop's
            state, _, metrics = chunk(
                state, sums, device_data.train_images, device_data.train_labels, order, *at
            )
            i += count
            steps -= count
            if checkpoints and i % config.checkpoint_every == 0 and checkpoints.due(i):
                progress = schedule.progress(i)  # main.py's save, checks too
                stopping.save_if_finite(checkpoints, i, model, optimizer, state, progress)
        carry[:] = state, i
        if checkpoints:
            checkpoints.wait()
        return state, metrics

    run_steps.scratch = scratch  # the checkpoints' directory lives as long as the runner
    return run_steps


def grain_runner(config, device_data: input_pipeline.DeviceData, dataset) -> Runner:
    """`input_pipeline="grain"`: the same compiled step, one call per step, each batch read on
    the host by Grain and copied to the device."""
    model, optimizer = fresh_state(config, device_data)
    graphdef, state = train.split_state(model, optimizer)
    chunk, sums = chunk_for(config, device_data, graphdef, model)
    source = grain_pipeline.train_source(dataset)
    batches = grain_pipeline.from_config(config, source, device_data.mesh)
    carry = [state, 0]

    def run_steps(steps):
        state, i = carry
        for images, labels, order, index, count, _ in batches.chunks(i, i + steps):
            state, _, metrics = chunk(state, sums, images, labels, order, index, count)
        carry[:] = state, i + steps
        return state, metrics

    return run_steps


def grain_alone_runner(config, device_data: input_pipeline.DeviceData, dataset) -> Runner:
    """The Grain pipeline with no training: blocks read, stacked and placed on the device at
    the rate it can feed them, with its default workers."""
    batches = grain_pipeline.from_config(
        config, grain_pipeline.train_source(dataset), device_data.mesh
    )
    done = [0]

    def run_steps(steps):
        placed = [(x, y) for x, y, *_ in batches.chunks(done[0], done[0] + steps)]
        done[0] += steps
        return placed[-1]

    return run_steps


# Reader threads timed side by side in `record_reads`: those of these the host has cores for.
READ_THREADS = tuple(n for n in (1, 2, 4, 8) if n <= max(os.cpu_count() or 1, 2))
CONTROL_BYTES = 4 << 20  # each of the control's SHA-256 pieces (hashlib hashes it without the GIL)
READ_BLOCKS = 8  # a timing's blocks for each of the most threads: long enough to outlast noise
GATHER_BYTES = 256 << 20  # the gather control's table at most: the set's size, up to this


def record_reads(
    source: records.RecordSource, block: int, repeats: int, threads: Sequence[int] = READ_THREADS
) -> list[dict[str, Any]]:
    """The record reader alone (`RecordSource.read` into a block's buffer, no Grain, no device)
    on `threads` threads at once, each reading random blocks of `block` records: records/s per
    thread count (median of `repeats`, the counts alternated so each repeat sees the same
    minutes of a shared machine) and its ratio to one thread's, the median of the pairs. Two
    controls beside each say what the machine had to give, by their ratio to one thread the
    same way: SHA-256 of as many pieces on the same threads (pure CPU work that scales with
    free cores: `control_ratio`), and one `np.take` of as many rows of the records' size from
    a table of the set's size, in file order (the least memory traffic a reader can make:
    `gather_ratio`)."""
    rng = np.random.default_rng(COMPARISON_SEED)
    keys = [rng.permutation(len(source))[:block] for _ in range(READ_BLOCKS * max(threads))]
    payload = rng.integers(0, 256, CONTROL_BYTES, np.uint8).tobytes()
    table = rng.integers(
        0,
        256,
        (min(len(source), GATHER_BYTES // source.record_bytes), source.record_bytes),
        np.uint8,
    )
    rows = [np.sort(k % len(table)) for k in keys]
    # Each thread's buffers, written once before any clock starts: no first touch is timed.
    outs = [np.zeros((block, source.pixels), np.uint8) for _ in range(max(threads))]
    gathered = [np.zeros((block, source.record_bytes), np.uint8) for _ in range(max(threads))]

    def read(first: int, count: int) -> None:
        for k in range(first, len(keys), count):
            source.read(keys[k], outs[first])

    def hash_pieces(first: int, count: int) -> None:
        for _ in range(first, len(keys), count):
            hashlib.sha256(payload).digest()

    def gather(first: int, count: int) -> None:
        for k in range(first, len(keys), count):
            table.take(rows[k], axis=0, out=gathered[first])

    def rate(work: Callable[[int, int], None], count: int, units: int) -> float:
        workers = [threading.Thread(target=work, args=(i, count)) for i in range(count)]
        start = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        return units / (time.perf_counter() - start)

    rate(read, 1, 1)  # maps every shard
    rates = {count: [] for count in threads}
    controls = {count: [] for count in threads}
    gathers = {count: [] for count in threads}
    for _ in range(repeats):
        for count in threads:
            rates[count].append(rate(read, count, len(keys) * block))
            controls[count].append(rate(hash_pieces, count, len(keys)))
            gathers[count].append(rate(gather, count, len(keys) * block))

    def ratio(series: dict[int, list[float]], count: int) -> float:
        pairs = zip(series[count], series[threads[0]], strict=True)
        return statistics.median([r / one for r, one in pairs])

    return [
        {
            "threads": count,
            "records_per_sec": statistics.median(rates[count]),
            "range": [min(rates[count]), max(rates[count])],
            "ratio_to_one": ratio(rates, count),
            "control_ratio": ratio(controls, count),
            "gather_ratio": ratio(gathers, count),
        }
        for count in threads
    ]


def record_reads_table(rows: Sequence[dict[str, Any]]) -> str:
    return Table.of(
        "Record reader alone, into a block's buffer (median of repeats; controls: SHA-256, "
        "a bare gather)",
        ("Threads", "Records/s", "Range", "vs 1 thread", "SHA-256 vs 1", "Gather vs 1"),
        [
            (
                r["threads"],
                f"{r['records_per_sec']:,.0f}",
                f"{r['range'][0]:,.0f}..{r['range'][1]:,.0f}",
                f"{r['ratio_to_one']:.2f}x",
                f"{r['control_ratio']:.2f}x",
                f"{r['gather_ratio']:.2f}x",
            )
            for r in rows
        ],
    ).format()


def chunk_for(config, device_data, graphdef, model) -> tuple[Callable[..., Any], train.Metrics]:
    """main.py's compiled chunk for this config and data, and its zero metric sums."""
    frozen = ml_collections.FrozenConfigDict(config)
    chunk = train.make_train_chunk(graphdef, frozen, device_data.image_shape, device_data.mesh)
    return chunk, train.zero_sums(model, frozen, device_data.image_shape, device_data.mesh)


def as_ensemble(config: ml_collections.ConfigDict, members: int, same_data: bool, shards: int = 1):
    """`config` as an ensemble of `members` on shared batches or each on its own, split over
    `shards` devices."""
    changed = ml_collections.ConfigDict(config.to_dict())
    changed.ensemble.size = members
    changed.ensemble.same_data = same_data
    changed.ensemble.shards = shards
    return changed


def member_mesh(members: int, shards: int) -> jax.sharding.Mesh | None:
    """The mesh the split ensemble rows run on: `shards` devices on a `member` axis, or None
    (no rows; a line says so when there are too few devices)."""
    if members < 2 or shards < 2:
        return None
    devices = jax.local_devices()
    if len(devices) < shards:
        print(
            f"(no rows with {members} members over {shards} devices: {len(devices)} device(s) here)"
        )
        return None
    return parallel.make_mesh(devices[:shards], member_shards=shards)


def _runners(
    config, device_data, fixed, dataset, members: int = 0, record_set=None, split_data=None
) -> dict[str, Callable[[], Runner]]:
    """Each training path's runner factory, all from the same start; the codelab's first. With
    `members`, ensembles of that many on shared batches and on their own, on one device and,
    with `split_data` (the data on a `member_mesh`), split over its devices; with a
    `record_set` (the dataset as record files), Grain training from it and its pipeline alone."""
    from_records = {
        GRAIN_RECORDS: lambda: grain_runner(config, device_data, record_set),
        GRAIN_ALONE: lambda: grain_alone_runner(config, device_data, record_set),
    }
    layouts = [("", 1, device_data)] if members > 1 else []
    if split_data is not None:
        shards = parallel.member_shards(split_data.mesh)
        layouts.append((f", {shards} devices", shards, split_data))
    ensembles = {
        f"ensemble of {members}, {data}{where}": functools.partial(
            fused_runner, as_ensemble(config, members, data == "shared data", shards), on
        )
        for where, shards, on in layouts
        for data in ("shared data", "own data")
    }
    return {
        "codelab loop (reference)": lambda: codelab_runner(config, fixed),
        "nnx.jit step": lambda: per_step_runner(train.jit_train_step, config, device_data, fixed),
        FUSED: lambda: fused_runner(config, device_data),
        "fused + saves (default)": lambda: fused_runner(
            config, device_data, config.checkpoint_min_interval_secs
        ),
        "fused + saves, no floor": lambda: fused_runner(config, device_data, 0.0),
        "grain pipeline": lambda: grain_runner(config, device_data, dataset),
        **(from_records if record_set is not None else {}),
        **ensembles,
        "Python dispatch": lambda: per_step_runner(train.train_step, config, device_data, fixed),
    }


def _time_paths(
    runners: dict[str, Callable[[], Runner]],
    config: ml_collections.ConfigDict,
    steps: int,
    repeats: int,
    members: int,
    flops: float,
    peak: float,
) -> list[dict[str, Any]]:
    """Each runner timed in turn at the config's batch and dtype: rows with its rate (every
    member's examples for an ensemble), its ratios to the first (the codelab's) and to the
    fused path, its GFLOP/s (`flops` per example) and their share of the matmul `peak`. An
    ensemble is timed alternating with a fused member that trains as many examples
    (`fused_beside_per_sec`); its ratio is the median over the pairs of their times: windows
    of one length, side by side, see the same minutes of a shared machine."""
    rows = []
    batch_size = config.batch_size
    dtype = config.compute_dtype
    fused = None
    fused_beside = None  # one fused member, built once, timed beside every ensemble
    for name, make in runners.items():
        timed = steps if name != "Python dispatch" else min(steps, BENCH_EAGER_STEPS)
        is_ensemble = name.startswith("ensemble")
        if is_ensemble and fused_beside is None:
            fused_beside = runners[FUSED]()
        width = members if is_ensemble else 1
        result = _measure(
            make(),
            timed,
            repeats,
            beside=fused_beside if is_ensemble else None,
            beside_steps=width * timed,
        )
        beside_seconds = result.pop("beside_seconds")
        pair_ratio = result.pop("pair_ratio")
        beside = None if beside_seconds is None else width * timed * batch_size / beside_seconds
        rate = width * timed * batch_size / result["seconds"]
        fused = rate if name == FUSED else fused
        rows.append(
            {
                "path": name,
                "batch_size": batch_size,
                "dtype": dtype,
                **result,
                "examples_per_sec": rate,
                "fused_beside_per_sec": beside,
                "ratio_to_codelab": rate / (rows[0]["examples_per_sec"] if rows else rate),
                "ratio_to_fused": pair_ratio or (rate / fused if fused else None),
                **_compute(rate * flops / 1e9 if name != GRAIN_ALONE else None, peak),
                **_peak_memory_mb(),
            }
        )
        print(f"  {name:<26} B={batch_size:<5} {dtype:<9} {rate:>12,.0f} examples/s", flush=True)
    return rows


def _compute(gflops: float | None, peak: float) -> dict[str, float | None]:
    """GFLOP/s and their share of the matmul peak; None for a row that trains nothing."""
    share = gflops / peak if gflops is not None else None
    return {"gflops": gflops, "share_of_matmul_peak": share}


def _measure(
    run: Runner, steps: int, repeats: int, beside: Runner | None = None, beside_steps: int = 0
) -> dict[str, Any]:
    """The median seconds of `steps` steps over `repeats`, after a compiling call; with a
    `beside` runner (already compiled, or compiled by its untimed call here), that one runs
    `beside_steps` steps after each repeat too: `beside_seconds` (median) and `pair_ratio`,
    the median over the repeats of its time over `run`'s (both None without it)."""
    start = time.perf_counter()
    jax.block_until_ready(run(1))  # compiles
    compile_seconds = time.perf_counter() - start
    runs = [(run, steps)] if beside is None else [(run, steps), (beside, beside_steps)]
    times = [[] for _ in runs]
    # Once more untimed: the codelab loop's step recompiles on its second call, when its
    # inputs are its own (committed) outputs.
    for each, _ in runs:
        jax.block_until_ready(each(1))
    for _ in range(repeats):
        for (each, count), spent in zip(runs, times, strict=True):
            start = time.perf_counter()
            jax.block_until_ready(each(count))
            spent.append(time.perf_counter() - start)
    result = {
        "steps": steps,
        "seconds": statistics.median(times[0]),
        "first_call_s": compile_seconds,
    }
    if beside is None:
        return {**result, "beside_seconds": None, "pair_ratio": None}
    pairs = [b / a for a, b in zip(*times, strict=True)]
    return {
        **result,
        "beside_seconds": statistics.median(times[1]),
        "pair_ratio": statistics.median(pairs),
    }


def _peak_memory_mb() -> dict[str, float | None]:
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return {
        "device_peak_mb": peak / 2**20 if peak else None,
        "process_peak_rss_mb": workdir_lib.peak_rss_mb(),
    }


def run_suite(
    config: ml_collections.ConfigDict,
    dataset: datasets.Dataset,
    *,
    batch_sizes: Sequence[int],
    dtypes: Sequence[str],
    steps: int | None,
    repeats: int,
    members: int = 0,
    record_set: datasets.Dataset | None = None,
    member_shards: int = 1,
) -> dict[str, Any]:
    """Every path at every batch size and dtype, in one process on one device, ratios to the
    codelab loop and to the fused path. An ensemble's rate counts every member's examples
    (members x batch x steps / time): against one fused member, the speed-up over training
    its members one after another; with `member_shards` > 1 devices, also with the members
    split over them. `record_set`: `dataset` as record files (Grain rows)."""
    mesh = parallel.mesh_for(config, jax.devices()[:1])
    split = member_mesh(members, member_shards)
    device = jax.devices()[0]
    peak = matmul_peak_gflops()
    flops = flops_per_example((reference.INPUT_DIM, *config.model.hidden, reference.NUM_CLASSES))
    rows = []
    profiles = []
    for batch_size in batch_sizes:
        device_data = device_batches.to_device(dataset, batch_size, mesh)
        split_data = None if split is None else device_batches.to_device(dataset, batch_size, split)
        x, y = input_pipeline.shuffle(dataset.train_images, dataset.train_labels, seed=0)
        flat = reference.flat_images(x)
        fixed = jax.device_put(input_pipeline.fixed_batches(flat, y, batch_size), device)
        n_steps = steps or max(8, BENCH_EXAMPLES // batch_size)
        for dtype in dtypes:
            run_config = ml_collections.ConfigDict(config.to_dict())
            run_config.batch_size = batch_size
            run_config.compute_dtype = dtype
            runners = _runners(
                run_config, device_data, fixed, dataset, members, record_set, split_data
            )
            rows += _time_paths(runners, run_config, n_steps, repeats, members, flops, peak)
            fused = next(r for r in rows[::-1] if r["path"] == FUSED)
            profiles.append(
                {
                    "batch_size": batch_size,
                    "dtype": dtype,
                    "wall_us_per_step": 1e6 * fused["seconds"] / fused["steps"],
                    "op_us_per_step": profiling.profile_fused(
                        fresh_state(run_config, device_data), device_data, run_config
                    ),
                }
            )
        del device_data, split_data, fixed
    print(benchmark_table(rows, peak))
    print(profiling.profile_table(profiles))
    return {
        "device": str(device),
        "backend": jax.default_backend(),
        "matmul_peak_gflops": peak,
        "flops_per_example": flops,
        "repeats": repeats,
        "results": rows,
        "profiles": profiles,
    }


def benchmark_table(rows: Sequence[dict[str, Any]], peak: float) -> str:
    return Table.of(
        f"Training step throughput (median of repeats; matmul peak {peak:,.0f} GFLOP/s)",
        (
            "Path",
            "Batch",
            "Dtype",
            "Examples/s",
            "vs codelab",
            "vs fused",
            "GFLOP/s",
            "% of peak",
            "First call s",
            "Peak RSS MB",
        ),
        [
            (
                r["path"],
                r["batch_size"],
                r["dtype"],
                f"{r['examples_per_sec']:,.0f}",
                f"{r['ratio_to_codelab']:.2f}x",
                f"{r['ratio_to_fused']:.2f}x" if r["ratio_to_fused"] else "",
                f"{r['gflops']:.1f}" if r["gflops"] is not None else "",
                f"{100 * r['share_of_matmul_peak']:.0f}%" if r["gflops"] is not None else "",
                f"{r['first_call_s']:.2f}",
                f"{r['process_peak_rss_mb']:,.0f}",
            )
            for r in rows
        ],
    ).format()


def whole_run(steps: int, tmp: pathlib.Path, data_dir: str = "") -> dict[str, Any]:
    """Start-to-exit wall time and peak memory of `main.py --report=basic` (with an empty
    compilation cache, then with the cache that run filled) and of the plain-JAX codelab
    script doing the same training, as subprocesses side by side.

    An untimed run goes first (one step, no compilation cache): the first process after a
    pause reads the libraries and the data from disk again, which would otherwise fall on
    whichever command is timed first."""
    main_py = pathlib.Path(__file__).resolve().parents[2] / "main.py"

    def main_command(name: str, cache: pathlib.Path | str = tmp / "cache") -> list[str]:
        return [
            sys.executable,
            str(main_py),
            f"--steps={steps}",
            "--report=basic",
            f"--workdir={tmp / name}",
            f"--compilation_cache={cache}",
            f"--data_dir={data_dir}",
        ]

    warm_up = [*main_command("files", cache=""), "--steps=1"]
    subprocess.run(warm_up, capture_output=True, check=False)
    commands = {
        "main.py --report=basic, cold cache": main_command("cold"),
        "main.py --report=basic, warm cache": main_command("warm"),
        "plain JAX (codelab)": [
            sys.executable,
            "-m",
            "fmnist_flax.codelab.reference",
            str(steps),
            data_dir,
        ],
    }
    runs = {}
    for name, command in commands.items():
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - start
        if done.returncode:
            last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            raise UserError(f"{name} failed: {last}")
        if name.startswith("main.py"):
            path = tmp / ("cold" if "cold" in name else "warm") / "summary.json"
            summary = json.loads(errors.read_file(path))
        else:
            summary = json.loads(done.stdout.strip().splitlines()[-1])
        runs[name] = {
            "wall_seconds": seconds,
            "peak_rss_mb": summary["peak_rss_mb"],
            "train_examples_per_sec": summary.get("train_examples_per_sec"),  # main.py's own
        }
    cold, warm, plain = (r["wall_seconds"] for r in runs.values())
    return {
        "steps": steps,
        "runs": runs,
        "wall_ratio_cold": cold / plain,
        "wall_ratio_warm": warm / plain,
    }


def fused_reference(
    config: ml_collections.ConfigDict, device_data: input_pipeline.DeviceData, steps: int
) -> float:
    """The fused path's examples/s at the config's batch size and dtype over `steps` steps,
    measured where it is called: next to the whole runs, so both see the same machine load."""
    result = _measure(fused_runner(config, device_data), steps, repeats=3)
    return steps * config.batch_size / result["seconds"]


def whole_loop(
    config: ml_collections.ConfigDict,
    device_data: input_pipeline.DeviceData,
    steps: int,
    repeats: int = 3,
) -> dict[str, Any]:
    """`train.train_and_evaluate` (the loop main.py runs: logging, the checkpoint policy; the
    evaluations it waits for left out of its rate, as in summary.json) and the fused path,
    alternated in this process: each one's median examples/s and the median of their ratios."""
    run_config = ml_collections.ConfigDict(config.to_dict())
    run_config.update(steps=steps, report="none")

    def loop_rate() -> float:
        quiet = contextlib.redirect_stdout(io.StringIO())  # its tables and progress bar
        with tempfile.TemporaryDirectory(prefix="bench-loop-") as tmp, quiet:
            return train.train_and_evaluate(run_config, tmp)["train_examples_per_sec"]

    # A first run, not counted, compiles the loop's programs, and the epoch order's on its
    # thread: until that is done the orders come from NumPy (seconds on a TPU, uncached).
    loop_rate()
    compile_ahead.wait_for_compilations()
    loops, fused, ratios = [], [], []
    for _ in range(repeats):
        loops.append(loop_rate())
        fused.append(fused_reference(config, device_data, steps))
        ratios.append(loops[-1] / fused[-1])
    return {
        "steps": steps,
        "loop_examples_per_sec": statistics.median(loops),
        "fused_examples_per_sec": statistics.median(fused),
        "ratio": statistics.median(ratios),
    }


def logging_cost(config: ml_collections.ConfigDict, rows: int = 200) -> dict[str, float]:
    """The loop's own seconds per logged row, the row's values fresh from the device (a step
    that does nothing else): written in the loop, as before the log had a thread, against
    handed to its thread (`MetricsWriter.submit`), alternated in one process."""
    make = jax.jit(lambda i: {"loss": i * 1.0, "accuracy": i * 0.5, "grad_norm": i * 0.25})
    jax.block_until_ready(make(0))
    per_row = {True: [], False: []}
    rate = optimizer_lib.learning_rate(config)
    for _ in range(3):
        for background in (False, True):
            with tempfile.TemporaryDirectory(prefix="bench-log-") as tmp:
                checkpoints = checkpoint.Checkpoints(tmp, max_to_keep=1)
                quiet = contextlib.redirect_stdout(io.StringIO())
                with (
                    quiet,
                    metrics_writer.MetricsWriter(
                        pathlib.Path(tmp), config, 0, 1, checkpoints, rate, background=background
                    ) as log,
                ):
                    for step in range(1, rows + 1):
                        ended = make(jax.numpy.full((1,), step))  # one row, its slot 0
                        log.submit(([step], ended, step - 1), 0.0)
                    log.flush()
                checkpoints.close()
            per_row[background].append(log.host_seconds / rows)
    in_loop, handed = (statistics.median(per_row[b]) for b in (False, True))
    return {"in_loop_us": 1e6 * in_loop, "handed_over_us": 1e6 * handed, "ratio": handed / in_loop}


def loop_table(loop: dict[str, Any], logging: dict[str, float]) -> str:
    """The whole loop against the fused path, and what a logged row costs the loop."""
    return (
        f"training loop as main.py runs it ({loop['steps']} steps, alternated with the fused "
        f"path): {loop['loop_examples_per_sec']:,.0f} examples/s, "
        f"{loop['ratio']:.2f}x the fused path's {loop['fused_examples_per_sec']:,.0f}\n"
        f"the loop's time per logged row: {logging['handed_over_us']:.0f} us handed to the "
        f"log's thread, {logging['in_loop_us']:.0f} us written in the loop "
        f"({logging['ratio']:.3f}x)"
    )


def whole_run_table(whole: dict[str, Any]) -> str:
    """The whole runs side by side, main.py's own training throughput against the fused
    step's measured just before and after them (adds `vs_fused` to `whole`'s runs)."""
    reference = whole["fused_reference"]
    rows = []
    for name, r in whole["runs"].items():
        rate = r["train_examples_per_sec"]
        if rate and reference:
            r["vs_fused"] = rate / reference
        rows.append(
            (
                name,
                f"{r['wall_seconds']:.2f}",
                f"{r['peak_rss_mb']:,.0f}",
                f"{rate:,.0f}" if rate else "",
                f"{r['vs_fused']:.2f}x" if "vs_fused" in r else "",
            )
        )
    return (
        Table.of(
            f"Whole run, start to exit, {whole['steps']} steps",
            (
                "Command",
                "Wall seconds",
                "Peak RSS MB",
                "Its training examples/s",
                "vs fused, same minutes",
            ),
            rows,
        ).format()
        + f"fused path around these runs: {reference:,.0f} examples/s; "
        f"main.py / plain JAX wall time: {whole['wall_ratio_cold']:.2f}x cold, "
        f"{whole['wall_ratio_warm']:.2f}x with a warm compilation cache"
    )


def _check_options(
    config, batch_sizes, dtypes, steps, repeats, members, member_shards, output
) -> None:
    """Every mistake in the benchmark's options as one line, before anything is measured."""
    config_lib.validate(config)
    if config.model.name != "mlp" or len(config.model.hidden) != 2:
        raise UserError(
            "--mode=benchmark compares against the codelab's two-hidden-layer MLP; "
            "use an MLP config such as configs/default.py"
        )
    for dtype in dtypes:
        if dtype not in model_lib.COMPUTE_DTYPES:
            raise UserError(f"--bench_dtypes: {dtype!r} is not one of float32, bfloat16")
    counts = [*batch_sizes, repeats, member_shards, *([] if steps is None else [steps])]
    if min(counts) < 1:
        raise UserError(
            "--bench_batch_sizes, --bench_steps, --bench_repeats and --bench_member_shards "
            "must be >= 1"
        )
    if jax.process_count() > 1:
        raise UserError("--mode=benchmark times one device; run it as a single process")
    if members > 1 and members % member_shards:
        raise UserError(
            f"--bench_member_shards={member_shards} does not divide --bench_members={members}"
        )
    workdir_lib.check_output_path(output)
    if config.ensemble.size > 1:
        raise UserError(
            "--mode=benchmark times one model and builds its own ensembles (--bench_members); "
            "drop --config.ensemble"
        )
    if config.dataset.name != "fashion_mnist":
        raise UserError(
            "--mode=benchmark times the codelab on Fashion-MNIST; drop --config.dataset"
        )


def run_benchmark(
    config: ml_collections.ConfigDict,
    *,
    batch_sizes: Sequence[int],
    dtypes: Sequence[str],
    steps: int | None,
    repeats: int,
    whole_run_steps: int,
    output: str | None,
    members: int = 8,
    member_shards: int = 1,
) -> dict[str, Any]:
    """`--mode=benchmark`: the step suite, then the whole-run comparison; prints and saves."""
    _check_options(config, batch_sizes, dtypes, steps, repeats, members, member_shards, output)
    dataset = datasets.load(config)
    with tempfile.TemporaryDirectory(prefix="bench-records-") as tmp:
        records.write_dataset(dataset, pathlib.Path(tmp) / "records")
        record_set = records.load_dataset(pathlib.Path(tmp) / "records")
        result = run_suite(
            config,
            dataset,
            batch_sizes=batch_sizes,
            dtypes=dtypes,
            steps=steps,
            repeats=repeats,
            members=members,
            member_shards=member_shards,
            record_set=record_set,
        )
        result["record_reads"] = record_reads(
            record_set.train_images.source, config.grain.block_examples, repeats
        )
        print(record_reads_table(result["record_reads"]))
    if whole_run_steps:
        mesh = parallel.mesh_for(config, jax.devices()[:1])
        device_data = device_batches.to_device(dataset, config.batch_size, mesh)
        before = fused_reference(config, device_data, whole_run_steps)
        with tempfile.TemporaryDirectory() as tmp:
            whole = whole_run(whole_run_steps, pathlib.Path(tmp), config.data_dir)
        after = fused_reference(config, device_data, whole_run_steps)
        whole["fused_reference"] = (before + after) / 2
        result["whole_run"] = whole
        print(whole_run_table(whole))
        result["loop"] = whole_loop(config, device_data, whole_run_steps, repeats)
        result["logging"] = logging_cost(config)
        print(loop_table(result["loop"], result["logging"]))
    result["versions"] = workdir_lib.versions()
    result["date"] = time.strftime("%Y-%m-%d")
    if output:
        workdir_lib.write_json(pathlib.Path(output).expanduser(), result)
        print(f"benchmark written to {output}")
    return result
