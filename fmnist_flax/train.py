"""The loss, the optimizer, the train step and the loop that runs it (sections 8 and 9).

`train_step` is the one place a step is defined: `jit_train_step` compiles it as the codelab's
`nnx.jit` step, and `make_train_chunk` runs it K times inside one compiled `fori_loop` (the
default path). Metrics are one dict from `loss_fn` to `metrics.jsonl` and every table.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from fmnist_flax import checkpoint as checkpoint_lib
from fmnist_flax import input_pipeline, parallel
from fmnist_flax.errors import UserError
from fmnist_flax.model import create_model

Metrics = dict[str, jax.Array]
AUGMENT_STREAM = 2  # fold_in index of the augmentation key (params 0, dropout 1)


def learning_rate(config: ml_collections.ConfigDict) -> optax.Schedule | float:
    """The codelab's constant rate, or linear warm-up then cosine decay over `config.steps`."""
    opt = config.optimizer
    if opt.schedule == "constant":
        return opt.learning_rate
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=opt.learning_rate,
        warmup_steps=opt.warmup_steps,
        decay_steps=config.steps,
        end_value=opt.learning_rate * opt.final_fraction,
    )


def create_optimizer(model: nnx.Module, config: ml_collections.ConfigDict) -> nnx.Optimizer:
    """AdamW over the model's parameters (the codelab's), with the config's schedule."""
    tx = optax.adamw(learning_rate(config), weight_decay=config.optimizer.weight_decay)
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


def create_train_state(
    config: ml_collections.ConfigDict,
    image_shape: tuple[int, int],
    num_classes: int,
    mesh: jax.sharding.Mesh,
    seed: int | None = None,
) -> tuple[nnx.Module, nnx.Optimizer]:
    """A fresh model and its optimizer, laid out on the mesh as `config.param_sharding` says."""
    model = create_model(config, image_shape, num_classes, seed)
    optimizer = create_optimizer(model, config)
    parallel.place_module((model, optimizer), mesh, config.param_sharding)
    return model, optimizer


def loss_fn(
    model: nnx.Module, x: jax.Array, y: jax.Array, label_smoothing: float = 0.0
) -> tuple[jax.Array, Metrics]:
    """Mean softmax cross-entropy (labels smoothed when asked) and the metrics of the batch.

    Every metric starts here: add an entry to `metrics` and it reaches metrics.jsonl, the
    progress bar and the training table (and TensorBoard-style logs) with no other edit.
    """
    logits = model(x)
    if label_smoothing:
        targets = optax.smooth_labels(jax.nn.one_hot(y, logits.shape[-1]), label_smoothing)
        loss = optax.softmax_cross_entropy(logits, targets).mean()
    else:
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    metrics = {
        "loss": loss,
        "accuracy": jnp.mean(jnp.argmax(logits, axis=-1) == y),
    }
    return loss, metrics


def train_step(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    x: jax.Array,
    y: jax.Array,
    label_smoothing: float = 0.0,
    log: bool | jax.Array = True,
) -> Metrics:
    """One AdamW update in place; returns `loss_fn`'s metrics and the gradient's L2 norm.

    The norm is one more pass over every gradient, so inside a fused chunk it is computed only
    when `log` (the chunk's last step) holds. Called as is, every operation is dispatched from
    Python (the codelab's eager baseline).
    """
    (_, metrics), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, x, y, label_smoothing)
    optimizer.update(model, grads)
    if log is True:
        metrics["grad_norm"] = optax.tree.norm(grads)
    else:
        metrics["grad_norm"] = jax.lax.cond(log, optax.tree.norm, _zero_norm, grads)
    return metrics


def _zero_norm(grads: nnx.State) -> jax.Array:
    return jnp.zeros((), jnp.float32)


# The same step, compiled once for fixed shapes. Tree mode (graph=False) treats the model and
# optimizer as plain pytrees: no shared references here, and it skips the graph traversal
# that costs graph mode ~15% per call (the Flax performance guide's advice). Their buffers are
# donated and updated in place (~6% at batch 512): arrays taken from the model or optimizer
# before a call are invalid after it; copy them first if you need them.
jit_train_step = nnx.jit(
    train_step, graph=False, static_argnames="label_smoothing", donate_argnums=(0, 1)
)


class Interrupted(UserError):
    """SIGINT or SIGTERM stopped training after a checkpoint of the current step was saved."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class StopSignals:
    """While active, SIGINT and SIGTERM only set `signum`; the loop saves and stops cleanly."""

    def __init__(self):
        self.signum = 0
        self._previous = {}

    def __enter__(self) -> StopSignals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.signum = signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@jax.jit
def _all_finite(tree: Any) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def all_finite(tree: Any) -> bool:
    """Whether every value of every array is finite (checked on the devices)."""
    return bool(parallel.to_host(_all_finite(tree)))


def progress_of(step: int, num_batches: int, config: ml_collections.ConfigDict) -> dict[str, int]:
    """Where the data order stands after `step` updates: epoch, index of the next batch."""
    return {
        "step": step,
        "epoch": step // num_batches,
        "index": step % num_batches,
        "num_batches": num_batches,
        "batch_size": config.batch_size,
        "seed": config.seed,
    }


@functools.lru_cache(maxsize=8)
def make_train_chunk(
    graphdef: nnx.GraphDef,
    batch_size: int,
    image_shape: tuple[int, int] = (28, 28),
    label_smoothing: float = 0.0,
    max_shift: int = 0,
    flip: bool = False,
    fused: bool = True,
    mesh: jax.sharding.Mesh | None = None,
) -> Callable[..., tuple[Any, Metrics]]:
    """Compile `count` AdamW steps into one call: the default, fastest training path.

    With `fused=False` each call runs one step (the host loops): XLA's CPU backend runs
    convolutions inside a loop body about 10x slower than at top level, so the CNN uses it.

    Batches are picked from the epoch's order, normalised (and augmented, when asked) on the
    device inside the loop; the state buffers are donated (updated in place) and only the last
    step's metrics come back. `count` is a traced loop bound, so chunks of any length share one
    compilation. Augmentation draws from `fold_in(aug_key, step)`, so a resumed run repeats it.
    On a `mesh`, each batch is split along its `data` axis and XLA adds the collectives.
    """

    @functools.partial(jax.jit, donate_argnums=0)
    def train_chunk(state, images, labels, order, start, count, first_step=0, aug_key=None):
        def body(i, carry):
            model, optimizer = nnx.merge(graphdef, carry[0])
            if order is None:  # a batch fed from the host (Grain): the step's own images
                x, y = input_pipeline.normalize(images), labels
            else:
                x, y = input_pipeline.batch_at(images, labels, order, start + i, batch_size, mesh)
            if max_shift or flip:
                key = jax.random.fold_in(aug_key, first_step + i)
                x = input_pipeline.augment(x, key, image_shape, max_shift, flip)
            # Only the last step's metrics leave the chunk, so only it computes the gradient
            # norm (1.29x faster at batch 32).
            log = i == count - 1 if fused else True
            metrics = train_step(model, optimizer, x, y, label_smoothing, log)
            return nnx.state((model, optimizer)), metrics

        if not fused:  # exactly one step, no loop around it
            return body(0, (state, None))
        shapes = jax.eval_shape(lambda s: body(0, (s, None))[1], state)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        return jax.lax.fori_loop(0, count, body, (state, zeros))

    return train_chunk


def chunk_for(
    graphdef: nnx.GraphDef,
    config: ml_collections.ConfigDict,
    image_shape: tuple[int, int],
    mesh: jax.sharding.Mesh,
) -> Callable[..., tuple[Any, Metrics]]:
    """The compiled chunk a config's recipe needs (label smoothing, augmentation) on a mesh."""
    return make_train_chunk(
        graphdef,
        config.batch_size,
        image_shape,
        config.label_smoothing,
        config.augment.max_shift,
        config.augment.flip,
        config.fused_steps,
        mesh,
    )


def is_log_step(step: int, config: ml_collections.ConfigDict) -> bool:
    return step == 1 or step % config.log_every == 0 or step == config.steps


def eval_period(config: ml_collections.ConfigDict, batches_per_epoch: int) -> int:
    """Steps between test-set evaluations: `eval_every`, or an epoch when it is 0."""
    return config.eval_every or batches_per_epoch


def is_eval_step(step: int, config: ml_collections.ConfigDict, batches_per_epoch: int) -> bool:
    return step % eval_period(config, batches_per_epoch) == 0 or step == config.steps


def next_stop(step: int, config: ml_collections.ConfigDict, batches_per_epoch: int) -> int:
    """The next step where the host must look: a log, checkpoint or evaluation step, an
    epoch's end, the end."""
    if step == 0:
        return 1  # step 1 is logged (and compiles the chunk)
    periods = (
        config.log_every, config.checkpoint_every, batches_per_epoch,
        eval_period(config, batches_per_epoch),
    )  # fmt: skip
    return min(*[(step // every + 1) * every for every in periods], config.steps)


def augment_key(config: ml_collections.ConfigDict) -> jax.Array | None:
    """The augmentation stream's key, or None without augmentation (two compiles saved)."""
    if config.augment.max_shift or config.augment.flip:
        return jax.random.fold_in(jax.random.key(config.seed), AUGMENT_STREAM)
    return None


class Guard:
    """Stops training with one line when the loss or the parameters stop being finite."""

    def __init__(self, checkpoints: checkpoint_lib.Checkpoints, last_finite: int):
        self.checkpoints, self.last_finite = checkpoints, last_finite

    def stop(self, what: str, step: int) -> None:
        self.checkpoints.wait()
        kept = self.checkpoints.steps()
        raise UserError(
            f"{what} between steps {self.last_finite} and {step}; training stopped, the last "
            f"good checkpoint is {kept[-1] if kept else 'none'}; lower --learning_rate and retry"
        )

    def row(self, step: int, metrics: Metrics) -> dict[str, float]:
        """The metrics of a logged step on the host, as one JSON-ready row."""
        row = {"step": step, **{k: float(v) for k, v in parallel.to_host(metrics).items()}}
        if not np.isfinite(row["loss"]):
            self.stop(f"the loss became {row['loss']}", step)
        self.last_finite = step
        return row

    def warm_up(self, model: nnx.Module, optimizer: nnx.Optimizer) -> None:
        """Compile the finiteness check and the save's state copy before training's clock."""
        all_finite(nnx.state(model, nnx.Param))
        checkpoint_lib.warm_up(model, optimizer)

    def save(self, step: int, pair: tuple[nnx.Module, nnx.Optimizer], state, progress) -> None:
        """Checkpoint the newest (donated-into) buffers, unless the parameters are no longer
        finite: then stop, the last good checkpoint kept."""
        nnx.update(pair, state)
        if not all_finite(nnx.state(pair[0], nnx.Param)):
            self.stop("the parameters became non-finite", step)
        self.checkpoints.save(step, *pair, progress)


def interrupted(
    signum: int, step: int, checkpoints: checkpoint_lib.Checkpoints, unfinished: str
) -> Interrupted:
    """The one line a signal ends a run with, once the checkpoint of `step` is on disk."""
    checkpoints.wait()
    return Interrupted(
        f"{signal.Signals(signum).name} at step {step}: checkpoint {step} saved in "
        f"{checkpoints.directory}{unfinished}; resume by running the same command with the "
        "same --workdir",
        signum,
    )


def fit(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    device_data: input_pipeline.DeviceData,
    config: ml_collections.ConfigDict,
    *,
    start_step: int,
    checkpoints: checkpoint_lib.Checkpoints,
    on_log: Callable[[dict[str, float]], None],
    on_eval: Callable[[int, nnx.Module], dict[str, float]] | None = None,
    signals: StopSignals | None = None,
    batches: Any = None,
) -> float:
    """Run updates start_step+1..config.steps in fused chunks; returns examples/sec.

    Metrics reach the host only at step 1, every `log_every` steps, each evaluation step
    (`on_eval(step, model)` adds the test metrics to its row) and the last step. The clock
    starts after the first (compiling) step and stops at `block_until_ready` on the final
    state; evaluations are not counted. Checkpoints: see `must_save`; on SIGINT/SIGTERM
    (`signals`) too. `batches` feeds the calls (default `DeviceBatches`).
    """
    d, per_epoch = device_data, device_data.batches_per_epoch
    model.train()  # dropout on, BatchNorm on batch statistics (no-ops for the MLP)
    graphdef, state = nnx.split((model, optimizer))
    train_chunk = chunk_for(graphdef, config, d.image_shape, d.mesh)
    aug_key, guard = augment_key(config), Guard(checkpoints, start_step)
    batches = batches or input_pipeline.DeviceBatches(d, config.seed, config.fused_steps)
    guard.warm_up(model, optimizer)
    clock, step, evaluating, deferred = None, start_step, 0.0, None
    with contextlib.ExitStack() as stack:
        signals = signals or stack.enter_context(StopSignals())
        while step < config.steps:
            stop = next_stop(step, config, per_epoch)
            for call in batches.chunks(step, stop):  # images, labels, order, index, count, first
                state, metrics = train_chunk(state, *call, aug_key)
            if deferred:  # the last stop's row, read while this chunk runs: no pipeline drain
                on_log(guard.row(*deferred))
            step, deferred = stop, None
            clock = clock or _clock_start(metrics, step)
            # A signal to any process stops all of them at the same step (saving is collective).
            signum = max(parallel.from_every_process(signals.signum))
            saving = must_save(step, signum, config, checkpoints)
            if not (saving or is_eval_step(step, config, per_epoch)):
                deferred = (step, metrics) if is_log_step(step, config) else None
                continue
            seconds, tested = _log(
                step, metrics, state, (model, optimizer), config, per_epoch, guard, on_log, on_eval
            )
            evaluating += seconds
            if saving or (tested and config.keep_best):  # each evaluated step may be the best
                progress = progress_of(step, per_epoch, config) | batches.state() | tested
                guard.save(step, (model, optimizer), state, progress)
            if signum:
                raise interrupted(signum, step, checkpoints, "")
    jax.block_until_ready(state)
    nnx.update((model, optimizer), state)
    model.eval()
    if clock is None or clock[1] == config.steps:  # nothing timed (e.g. killed after its end)
        return float("nan")
    return (config.steps - clock[1]) * d.batch_size / (time.perf_counter() - clock[0] - evaluating)


def must_save(step: int, signum: int, config, checkpoints: checkpoint_lib.Checkpoints) -> bool:
    """At the end, on a signal, and at each `checkpoint_every` step that the save policy allows
    (`Checkpoints.due`: none being written, the last one old enough)."""
    if step == config.steps or signum:
        return True
    return step % config.checkpoint_every == 0 and checkpoints.due(step)


def _clock_start(metrics: Metrics, step: int) -> tuple[float, int]:
    """The first call compiled: the clock starts once it is done."""
    jax.block_until_ready(metrics)
    return time.perf_counter(), step


def _log(step, metrics, state, pair, config, per_epoch, guard, on_log, on_eval) -> tuple:
    """Log the row of `step` when due, with the test metrics at an evaluation step (after
    training's own asynchronous work is done); returns the seconds spent evaluating and the
    test metrics (empty when not evaluated)."""
    evaluating = on_eval is not None and is_eval_step(step, config, per_epoch)
    if not (evaluating or is_log_step(step, config)):
        return 0.0, {}
    row = guard.row(step, metrics)
    if evaluating:
        jax.block_until_ready(state)
        began = time.perf_counter()
        nnx.update(pair, state)
        row |= on_eval(step, pair[0])
        pair[0].train()
    on_log(row)
    if not evaluating:
        return 0.0, {}
    return time.perf_counter() - began, {k: v for k, v in row.items() if k.startswith("test_")}
