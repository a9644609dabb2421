"""Run by tests/runtime/test_parallel.py in a subprocess that has 8 virtual CPU devices:
`mesh_worker.py WORKDIR CACHE [MODEL [CONFIG_FILE]]`, CACHE being the tests' JAX compilation
cache.

Without MODEL: trains the same config on a 1-device mesh, on all 8 devices with replicated
parameters and on all 8 with FSDP; prints one JSON object: each run's loss curve, final
parameters, evaluation, predictions and the `.sharding` of its arrays. With MODEL (mlp, cnn, or
a name of MESHES whose config CONFIG_FILE gives): model parallelism, as `model_parallel` says.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import runpy
import sys

import jax
import numpy as np
from conftest import load_config, use_compilation_cache
from flax import nnx

from fmnist_flax import datasets, evaluate, experiment, input_pipeline, train
from fmnist_flax.runtime import (
    checkpoint,
    device_batches,
    export,
    inference,
    library_workarounds,
    parallel,
    restore,
)
from fmnist_flax.runtime import workdir as workdir_lib

PREDICTED = 5  # does not divide by 8: predict pads and unpads


def spec(array: jax.Array) -> str:
    return "replicated" if array.sharding.is_fully_replicated else str(array.sharding.spec)


class Trained(experiment.Extension):
    """Keeps the run's trained state, as the training loop leaves it."""

    def after_training(self, run: experiment.Run) -> None:
        self.run = run


def host_params(model) -> dict[str, list]:
    """Each parameter's values, by its dotted path."""
    return {
        ".".join(map(str, path)): parallel.to_host(v[...]).tolist()
        for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


def run(dataset, config, devices, param_sharding: str, workdir: pathlib.Path) -> dict:
    config.param_sharding = param_sharding
    trained = Trained()
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON results
        train.train_and_evaluate(config, workdir, [trained], devices=devices)
    model, optimizer = trained.run.model, trained.run.optimizer
    device_data, mesh = trained.run.device_data, trained.run.device_data.mesh
    rows = workdir_lib.read_jsonl(workdir / workdir_lib.METRICS_FILE)
    checkpoints = checkpoint.Checkpoints(workdir, max_to_keep=1)
    try:
        restored = restore.restore(checkpoints, {"model": nnx.state(model)})["model"]
    finally:
        checkpoints.close()
    order = device_batches.epoch_order(config.seed, 0, len(device_data.train_labels))
    x, _ = input_pipeline.batch_at(
        device_data.train_images,
        device_data.train_labels,
        order,
        0,
        config.batch_size,
        (28, 28, 1),
        mesh,
    )
    params = nnx.state(model, nnx.Param)
    some = input_pipeline.padded_batches(dataset.test_images[:300], dataset.test_labels[:300], 128)
    test_batches = device_batches.shard_batches(some, mesh)[0]  # as evaluate places them
    full = evaluate.evaluate(model, dataset.test_images, dataset.test_labels, config, mesh)
    return {
        "devices": mesh.size,
        "losses": [row["loss"] for row in rows],
        "test_accuracy": full["accuracy"],
        "test_examples": full["examples"],
        "predictions": inference.predict(model, dataset.test_images[:PREDICTED], mesh).tolist(),
        "params": host_params(model),
        "restored_equal": all(
            bool((parallel.to_host(a) == parallel.to_host(b)).all())
            for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(params), strict=True)
        ),
        "restored_specs": sorted({spec(a) for a in jax.tree.leaves(restored)}),
        "specs": {
            "batch": spec(x),
            "train_images": spec(device_data.train_images),
            "test_batches": spec(test_batches),
            "kernel": spec(model.layers[0].kernel[...]),
            "kernel_adam_mu": spec(optimizer.opt_state[0].mu["layers"][0]["kernel"][...]),
            "head_bias": spec(model.layers[-1].bias[...]),
        },
    }


# Model parallelism: (data, model) of the first 50 steps, then of the resumed 10.
MESHES = {"mlp": ((2, 4), (4, 2)), "cnn": ((4, 2), (2, 4)), "patches": ((2, 4), (4, 2))}
FIRST_STEPS, ALL_STEPS = 50, 60
EVALUATED = 1_000  # test examples evaluated (config.eval_examples)


def train_quietly(config, workdir: pathlib.Path, devices) -> experiment.Run:
    """A training run (or its resumption) of `config` over `devices`; the run as it ends."""
    trained = Trained()
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON results
        train.train_and_evaluate(config, workdir, [trained], devices=devices)
    return trained.run


def diverged_replica_caught(array: jax.Array) -> bool:
    """Whether check_replicas sees one device's copy of a split array's shard changed."""
    shards = [s.data for s in array.addressable_shards]
    changed = next(i for i, s in enumerate(array.addressable_shards) if s.replica_id == 1)
    shards[changed] = shards[changed] + 1
    diverged = jax.make_array_from_single_device_arrays(array.shape, array.sharding, shards)
    parallel.check_replicas([array], "the kernel")  # the trained copies agree
    try:
        parallel.check_replicas([diverged], "the kernel")
    except RuntimeError:
        return True
    return False


def model_parallel(
    workdir: pathlib.Path, name: str, dataset, config_file: str | None = None
) -> dict:
    """`name` (mlp or cnn, both annotated; or the model of `config_file`) trained on one
    device for 60 steps, and on the 8 devices split (data, model) as MESHES says for 50 steps,
    then resumed to 60 on the other split. The 50-step checkpoint restored on one device:
    evaluated, predicting, exported, its parameters compared; the one-device checkpoint
    restored onto the (data, model) mesh."""
    config = (
        runpy.run_path(config_file)["get_config"]()
        if config_file
        else load_config(name if name == "cnn" else "default")
    )
    # Rates that do not depend on --steps, the same for 50 steps as for 60. The CNN keeps a
    # warm-up: at a constant 2e-3 from step 1 its loss leaps in the first steps, and that leap
    # grows any change in the order of float32 sums (a split of the batch or of the weights
    # alike) far past rounding by step 50; warmed up, it stays near float32 rounding.
    if name == "cnn":
        config.optimizer.update(schedule="warmup_rsqrt", warmup_steps=40)
        config.model.update(features=(8, 16), dense=32)  # split as the shipped CNN, smaller
    else:
        config.optimizer.schedule = "constant"
    config.update(
        batch_size=128, log_every=5, report="none", eval_examples=EVALUATED, steps=FIRST_STEPS
    )
    (data, model), (data_after, model_after) = MESHES[name]
    devices = jax.devices()
    one = config.copy_and_resolve_references()
    one.steps = ALL_STEPS
    base = train_quietly(one, workdir / "one", devices[:1])
    config.mesh.update(data=data, model=model)
    split = train_quietly(config, workdir / "split", devices)
    split_summary = json.loads((workdir / "split" / workdir_lib.SUMMARY_FILE).read_text())
    images = dataset.test_images[:PREDICTED]
    split_predictions = inference.predict(split.model, images, split.device_data.mesh)

    single = parallel.make_mesh(devices[:1])
    restored, _, saved, _ = inference.restore_model(workdir / "split", mesh=single)
    evaluated = evaluate.evaluate(
        restored, dataset.test_images[:EVALUATED], dataset.test_labels[:EVALUATED], saved, single
    )
    artifact = workdir / "split.jax"
    export.export_model(workdir / "split", artifact)
    exported = jax.export.deserialize(artifact.read_bytes())
    loaded = inference.load_model(workdir / "split")

    config.mesh.update(data=data_after, model=model_after)
    config.steps = ALL_STEPS
    resumed = train_quietly(config, workdir / "split", devices)

    # The other way round: the one-device checkpoint restored onto a (data, model) mesh.
    onto = config.copy_and_resolve_references()
    onto.mesh.update(data=data, model=model)
    mesh = parallel.mesh_for(onto, devices)
    spread = inference.restore_model(workdir / "one", mesh=mesh)[0]
    return {
        "mesh": split_summary["mesh"],
        "param_layouts": split_summary["param_layouts"],
        "optimizer_specs": sorted(
            {spec(leaf) for leaf in jax.tree.leaves(nnx.state(split.optimizer))}
        ),
        "diverged_replica_caught": diverged_replica_caught(
            next(
                leaf
                for leaf in jax.tree.leaves(nnx.state(split.model, nnx.Param))
                if "model" in str(leaf.sharding.spec)
            )
        ),
        "resumed_mesh": dict(resumed.device_data.mesh.shape),
        "resumed_layouts": parallel.param_layouts(resumed.model),
        "one_losses": [
            r["loss"] for r in workdir_lib.read_jsonl(workdir / "one" / "metrics.jsonl")
        ],
        "split_losses": [
            r["loss"] for r in workdir_lib.read_jsonl(workdir / "split" / "metrics.jsonl")
        ],
        "split_params": host_params(split.model),
        "restored_params": host_params(restored),
        "restored_devices": sorted(
            {len(leaf.devices()) for leaf in jax.tree.leaves(nnx.state(restored))}
        ),
        "split_test": [split_summary["test_accuracy"], split_summary["test_loss"]],
        "restored_test": [evaluated["accuracy"], evaluated["loss"]],
        "split_predictions": np.asarray(split_predictions).tolist(),
        "restored_predictions": np.asarray(inference.predict(restored, images, single)).tolist(),
        "exported_predictions": np.asarray(exported.call(images)).tolist(),
        "loaded_predictions": np.asarray(inference.predict(loaded, images, single)).tolist(),
        "one_params": host_params(base.model),
        "spread_params": host_params(spread),
        "spread_layouts": parallel.param_layouts(spread),
    }


def main(
    workdir: str, cache: str, model: str | None = None, config_file: str | None = None
) -> None:
    if model:
        library_workarounds.serial_cpu_dispatch(MESHES[model][0][1])  # before the backend starts
    use_compilation_cache(pathlib.Path(cache))
    dataset = datasets.load_dataset(download=False)
    if model:
        print(json.dumps(model_parallel(pathlib.Path(workdir), model, dataset, config_file)))
        return
    config = load_config("default")
    config.batch_size = 128
    config.steps = 50
    config.log_every = 5
    config.report = "none"
    devices = jax.devices()
    results = [
        run(dataset, config, devices[:1], "replicated", pathlib.Path(workdir, "one")),
        run(dataset, config, devices, "replicated", pathlib.Path(workdir, "eight")),
        run(dataset, config, devices, "fsdp", pathlib.Path(workdir, "fsdp")),
    ]
    print(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
