"""The mesh and jax.distributed: 8 virtual CPU devices and 2 local processes, in subprocesses."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import EVERY_DUE_SAVE, REPO, MainServer, compilation_cache_dir, load_config
from flax import nnx
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from fmnist_flax import evaluate
from fmnist_flax.runtime import inference, library_workarounds, parallel
from fmnist_flax.runtime.errors import UserError

from .mesh_worker import MESHES

# Over 50 AdamW steps at batch 128 the 8-device runs differ from the 1-device run only by the
# order of float32 sums in the gradient all-reduce; the bounds are several times the largest
# difference seen in loss and in any parameter.
MESH_WORKER = REPO / "tests" / "runtime" / "mesh_worker.py"  # run with tests/ on its path
LOSS_RTOL = 1e-5
PARAM_ATOL = 2e-4


def env_with_devices(count: int) -> dict[str, str]:
    return {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={count}",
        "PYTHONPATH": str(REPO),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main_py(*flags: str, devices: int = 1, timeout: int = 120) -> subprocess.CompletedProcess:
    """`python main.py FLAGS` on `devices` CPU devices (forked from a `conftest.MainServer`)."""
    server = MainServer.running(env=env_with_devices(devices))
    return server.run(list(flags), REPO, timeout)


@pytest.mark.slow
def test_eight_devices_train_like_one_and_arrays_are_really_sharded(tmp_path):
    cache = compilation_cache_dir()
    worker = subprocess.run(
        [sys.executable, str(MESH_WORKER), str(tmp_path), str(cache)],
        env={**env_with_devices(8), "PYTHONPATH": str(REPO / "tests")},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert worker.returncode == 0, worker.stderr[-3000:]
    one, eight, fsdp = json.loads(worker.stdout)
    assert (one["devices"], eight["devices"], fsdp["devices"]) == (1, 8, 8)
    for run in (eight, fsdp):
        np.testing.assert_allclose(run["losses"], one["losses"], rtol=LOSS_RTOL)
        assert run["params"].keys() == one["params"].keys()
        for name, value in run["params"].items():
            np.testing.assert_allclose(value, one["params"][name], rtol=0, atol=PARAM_ATOL)
        assert run["specs"]["batch"] == "P('data',)"  # each device holds 128 / 8 examples
        assert run["specs"]["test_batches"] == "P(None, 'data')"  # what evaluate streams
        assert run["specs"]["train_images"] == "replicated"
        assert run["restored_equal"]  # Orbax wrote and read the sharded state exactly
        # Evaluation and prediction on the mesh: every test image once, the same answers.
        assert run["test_examples"] == one["test_examples"] == 10_000
        assert run["test_accuracy"] == pytest.approx(one["test_accuracy"], abs=1e-3)
        np.testing.assert_allclose(run["predictions"], one["predictions"], atol=1e-4)
    assert one["specs"]["batch"] == "replicated"  # a 1-device mesh: nothing to split
    assert eight["specs"]["kernel"] == eight["specs"]["kernel_adam_mu"] == "replicated"
    # FSDP splits the (784, 256) kernel and its Adam moments along 784; the (10,) head bias
    # does not divide by 8 and stays replicated.
    assert fsdp["specs"]["kernel"] == fsdp["specs"]["kernel_adam_mu"] == "P('data',)"
    assert fsdp["specs"]["head_bias"] == "replicated"
    assert fsdp["restored_specs"] == ["P('data',)", "replicated"]
    assert one["losses"][-1] < one["losses"][0] / 2


# Against one device, 60 steps at batch 128: the MLP split (data 2, model 4) then resumed on
# (4, 2), and the CNN split (4, 2) then (2, 4), differ by float32 rounding of sums taken in
# another order, the CNN's growing over the steps.
MODEL_PARALLEL_LAYOUTS = {
    "mlp": {
        "layers.0.kernel": "P(None, 'model')",  # column-parallel: its 256 outputs split
        "layers.0.bias": "P('model',)",
        "layers.1.kernel": "P('model',)",  # row-parallel: its 256 inputs split
        "layers.2.kernel": "replicated",  # 10 classes: nothing to split
    },
    "cnn": {
        "convs.0.kernel": "P(None, None, None, 'model')",
        "norms.0.scale": "P('model',)",
        "convs.1.kernel": "P(None, None, 'model')",
        "dense.kernel": "P(None, 'model')",
        "head.kernel": "P('model',)",
    },
}


def model_parallel_worker(tmp_path, name, *, project=REPO, config_file=None):
    """mesh_worker.py's model-parallel runs of `name` (from `config_file`, in the project at
    `project`) on 8 devices: its JSON results."""
    cache = compilation_cache_dir()
    worker = subprocess.run(
        [
            sys.executable,
            str(MESH_WORKER),
            str(tmp_path),
            str(cache),
            name,
            *([str(config_file)] if config_file else []),
        ],
        env={**env_with_devices(8), "PYTHONPATH": f"{project}{os.pathsep}{REPO / 'tests'}"},
        cwd=project,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert worker.returncode == 0, worker.stderr[-3000:]
    return json.loads(worker.stdout)


def assert_model_parallel(r: dict, name: str, layouts: dict[str, str]) -> None:
    """The Done-when of model parallelism on mesh_worker's results `r`: `layouts` (a subset)
    in summary.json and after the moves; the losses of one device over 60 steps; the split
    checkpoint evaluated, predicting and exported on one device; both ways between meshes."""
    (data, model), (data_after, model_after) = MESHES[name]
    assert r["mesh"] == {"data": data, "model": model}
    assert r["resumed_mesh"] == {"data": data_after, "model": model_after}
    for found in (r["param_layouts"], r["resumed_layouts"], r["spread_layouts"]):
        assert layouts.items() <= found.items()
    assert "P(None, 'model')" in r["optimizer_specs"]  # Adam's moments split as their params
    assert r["diverged_replica_caught"]  # a split kernel's copies along `data` are compared
    assert len(r["split_losses"]) == len(r["one_losses"]) == 13  # steps 1, 5, ..., 60
    np.testing.assert_allclose(r["split_losses"], r["one_losses"], rtol=LOSS_RTOL)
    # On one device: the same parameters to the bit, evaluation, predictions and export.
    assert r["restored_devices"] == [1]
    assert r["restored_params"] == r["split_params"]
    assert r["restored_test"][0] == r["split_test"][0]
    assert r["restored_test"][1] == pytest.approx(r["split_test"][1], rel=1e-6)
    for key in ("restored_predictions", "exported_predictions", "loaded_predictions"):
        np.testing.assert_allclose(r[key], r["split_predictions"], atol=1e-5)
    assert r["spread_params"] == r["one_params"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_model_parallel_trains_like_one_device_and_moves_between_meshes(tmp_path, name):
    """The annotated MLP and CNN on 8 devices split (data, model): the losses of one device;
    the checkpoint restores, evaluates, predicts and exports on one device and resumes on
    another split; a one-device checkpoint restores onto the split mesh."""
    result = model_parallel_worker(tmp_path, name)
    assert_model_parallel(result, name, MODEL_PARALLEL_LAYOUTS[name])


@pytest.mark.slow
def test_mesh_model_flag_splits_the_mlp_and_one_device_uses_its_checkpoint(tmp_path, real_dataset):
    """`--config.mesh.model=2` as a user passes it: the set-up table says how each parameter
    lies; --mode=eval, predict and export then run on one device, and the run resumes with
    the parameters split 4 ways."""
    import jax

    workdir = tmp_path / "run"
    flags = ["--log_every=10", "--batch_size=128", "--report=none", f"--workdir={workdir}"]
    trained = main_py("--steps=20", "--config.mesh.model=2", *flags, devices=8)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "mesh {'data': 4, 'model': 2} over 8 cpu device(s); batch 128 split 32" in " ".join(
        trained.stdout.split()  # the table wraps its cells to the width
    )
    assert re.search(r"layers\.0\.kernel +\(784, 256\) .* P\(None, model\)", trained.stdout)
    summary = json.loads((workdir / "summary.json").read_text())

    evaluated = main_py("--mode=eval", f"--workdir={workdir}", f"--output={tmp_path / 'e.json'}")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    result = json.loads((tmp_path / "e.json").read_text())
    assert result["test_accuracy"] == pytest.approx(summary["test_accuracy"], abs=2e-4)
    images = tmp_path / "images.npy"
    np.save(images, real_dataset.test_images[:3])
    predicted = main_py(
        "--mode=predict",
        f"--workdir={workdir}",
        f"--images={images}",
        f"--output={tmp_path / 'p.json'}",
    )
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    probabilities = [
        p["probabilities"] for p in json.loads((tmp_path / "p.json").read_text())["predictions"]
    ]
    artifact = tmp_path / "model.jax"
    exported = main_py("--mode=export", f"--workdir={workdir}", f"--output={artifact}")
    assert exported.returncode == 0, exported.stderr[-3000:]
    served = jax.export.deserialize(artifact.read_bytes()).call(real_dataset.test_images[:3])
    np.testing.assert_allclose(served, probabilities, atol=1e-5)

    resumed = main_py("--steps=30", "--config.mesh.model=4", *flags, devices=8)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from checkpoint 20" in resumed.stdout
    assert "mesh {'data': 2, 'model': 4}" in resumed.stdout
    # --init_from reads the checkpoint on one device, then lays it out on the run's mesh.
    warm = main_py(
        "--steps=10",
        "--report=none",
        f"--config.init_from={workdir}",
        f"--workdir={tmp_path / 'warm'}",
        devices=8,
    )
    assert warm.returncode == 0, warm.stderr[-3000:]
    assert f"initialised from {workdir}, step 30: its parameters" in warm.stdout


@pytest.mark.slow
def test_mesh_model_flag_splits_the_cnn_and_one_device_evaluates_it(tmp_path):
    """The CNN's config with `--config.mesh.model=2`: its kernels split on 8 devices; one
    device evaluates the checkpoint; the run resumes with them split 4 ways."""
    workdir = tmp_path / "run"
    flags = [
        f"--config={REPO / 'configs' / 'cnn.py'}",
        "--config.optimizer.schedule=warmup_rsqrt",  # its warm-up, with no end
        "--config.optimizer.warmup_steps=5",
        "--config.eval_examples=1000",
        "--log_every=5",
        "--report=none",
        f"--workdir={workdir}",
    ]
    trained = main_py(*flags, "--steps=10", "--config.mesh.model=2", devices=8)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "mesh {'data': 4, 'model': 2} over 8 cpu device(s); batch 128 split 32" in " ".join(
        trained.stdout.split()  # the table wraps its cells to the width
    )
    layouts = json.loads((workdir / "summary.json").read_text())["param_layouts"]
    assert MODEL_PARALLEL_LAYOUTS["cnn"].items() <= layouts.items()
    evaluated = main_py("--mode=eval", f"--workdir={workdir}", f"--output={tmp_path / 'e.json'}")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert json.loads((tmp_path / "e.json").read_text())["test_examples"] == 10_000
    resumed = main_py(*flags, "--steps=15", "--config.mesh.model=4", devices=8)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from checkpoint 10" in resumed.stdout
    assert "mesh {'data': 2, 'model': 4}" in resumed.stdout


def start_two_processes(workdir, *flags: str) -> list[subprocess.Popen]:
    """main.py as processes 0 and 1 of one run on localhost, 2 CPU devices each."""
    command = [
        sys.executable,
        str(REPO / "main.py"),
        "--report=none",
        f"--workdir={workdir}",
        f"--coordinator_address=127.0.0.1:{free_port()}",
        "--num_processes=2",
        "--distributed_timeout=60",
        *flags,
    ]
    return [
        subprocess.Popen(
            [*command, f"--process_id={i}"],
            env=env_with_devices(2),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in (0, 1)
    ]


@pytest.mark.slow
def test_two_processes_train_one_model_and_one_process_restores_it(tmp_path, real_dataset):
    workdir = tmp_path / "run"
    processes = start_two_processes(workdir, "--steps=30", "--log_every=10", "--batch_size=256")
    outputs = [p.communicate(timeout=180) for p in processes]
    for p, (_, err) in zip(processes, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    (first_out, _), (second_out, _) = outputs
    assert "the 6 replicated parameter arrays are identical in all 2 processes" in first_out
    assert "mesh {'data': 4} over 4 cpu device(s) in 2 processes" in first_out
    assert "test accuracy" in first_out
    # Process 1 computes but prints no tables (gloo's own connection lines may appear).
    assert "test accuracy" not in second_out and "Set-up" not in second_out

    summary = json.loads((workdir / "summary.json").read_text())
    assert (summary["num_processes"], summary["num_devices"]) == (2, 4)
    assert summary["mesh"] == {"data": 4}
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 10, 20, 30]  # one writer: no duplicated rows

    # The checkpoint both processes wrote restores in this single-device process.
    model, step, config, _ = inference.restore_model(workdir, mesh=parallel.make_mesh())
    assert (step, config.batch_size) == (30, 256)
    result = evaluate.evaluate(
        model, real_dataset.test_images, real_dataset.test_labels, config, parallel.make_mesh()
    )
    assert result["accuracy"] == pytest.approx(summary["test_accuracy"], abs=2e-4)
    assert result["loss"] == pytest.approx(summary["test_loss"], rel=1e-5)


@pytest.mark.slow
def test_a_shard_only_one_process_can_read_stops_both_with_what_to_do(tmp_path):
    """FSDP: each process reads its own shards, so only process 1 meets the damage. Both stop
    at once with one line (no hang), and the fix the line names resumes the run."""
    workdir = tmp_path / "run"
    flags = [
        "--log_every=2",
        "--checkpoint_every=2",
        "--batch_size=64",
        "--config.param_sharding=fsdp",
        EVERY_DUE_SAVE,
    ]
    for p in start_two_processes(workdir, "--steps=4", *flags):
        assert p.wait(timeout=180) == 0
    for shard in (workdir / "checkpoints" / "4" / "model" / "ocdbt.process_1" / "d").iterdir():
        shard.write_bytes(shard.read_bytes()[:10])

    processes = start_two_processes(workdir, "--steps=6", *flags)
    outputs = [p.communicate(timeout=120) for p in processes]
    assert [p.returncode for p in processes] == [1, 1]
    damaged = workdir / "damaged_checkpoints"
    for _, err in outputs:
        last = err.strip().splitlines()[-1]
        assert last.startswith("error: checkpoint 4 in ") and f"move it to {damaged}" in last
    assert "cannot be read here (Encountered error while reading" in outputs[1][1]

    damaged.mkdir()
    (workdir / "checkpoints" / "4").rename(damaged / "4")  # what the error line says to do
    processes = start_two_processes(workdir, "--steps=6", *flags)
    outputs = [p.communicate(timeout=180) for p in processes]
    assert [p.returncode for p in processes] == [0, 0], outputs[0][1][-3000:]
    assert "resuming from checkpoint 2" in outputs[0][0]
    assert json.loads((workdir / "summary.json").read_text())["resumed_from_step"] == 2


@pytest.mark.slow
def test_a_signal_to_one_process_stops_both_at_the_same_saved_step(tmp_path):
    workdir = tmp_path / "run"
    processes = start_two_processes(
        workdir, "--steps=1000000", "--log_every=5", "--checkpoint_every=1000000"
    )
    metrics = workdir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert time.monotonic() < deadline and processes[0].poll() is None, "training never began"
        time.sleep(0.2)
    processes[1].send_signal(signal.SIGTERM)  # only process 1 is told to stop
    outputs = [p.communicate(timeout=120) for p in processes]
    assert [p.returncode for p in processes] == [143, 143]
    messages = [err.strip().splitlines()[-1] for _, err in outputs]
    assert messages[0] == messages[1]  # the same step in both
    step = int(messages[0].split(" at step ")[1].split(":")[0])
    assert messages[0].startswith(f"error: SIGTERM at step {step}: checkpoint {step} saved")
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == [str(step)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--process_id=1"], "no coordinator answered at 127.0.0.1:{port} within 2 s"),
        (["--process_id=0"], "not every process joined the run at 127.0.0.1:{port} within 2 s"),
    ],
)
def test_a_missing_peer_fails_in_one_line(tmp_path, flags, expected):
    port = free_port()
    result = main_py(
        f"--coordinator_address=127.0.0.1:{port}",
        "--num_processes=2",
        "--distributed_timeout=2",
        f"--workdir={tmp_path}",
        *flags,
    )
    assert result.returncode == 1
    assert result.stderr.startswith("error: ")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert expected.format(port=port) in result.stderr


@pytest.mark.slow
def test_indivisible_batch_on_eight_devices_is_one_line(tmp_path):
    result = main_py("--batch_size=100", f"--workdir={tmp_path}", devices=8)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "error: --batch_size=100 does not divide over 8 devices; use a multiple of 8, "
        "e.g. 96 or 104"
    )


@pytest.mark.parametrize(
    "values, message",
    [
        (("localhost:1234", None, None), "given without --num_processes, --process_id"),
        (("localhost", 2, 0), "must be HOST:PORT"),
        (("localhost:1234", 2, 2), "--process_id=2 must be in 0..1"),
    ],
)
def test_distributed_flags_are_checked_before_joining(values, message):
    with pytest.raises(UserError, match=message):
        parallel.initialize(*values, timeout_s=1)


def test_fsdp_shards_the_largest_dimension_that_divides():
    assert parallel.fsdp_spec((784, 256), 8) == parallel.P(parallel.DATA_AXIS)
    assert parallel.fsdp_spec((100, 256), 8) == parallel.P(None, parallel.DATA_AXIS)
    assert parallel.fsdp_spec((10,), 8) == parallel.P()
    assert parallel.fsdp_spec((784, 256), 1) == parallel.P()
    parallel.check_batch(512, 8)
    with pytest.raises(UserError, match=r"use a multiple of 3, e\.g\. 510 or 513"):
        parallel.check_batch(512, 3)


def test_cpu_devices_are_made_only_when_nobody_chose_a_count(monkeypatch):
    """`make_cpu_devices` leaves a count set by XLA_FLAGS or JAX_NUM_CPU_DEVICES alone, asks
    for nothing at 1, and changes nothing once JAX has started (this process): the mesh check
    then says what is missing. (A fresh process gets its devices: tests/test_ensemble.py.)"""
    import jax

    jax.devices()  # this process's backend is up, with the devices it has
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    assert parallel.make_cpu_devices(3) is None
    monkeypatch.delenv("XLA_FLAGS")
    assert parallel.make_cpu_devices(1) is None
    assert parallel.make_cpu_devices(3) is None  # too late: the backend started
    assert len(jax.devices()) == 1
    with pytest.raises(UserError, match=r"shards=3 does not divide the 1 devices"):
        parallel.make_mesh(member_shards=3)


RULES = (("mlp", "model"), ("embed", None))


def test_annotated_axes_follow_the_rules_where_the_mesh_has_them():
    """Logical names become mesh axes through the rules (a name no rule maps stands for
    itself); a missing axis, one that does not divide, or one already used is replicated."""
    split = AbstractMesh((2, 4), (parallel.DATA_AXIS, parallel.MODEL_AXIS))
    spec = parallel.annotated_spec
    assert spec(("embed", "mlp"), (784, 256), RULES, split) == [None, "model"]
    assert spec(("mlp", "embed"), (256, 128), RULES, split) == ["model", None]
    assert spec(("mlp",), (10,), RULES, split) == [None]  # 4 does not divide 10
    assert spec(("mlp", "mlp"), (8, 8), RULES, split) == ["model", None]  # an axis once
    assert spec(("patch", "model"), (8, 8), RULES, split) == [None, "model"]
    assert spec((None, ("data", "mlp")), (3, 16), RULES, split) == [None, ("data", "model")]
    data_only = AbstractMesh((8,), (parallel.DATA_AXIS,))
    assert spec(("embed", "mlp"), (784, 256), RULES, data_only) == [None, None]


def test_leaf_specs_add_members_and_fsdp_to_the_annotations():
    mesh = AbstractMesh((2, 2, 2), parallel.MESH_AXES)
    stacked = nnx.Param(  # 4 members of a (16, 6) kernel, as create_model annotates them
        jnp.zeros((4, 16, 6)),
        out_sharding=("embed", "mlp"),
        sharding_rules=RULES,
        eager_sharding=False,
    )
    assert parallel.leaf_spec(stacked, mesh, stacked=True) == P("member", None, "model")
    assert parallel.leaf_spec(stacked, mesh, "fsdp", stacked=True) == P("member", "data", "model")
    assert parallel.leaf_spec(jnp.zeros((6, 16)), mesh, "fsdp") == P(None, "data")
    assert parallel.leaf_spec(jnp.zeros((6, 16)), mesh) == P()
    with pytest.raises(UserError, match=r"shape \(16, 6\) is annotated with 1 axis names"):
        wrong = nnx.Param(jnp.zeros((16, 6)), out_sharding=("mlp",), eager_sharding=False)
        parallel.leaf_spec(wrong, mesh)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("model", 0, r"--config.mesh.model=0 must be a whole number >= 1"),
        ("data", -1, r"--config.mesh.data=-1 must be a whole number >= 0"),
        ("rules", (("mlp", "modle"),), r"'mlp' -> 'modle': the mesh axis must be 'data'"),
        ("rules", (("mlp", "model"), ("mlp", None)), r"'mlp' is mapped twice"),
        ("rules", (("mlp",),), r"\('mlp',\) is not a \(logical name, mesh axis\) pair"),
    ],
)
def test_mesh_fields_are_checked_in_one_line(field, value, message):
    config = load_config("default")
    config.mesh[field] = value
    with pytest.raises(UserError, match=message):
        parallel.mesh_for(config)


def test_rules_read_back_from_a_saved_config_are_checked_too():
    """A checkpoint's saved config comes back through JSON: pairs as lists, or edited."""
    assert parallel.check_rules([["mlp", "model"], ["embed", None]]) == RULES
    with pytest.raises(UserError, match=r"--config.mesh.rules='mlp' must be \(logical name"):
        parallel.check_rules("mlp")


def test_a_mesh_that_cannot_use_every_device_is_one_line():
    with pytest.raises(UserError, match=r"--config.mesh.model=2 does not divide the 1 devices"):
        parallel.make_mesh(model_shards=2)
    with pytest.raises(UserError, match=r"--config.mesh.data=2: .* it must be 1 \(or 0"):
        parallel.make_mesh(data_shards=2)
    assert dict(parallel.make_mesh(data_shards=1, model_shards=1).shape) == {"data": 1}


def test_a_model_axis_turns_the_cpus_async_dispatch_off_and_nothing_else_does():
    import jax

    before = jax.config.values["jax_cpu_enable_async_dispatch"]
    try:
        for shards in (1, "2", None):
            library_workarounds.serial_cpu_dispatch(shards)
            assert jax.config.values["jax_cpu_enable_async_dispatch"] == before
        library_workarounds.serial_cpu_dispatch(2)
        assert jax.config.values["jax_cpu_enable_async_dispatch"] is False
    finally:
        jax.config.update("jax_cpu_enable_async_dispatch", before)
