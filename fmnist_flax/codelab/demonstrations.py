"""The codelab's demonstrations, added to a run as an extension (sections 6, 7, 13 and 15).

The gradient check, Python dispatch vs the jitted step, float32 vs bfloat16 timing and the
tokens/sec projection. Nothing on the training path imports this module: the CLI adds
`Codelab()` to a run whose `config.demonstrations` is True, while it exists, so a project that
starts from this template can delete `fmnist_flax/codelab/` (with its tests) and keep a
working trainer.
"""

from __future__ import annotations

import dataclasses
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
    console,
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
KEYS = {DISPATCH: "mode", PRECISION: "dtype"}  # each comparison's variant column


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
        if run.config.report == "full":
            timings = Timings(run)  # warmed up while the figures are drawn
            run.checkpoints.wait()  # the timings share the devices' host with no other thread:
            run.figures_drawn()  # the final save's writer and the figure thread are done
            self._timing(run, DISPATCH, timings.timed(DISPATCH), "dispatch_vs_jit")
            self._timing(run, PRECISION, timings.timed(PRECISION), "precision")
        heading = "Throughput in tokens"
        run.show(heading, tokens_table(run.examples_per_sec))
        run.note(heading, PROJECTION_NOTE)

    @staticmethod
    def _timing(run: Run, heading: str, rows: list[dict[str, Any]], name: str) -> None:
        """A timing comparison's table, bar chart (`name`.png) and summary entry (`name`)."""
        key = KEYS[heading]
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


@dataclasses.dataclass
class Timing:
    """One variant of a timing comparison, warm: its step function (eager or jitted), a
    fresh model and optimizer that took its untimed first step, and how many steps to time."""

    label: str
    step_fn: Callable[..., train.Metrics]
    model: nnx.Module
    optimizer: nnx.Optimizer
    steps: int


class Timings:
    """The timing comparisons' variants, warmed up before any is timed, while the report's
    figures are drawn on their thread: the batches gathered once, each variant's fresh state
    built and its first step taken (compiling it). `timed()` then times each variant alone on
    the devices, once the figures are drawn. (Warmed on a thread beside training instead,
    they slowed an accelerator's host-bound training loop several times over.)"""

    def __init__(self, run: Run):
        self.run = run
        self._variants = self._warm_up()

    def _warm_up(self) -> dict[str, list[Timing]]:
        run = self.run
        d = with_train_set(run)
        n = run.dataset.num_classes
        self.batches = first_batches(d, max(EAGER_STEPS, JIT_STEPS, PRECISION_STEPS) + 1)
        variants = {
            DISPATCH: [
                ("Python dispatch", train.train_step, None, EAGER_STEPS),
                ("jitted step", train.jit_train_step, None, JIT_STEPS),
            ],
            PRECISION: [
                (dtype, train.jit_train_step, dtype, PRECISION_STEPS)
                for dtype in ("float32", "bfloat16")
            ],
        }
        frozen = ml_collections.FrozenConfigDict(run.config)
        x, y = self.batches[0][0], self.batches[1][0]
        warmed = {}
        for heading, rows in variants.items():
            warmed[heading] = []
            for label, step_fn, dtype, steps in rows:
                console.status(f"warming up the timings: {label} (--report=basic skips them)")
                model, optimizer = fresh_state(run.config, d, n, dtype)
                jax.block_until_ready(step_fn(model, optimizer, x, y, frozen))
                warmed[heading].append(Timing(label, step_fn, model, optimizer, steps))
        return warmed

    def timed(self, heading: str) -> list[dict[str, Any]]:
        """The rows of one comparison, each variant timed alone on the devices."""
        rows = []
        for timing in self._variants[heading]:
            rows.append({KEYS[heading]: timing.label, **time_steps(timing, self.batches, self.run)})
        return rows


def first_batches(d: input_pipeline.DeviceData, count: int) -> tuple[jax.Array, jax.Array]:
    """The first `count` batches of epoch 0's order (from COMPARISON_SEED), gathered and
    normalised on the device by one compiled program, as `input_pipeline.batch_at` picks them:
    the timed steps index their own, as the codelab's `batch_at(step)` does."""
    count = min(count, d.batches_per_epoch)
    order = device_batches.epoch_order(COMPARISON_SEED, 0, len(d.train_labels))
    return _gather(
        d.train_images,
        d.train_labels,
        order,
        count,
        d.batch_size,
        d.image_shape,
        d.mesh,
        d.accumulate,
    )


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6, 7))
def _gather(images, labels, order, count, batch_size, image_shape, mesh, accumulate):
    picks = order[: count * batch_size * accumulate].reshape(count, accumulate, batch_size)
    if accumulate == 1:
        picks = picks[:, 0]
    if mesh is not None:
        picks = jax.lax.with_sharding_constraint(
            picks, parallel.batch_sharding(mesh, axis=picks.ndim - 1)
        )
    x = input_pipeline.normalize(images[picks]).reshape(*picks.shape, *image_shape)
    return x, labels[picks]


def time_steps(timing: Timing, batches: tuple[jax.Array, jax.Array], run: Run) -> dict[str, float]:
    """`timing.steps` timed steps of a warm variant, until its state is ready.

    The codelab's protocol: the batches of epoch 0's order are stacked on the device before
    the clock starts (at most one epoch of them), and each timed step indexes its own, as the
    codelab's `batch_at(step)` does; that per-step dispatch is part of what a loop of jitted
    steps costs, and what the fused training path removes.
    """
    xs, ys = batches
    frozen = ml_collections.FrozenConfigDict(run.config)
    model, optimizer, steps = timing.model, timing.optimizer, timing.steps
    console.status(f"timing: {timing.label}, {steps} steps (--report=basic skips the timings)")
    start = time.perf_counter()
    for i in range(steps):
        j = (i + 1) % len(xs)
        metrics = timing.step_fn(model, optimizer, xs[j], ys[j], frozen)
    jax.block_until_ready((metrics, nnx.state((model, optimizer))))
    seconds = time.perf_counter() - start
    metrics = parallel.to_host(metrics)
    return {
        "steps": steps,
        "loss": float(metrics["loss"]),
        "accuracy": float(metrics["accuracy"]),
        "seconds": seconds,
        "examples_per_sec": steps * run.device_data.examples_per_step / seconds,
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
        return device_batches.to_device(
            run.dataset,
            run.config.batch_size,
            run.device_data.mesh,
            accumulate=run.config.optimizer.accumulate,
        )
    return run.device_data


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
