"""Run by tests/test_parallel.py in a subprocess that has 8 virtual CPU devices:
`mesh_worker.py WORKDIR CACHE`, CACHE being the tests' JAX compilation cache.

Trains the same config on a 1-device mesh, on all 8 devices with replicated parameters and on
all 8 with FSDP; prints one JSON object: each run's loss curve, final parameters, evaluation,
predictions and the `.sharding` of its arrays.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import sys

import jax
from conftest import load_config, use_compilation_cache
from flax import nnx

from fmnist_flax import (
    checkpoint,
    datasets,
    evaluate,
    experiment,
    input_pipeline,
    parallel,
    restore,
    train,
)
from fmnist_flax import workdir as workdir_lib

PREDICTED = 5  # does not divide by 8: predict pads and unpads


def spec(array: jax.Array) -> str:
    return "replicated" if array.sharding.is_fully_replicated else str(array.sharding.spec)


class Trained(experiment.Extension):
    """Keeps the run's trained state, as the training loop leaves it."""

    def after_training(self, run: experiment.Run) -> None:
        self.run = run


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
    order = input_pipeline.epoch_order(config.seed, 0, len(device_data.train_labels))
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
    test_batches = input_pipeline.shard_batches(some, mesh)[0]  # as evaluate places them
    full = evaluate.evaluate(model, dataset.test_images, dataset.test_labels, config, mesh)
    return {
        "devices": mesh.size,
        "losses": [row["loss"] for row in rows],
        "test_accuracy": full["accuracy"],
        "test_examples": full["examples"],
        "predictions": evaluate.predict(model, dataset.test_images[:PREDICTED], mesh).tolist(),
        "params": {
            ".".join(map(str, path)): parallel.to_host(v[...]).tolist()
            for path, v in nnx.to_flat_state(params)
        },
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


def main(workdir: str, cache: str) -> None:
    use_compilation_cache(pathlib.Path(cache))
    dataset = datasets.load_dataset(download=False)
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
