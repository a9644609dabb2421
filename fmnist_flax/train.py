"""Optimizer, the compiled train step, and the loop that runs every stage (sections 6, 8, 9)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from flax import nnx

from fmnist_flax import config as config_lib
from fmnist_flax import data, evaluate, reference, tables
from fmnist_flax import workdir as workdir_lib
from fmnist_flax.errors import UserError
from fmnist_flax.model import create_model
from fmnist_flax.tables import Table

Metrics = dict[str, jax.Array]


def create_optimizer(model: nnx.Module, config: ml_collections.ConfigDict) -> nnx.Optimizer:
    """AdamW over the model's parameters, as the codelab configures it."""
    tx = optax.adamw(config.optimizer.learning_rate, weight_decay=config.optimizer.weight_decay)
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


def loss_with_metrics(
    model: nnx.Module, x: jax.Array, y: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean softmax cross-entropy with integer labels; batch accuracy as aux."""
    logits = model(x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, axis=-1) == y)}


def loss_fn(model: nnx.Module, x: jax.Array, y: jax.Array) -> jax.Array:
    """The scalar loss `nnx.grad` differentiates."""
    return loss_with_metrics(model, x, y)[0]


@nnx.jit
def train_step(model: nnx.Module, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> Metrics:
    """One AdamW update in place; returns loss, batch accuracy and the gradient's L2 norm."""
    (loss, aux), grads = nnx.value_and_grad(loss_with_metrics, has_aux=True)(model, x, y)
    optimizer.update(model, grads)
    return {"loss": loss, "accuracy": aux["accuracy"], "grad_norm": optax.tree.norm(grads)}


def gradient_check(
    model: nnx.Module, x: jax.Array, y: jax.Array, learning_rate: float
) -> tuple[Table, dict[str, Any]]:
    """Section 6: `nnx.grad` and `nnx.value_and_grad` agree and mirror the parameter tree.

    Both are compiled: the codelab runs them eagerly, which here costs seconds of op-by-op
    compilation and shows nothing more.
    """
    grads_only = nnx.jit(nnx.grad(loss_fn))(model, x, y)
    loss, grads = nnx.jit(nnx.value_and_grad(loss_fn))(model, x, y)
    params = nnx.state(model, nnx.Param)
    difference = optax.tree.norm(jax.tree.map(jnp.subtract, grads, grads_only))
    # The codelab's hand-written SGD step, on the pure-PyTree twin: a new tree, old one untouched.
    sgd_step = jax.jit(reference.sgd_step, static_argnames="learning_rate")
    _, sgd_loss = sgd_step(reference.params_from_model(model), (x, y), learning_rate=learning_rate)
    check = {
        "trees_match": jax.tree.structure(grads) == jax.tree.structure(params),
        "loss": float(loss),
        "grad_norm": float(optax.tree.norm(grads)),
        "grad_vs_value_and_grad": float(difference),
        "sgd_step_loss": float(sgd_loss),
    }
    rows = [
        (tables.path_name(path), tuple(p.shape), tuple(g.shape), g.dtype)
        for (path, p), (_, g) in zip(
            nnx.to_flat_state(params), nnx.to_flat_state(grads), strict=True
        )
    ]
    table = Table.of(
        "Gradient tree matches the parameter tree"
        f" (loss {check['loss']:.4f}, grad L2 norm {check['grad_norm']:.4f},"
        f" grad vs value_and_grad difference {check['grad_vs_value_and_grad']:.6f})",
        ("Leaf", "Param shape", "Grad shape", "Grad dtype"),
        rows,
    )
    return table, check


def train(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    batches: data.Batches,
    steps: int,
    log_every: int,
    on_log: Callable[[dict[str, float]], None],
) -> tuple[list[dict[str, float]], float]:
    """Run `steps` updates cycling through the fixed batches; returns the log and examples/sec.

    Metrics reach the host only at step 1, every `log_every` steps and the last step. The clock
    starts after the first (compiling) step and stops at `block_until_ready` on the final state.
    """
    num_batches, batch_size = batches.train_y.shape
    history = []

    def log(step: int, metrics: Metrics) -> None:
        row = {"step": step, **{k: float(v) for k, v in jax.device_get(metrics).items()}}
        if not np.isfinite(row["loss"]):
            raise UserError(
                f"the loss became {row['loss']} at step {step}; lower --learning_rate and retry"
            )
        history.append(row)
        on_log(row)

    log(1, train_step(model, optimizer, batches.train_x[0], batches.train_y[0]))
    start = time.perf_counter()
    for step in range(2, steps + 1):
        i = (step - 1) % num_batches
        metrics = train_step(model, optimizer, batches.train_x[i], batches.train_y[i])
        if step % log_every == 0 or step == steps:
            log(step, metrics)
    jax.block_until_ready(nnx.state((model, optimizer)))
    elapsed = time.perf_counter() - start
    examples_per_sec = (steps - 1) * batch_size / elapsed if steps > 1 else float("nan")
    return history, examples_per_sec


def setup_table(device: jax.Device) -> Table:
    """Section 1: versions, backend and devices."""
    return Table.of(
        "Set-up",
        ("Item", "Value"),
        [
            ("JAX", jax.__version__),
            ("Flax", flax.__version__),
            ("Optax", optax.__version__),
            ("Default backend", jax.default_backend()),
            ("Devices", ", ".join(str(d) for d in jax.devices())),
            ("Using", str(device)),
        ],
    )


def batches_table(batches: data.Batches) -> Table:
    """Section 4: the device-resident batch arrays."""
    rows = [
        (name, tuple(a.shape), a.dtype, tables.devices_of(a)) for name, a in vars(batches).items()
    ]
    return Table.of("Fixed-size batches on the device", ("Array", "Shape", "Dtype", "Device"), rows)


def show(table: Table) -> None:
    print(table.format(), flush=True)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | None) -> dict[str, Any]:
    """Every stage of the codelab for one config; writes summary.json and metrics.jsonl."""
    wall_start = time.perf_counter()
    # Everything a user can get wrong is checked before anything is printed or compiled.
    config_lib.validate(config)
    dataset = data.load_dataset(config.data_dir or None)
    device = jax.devices()[0]
    batches = data.make_batches(dataset, config.batch_size, config.seed, device)
    workdir = workdir_lib.prepare_workdir(workdir)
    print(f"workdir: {workdir}", flush=True)

    show(setup_table(device))
    if device.platform != "gpu":
        logging.warning("No GPU found: running on %s. Install '.[cuda12]' on a GPU host.", device)
    show(
        Table.of(
            "Fashion-MNIST loaded from IDX files",
            ("Split", "Images", "Image shape", "Labels", "Source"),
            [
                (split, f"{len(images):,}", images.shape[1:], f"{len(labels):,}", source)
                for split, images, labels, source in (
                    (
                        "train",
                        dataset.train_images,
                        dataset.train_labels,
                        dataset.sources[data.TRAIN_IMAGES.stem],
                    ),
                    (
                        "test",
                        dataset.test_images,
                        dataset.test_labels,
                        dataset.sources[data.TEST_IMAGES.stem],
                    ),
                )
            ],
        )
    )
    show(batches_table(batches))

    model = create_model(config)
    show(tables.params_table(model))
    grad_table, grad_check = gradient_check(
        model, batches.train_x[0], batches.train_y[0], config.optimizer.learning_rate
    )
    show(grad_table)

    optimizer = create_optimizer(model, config)
    metrics_log = workdir_lib.MetricsLog(workdir / workdir_lib.METRICS_FILE)

    def on_log(row: dict[str, float]) -> None:
        metrics_log.write(row)
        print(
            f"step {row['step']:>6}/{config.steps}  loss {row['loss']:.4f}  "
            f"accuracy {row['accuracy']:.3f}  grad norm {row['grad_norm']:.3f}",
            flush=True,
        )

    try:
        history, examples_per_sec = train(
            model, optimizer, batches, config.steps, config.log_every, on_log
        )
    finally:
        metrics_log.close()
    show(
        Table.of(
            f"Training metrics, {examples_per_sec:,.0f} examples/sec",
            ("Step", "Loss", "Accuracy", "Grad norm"),
            [
                (
                    h["step"],
                    f"{h['loss']:.4f}",
                    f"{100 * h['accuracy']:.1f}%",
                    f"{h['grad_norm']:.3f}",
                )
                for h in history
            ],
        )
    )

    codelab_eval = evaluate.evaluate(model, batches.test_x, batches.test_y)
    full_eval = evaluate.evaluate(
        model, batches.full_test_x, batches.full_test_y, batches.full_test_mask
    )
    last = history[-1]
    show(
        Table.of(
            "Evaluation after training",
            ("Split", "Loss", "Accuracy", "Examples evaluated"),
            [
                (
                    "last train batch",
                    f"{last['loss']:.4f}",
                    f"{100 * last['accuracy']:.2f}%",
                    config.batch_size,
                ),
                (
                    "test, codelab (whole batches only)",
                    f"{codelab_eval['loss']:.4f}",
                    f"{100 * codelab_eval['accuracy']:.2f}%",
                    f"{codelab_eval['examples']:,}",
                ),
                (
                    "test, full (last batch padded, masked)",
                    f"{full_eval['loss']:.4f}",
                    f"{100 * full_eval['accuracy']:.2f}%",
                    f"{full_eval['examples']:,}",
                ),
            ],
        )
    )
    show(
        Table.of(
            "Device placement",
            ("What", "Device"),
            [
                ("params", tables.devices_of(nnx.state(model, nnx.Param))),
                ("optimizer state", tables.devices_of(nnx.state(optimizer, nnx.OptState))),
                ("train batches", tables.devices_of((batches.train_x, batches.train_y))),
                ("test batches", tables.devices_of((batches.test_x, batches.test_y))),
            ],
        )
    )

    summary = {
        "test_accuracy": full_eval["accuracy"],
        "test_loss": full_eval["loss"],
        "test_examples": full_eval["examples"],
        "codelab_test_accuracy": codelab_eval["accuracy"],
        "codelab_test_loss": codelab_eval["loss"],
        "codelab_test_examples": codelab_eval["examples"],
        "final_train_loss": last["loss"],
        "final_train_accuracy": last["accuracy"],
        "train_examples_per_sec": examples_per_sec,
        "steps": config.steps,
        "batch_size": config.batch_size,
        "compute_dtype": config.compute_dtype,
        "seed": config.seed,
        "backend": jax.default_backend(),
        "num_devices": jax.device_count(),
        "gradient_check": grad_check,
        "wall_seconds": time.perf_counter() - wall_start,
        "versions": {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__},
        "config": config.to_dict(),
    }
    workdir_lib.write_json(workdir / workdir_lib.SUMMARY_FILE, summary)
    print(
        f"test accuracy {full_eval['accuracy']:.4f} on {full_eval['examples']:,} examples "
        f"({codelab_eval['accuracy']:.4f} on the codelab's {codelab_eval['examples']:,})\n"
        f"workdir: {workdir}",
        flush=True,
    )
    return summary
