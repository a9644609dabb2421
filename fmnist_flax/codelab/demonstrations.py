"""The codelab's demonstrations, added to a run as an extension (sections 6, 7, 13 and 15).

The gradient check, Python dispatch vs the jitted step, float32 vs bfloat16 timing and the
tokens/sec projection. Nothing on the training path imports this module: the CLI adds
`Codelab()` to a run whose `config.demonstrations` is True, while it exists, so a project that
starts from this template can delete `fmnist_flax/codelab/` (with its tests) and keep a
working trainer.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from fmnist_flax import input_pipeline, train
from fmnist_flax.experiment import Extension, Run
from fmnist_flax.runtime import (
    compilation_cache,
    device_batches,
    ensemble,
    inference,
    parallel,
    report,
    tables,
)
from fmnist_flax.runtime.tables import Table

EAGER_STEPS = 20  # the codelab's sizes
JIT_STEPS = 100
PRECISION_STEPS = 100
COMPARISON_SEED = 10  # fresh models, never the trained one
TOKENS_PER_EXAMPLE = 16  # a 28x28 image cut into 7x7 patches, as a vision transformer would
PROJECTION_NOTE = (
    f"Projection, not a measurement: this MLP consumes whole images, not tokens. The figure "
    f"multiplies the measured examples/sec by an assumed {TOKENS_PER_EXAMPLE} tokens per example "
    "(7x7 patches of a 28x28 image). A model that really processes tokens spends different "
    "work per token (attention grows with sequence length, embeddings and wider layers add "
    "FLOPs), so its tokens/sec must be measured on that model."
)
DISPATCH = "Python dispatch vs jit"  # report sections
PRECISION = "Precision"
TITLES = {
    DISPATCH: "Python dispatch vs jitted step",
    PRECISION: "Mixed-precision timing after warm-up",
}


class Codelab(Extension):
    """Adds the codelab's demonstrations to a run; the timing ones only with --report=full."""

    def before_training(self, run: Run) -> None:
        # The first batch of epoch 0, picked on the host: with Grain the train set is not on
        # the device. Host and device preprocessing agree to the bit.
        d = run.device_data
        images = run.dataset.train_images
        labels = run.dataset.train_labels
        order = device_batches.epoch_order(run.config.seed, 0, len(labels))
        picks = np.asarray(order)[: d.batch_size]  # sliced on the host: nothing to compile
        first_batch = [
            parallel.shard_host_array(a, parallel.batch_sharding(d.mesh))
            for a in (input_pipeline.prepare_images(images[picks]), labels[picks].astype(np.int32))
        ]
        table, check = gradient_check(run.model, *first_batch, run.config)
        run.show("Gradients", table)
        run.summary["gradient_check"] = check

    def evaluation_rows(self, run: Run, evaluation: dict[str, Any]) -> dict[str, dict]:
        """The codelab's own test metrics, over the test set's whole batches only (its
        evaluation drops the last, partial one), also in summary.json as codelab_test_*."""
        whole_batches = evaluation[inference.COUNT] // run.config.batch_size
        codelab = inference.means(evaluation["batch_sums"], whole_batches)
        run.summary |= {f"codelab_test_{k}": v for k, v in codelab.items()}
        return {"test, codelab (whole batches only)": codelab}

    def after_training(self, run: Run) -> None:
        if run.config.report == "full":  # the timings share the CPU with no other thread:
            run.checkpoints.wait()  # the final save's writer
            run.figures_drawn()  # and the figure thread
            self._timing(run, DISPATCH, "mode", dispatch_vs_jit(run), "dispatch_vs_jit")
            self._timing(run, PRECISION, "dtype", precision_comparison(run), "precision")
        heading = "Throughput in tokens"
        run.show(heading, tokens_table(run.examples_per_sec))
        run.note(heading, PROJECTION_NOTE)

    @staticmethod
    def _timing(run: Run, heading: str, key: str, rows: list[dict[str, Any]], name: str) -> None:
        """A timing comparison's table, bar chart (`name`.png) and summary entry (`name`)."""
        run.summary[name] = rows
        run.show(heading, timing_table(TITLES[heading], key, rows))
        rates = [r["examples_per_sec"] for r in rows]
        labels = [r[key] for r in rows]
        title = f"{heading}: examples per second"
        run.figure(heading, f"{name}.png", lambda: report.bars(labels, rates, title, "examples/s"))


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "config"),
    compiler_options=compilation_cache.QUICK_COMPILE,
)
def _gradient_check(graphdef, state, x, y, learning_rate, config):
    model = nnx.merge(graphdef, state)

    def loss(model):
        return train.loss_fn(model, x, y, config)[0]

    grads_only = nnx.grad(loss)(model)
    value, grads = nnx.value_and_grad(loss)(model)
    # The codelab's hand-written SGD step: a new parameter tree, the model left untouched.
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    stepped = jax.tree.map(lambda p, g: p - learning_rate * g, params, grads)
    scalars = {
        "loss": value,
        "grad_norm": optax.tree.norm(grads),
        "grad_vs_value_and_grad": optax.tree.norm(jax.tree.map(jnp.subtract, grads, grads_only)),
        "loss_after_one_sgd_step": loss(nnx.merge(graphdef, stepped, rest)),
    }
    return grads, scalars


def gradient_check(
    model: nnx.Module, x: jax.Array, y: jax.Array, config: ml_collections.ConfigDict
) -> tuple[Table, dict[str, Any]]:
    """Section 6: `nnx.grad` and `nnx.value_and_grad` agree and mirror the parameter tree.

    Compiled as one program, norms included: the codelab runs these eagerly, which here costs
    seconds of op-by-op compilation and shows nothing more.
    """
    # On a copy in eval mode: BatchNorm statistics and dropout's RNG state must stay as they
    # are, or a resumed run would not repeat the uninterrupted one.
    probe = nnx.clone(model)
    probe.eval()
    frozen = ml_collections.FrozenConfigDict(config)
    graphdef, state = nnx.split(probe)
    lr = config.optimizer.learning_rate
    grads, scalars = _gradient_check(graphdef, state, x, y, lr, frozen)
    params = nnx.state(model, nnx.Param)
    check = {
        "trees_match": jax.tree.structure(grads) == jax.tree.structure(params),
        **{name: float(value) for name, value in parallel.to_host(scalars).items()},
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
        f" grad vs value_and_grad difference {check['grad_vs_value_and_grad']:.6f},"
        f" loss after one SGD step {check['loss_after_one_sgd_step']:.4f})",
        ("Leaf", "Param shape", "Grad shape", "Grad dtype"),
        rows,
    )
    return table, check


def time_steps(
    step_fn: Callable[..., train.Metrics],
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    device_data: input_pipeline.DeviceData,
    steps: int,
    config: ml_collections.ConfigDict,
) -> dict[str, float]:
    """One untimed warm-up step, then `steps` timed ones until the state is ready.

    The codelab's protocol: the batches of epoch 0's order are stacked on the device before
    the clock starts (at most one epoch of them), and each timed step indexes its own, as the
    codelab's `batch_at(step)` does; that per-step dispatch is part of what a loop of jitted
    steps costs, and what the fused training path removes.
    """
    d = device_data
    frozen = ml_collections.FrozenConfigDict(config)
    order = device_batches.epoch_order(COMPARISON_SEED, 0, len(d.train_labels))
    shape = (d.batch_size, d.image_shape, d.mesh, d.accumulate)
    batches = (
        input_pipeline.batch_at(d.train_images, d.train_labels, order, i, *shape)
        for i in range(min(steps + 1, d.batches_per_epoch))
    )
    xs, ys = (jnp.stack(parts) for parts in zip(*batches, strict=True))
    jax.block_until_ready(step_fn(model, optimizer, xs[0], ys[0], frozen))
    start = time.perf_counter()
    for i in range(steps):
        j = (i + 1) % len(xs)
        metrics = step_fn(model, optimizer, xs[j], ys[j], frozen)
    jax.block_until_ready((metrics, nnx.state((model, optimizer))))
    seconds = time.perf_counter() - start
    metrics = parallel.to_host(metrics)
    return {
        "steps": steps,
        "loss": float(metrics["loss"]),
        "accuracy": float(metrics["accuracy"]),
        "seconds": seconds,
        "examples_per_sec": steps * d.examples_per_step / seconds,
    }


def fresh_state(
    config: ml_collections.ConfigDict,
    device_data: input_pipeline.DeviceData,
    num_classes: int,
    compute_dtype: str | None = None,
) -> tuple[nnx.Module, nnx.Optimizer]:
    """A new model and optimizer from COMPARISON_SEED (never the trained one): one model, as
    the codelab's comparisons time it, also for an ensemble run."""
    config = ml_collections.ConfigDict(config.to_dict())
    config.ensemble = ensemble.default_config()
    if compute_dtype:
        config.compute_dtype = compute_dtype
    return train.create_train_state(
        config, device_data.image_shape, num_classes, device_data.mesh, seed=COMPARISON_SEED
    )


def with_train_set(run: Run) -> input_pipeline.DeviceData:
    """The run's device data with the train set on the device, where the timing demonstrations
    (--report=full) pick their batches; a run fed by Grain gets it placed here, for them only."""
    if run.device_data.train_images is None:
        run.device_data = device_batches.to_device(
            run.dataset,
            run.config.batch_size,
            run.device_data.mesh,
            accumulate=run.config.optimizer.accumulate,
        )
    return run.device_data


def dispatch_vs_jit(run: Run) -> list[dict[str, Any]]:
    """Section 7: the same AdamW step run op by op from Python, and compiled with nnx.jit."""
    d = with_train_set(run)
    n = run.dataset.num_classes
    config = run.config
    eager = time_steps(train.train_step, *fresh_state(config, d, n), d, EAGER_STEPS, config)
    jitted = time_steps(train.jit_train_step, *fresh_state(config, d, n), d, JIT_STEPS, config)
    return [{"mode": "Python dispatch", **eager}, {"mode": "jitted step", **jitted}]


def precision_comparison(run: Run) -> list[dict[str, Any]]:
    """Section 13: float32 and bfloat16 compute (params stay float32), fresh init each."""
    d = with_train_set(run)
    n = run.dataset.num_classes
    return [
        {
            "dtype": dtype,
            **time_steps(
                train.jit_train_step,
                *fresh_state(run.config, d, n, dtype),
                d,
                PRECISION_STEPS,
                run.config,
            ),
        }
        for dtype in ("float32", "bfloat16")
    ]


def tokens_table(examples_per_sec: float) -> Table:
    """Section 15: examples/sec related to tokens/sec under a stated assumption."""
    return Table.of(
        "Throughput in tokens (projection)",
        ("Measured examples/sec", "Assumed tokens/example", "Projected tokens/sec"),
        [
            (
                f"{examples_per_sec:,.0f}",
                TOKENS_PER_EXAMPLE,
                f"{examples_per_sec * TOKENS_PER_EXAMPLE:,.0f}",
            )
        ],
    )


def timing_table(title: str, key: str, rows: Sequence[dict[str, Any]]) -> Table:
    """Sections 7 and 13: steps, final loss, seconds and examples/sec per variant."""
    return Table.of(
        title,
        (key.capitalize(), "Steps", "Final loss", "Accuracy", "Seconds", "Examples/sec"),
        [
            (
                r[key],
                r["steps"],
                f"{r['loss']:.4f}",
                f"{100 * r['accuracy']:.1f}%",
                f"{r['seconds']:.3f}",
                f"{r['examples_per_sec']:,.0f}",
            )
            for r in rows
        ],
    )


EXTENSION = Codelab()  # what the CLI adds to a run with config.demonstrations
