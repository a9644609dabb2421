"""The loss, the train step and the training loop (sections 8 and 9).

`train_and_evaluate` (at the end) is the run `main.py` starts: set-up, the loop, the final
evaluation and the outputs, top to bottom. `train_step` is the one place a step is defined:
`jit_train_step` compiles it as the codelab's `nnx.jit` step, and `make_train_chunk` runs it K
times inside one compiled `fori_loop` (the default path). The loss and every metric come from
`task.per_example`; hyperparameters reach the step once, as the run's (frozen) config. Each
logged row is the mean of every metric over the steps since the row before, summed on the
device inside the chunks.
"""

from __future__ import annotations

import contextlib
import functools
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from fmnist_flax import (
    api,  # noqa: F401  (hands the template's parts to runtime.inference)
    datasets,
    evaluate,
    experiment,
    input_pipeline,
    task,
)
from fmnist_flax import config as config_lib
from fmnist_flax import optimizer as optimizer_lib
from fmnist_flax.model import create_model
from fmnist_flax.runtime import checkpoint as checkpoint_lib
from fmnist_flax.runtime import (
    compile_ahead,
    ema,
    ensemble,
    grain_pipeline,
    inference,
    metrics_writer,
    parallel,
    plugins,
    restore,
    run_config,
    stopping,
)
from fmnist_flax.runtime import workdir as workdir_lib
from fmnist_flax.runtime.ensemble import Ensemble
from fmnist_flax.runtime.errors import UserError
from fmnist_flax.runtime.registry import Registry
from fmnist_flax.runtime.schedule import Schedule, next_row, row_phase

Metrics = dict[str, jax.Array]
Config = ml_collections.FrozenConfigDict  # hashable: what the compiled steps are built for


def create_optimizer(model: nnx.Module, config: ml_collections.ConfigDict) -> nnx.Optimizer:
    """The config's Optax optimizer (AdamW by default, the codelab's) over the parameters."""
    if isinstance(model, Ensemble):
        return ensemble.member_optimizers(model, functools.partial(optimizer_lib.create, config))
    return _optimizer_program(Config(config))(model)


@functools.lru_cache(maxsize=8)
def _optimizer_program(config: Config) -> Callable[[nnx.Module], nnx.Optimizer]:
    """The optimizer made by one compiled program (eagerly, each of the state's zeros compiles
    on its own), kept for the next model of the same config: compiled once a structure."""
    tx = optimizer_lib.create(config)
    return nnx.jit(lambda model: nnx.Optimizer(model, tx, wrt=nnx.Param))


def create_train_state(
    config: ml_collections.ConfigDict,
    image_shape: tuple[int, int, int],
    num_classes: int,
    mesh: jax.sharding.Mesh,
    seed: int | None = None,
) -> tuple[nnx.Module, nnx.Optimizer]:
    """A fresh model and its optimizer, laid out on the mesh as `config.param_sharding` says."""
    model = create_model(config, image_shape, num_classes, seed)
    ema.attach(model, config.ema.decay)
    optimizer = create_optimizer(model, config)
    place_state(model, optimizer, mesh, config.param_sharding)
    return model, optimizer


def place_state(
    model: nnx.Module, optimizer: nnx.Optimizer, mesh: jax.sharding.Mesh, param_sharding: str
) -> None:
    """Lay a model and its optimizer out on the mesh (an Ensemble's split on a `member` axis)."""
    parallel.place_module((model, optimizer), mesh, param_sharding, isinstance(model, Ensemble))


def split_state(model: nnx.Module, optimizer: nnx.Optimizer) -> tuple[nnx.GraphDef, dict]:
    """The model and optimizer as a graph and their arrays as plain nested dicts, which a
    chunk takes and returns: a jitted call flattens plain dicts in C++, where `nnx.State`'s
    Variables call back into Python, a host cost that an accelerator's short steps expose."""
    graphdef, state = nnx.split((model, optimizer))
    return graphdef, nnx.to_pure_dict(state)


def refresh_hyperparams(
    model: nnx.Module, optimizer: nnx.Optimizer, config: ml_collections.ConfigDict
) -> None:
    """Put the config's values into a restored optimizer's injected hyperparameters (where
    values that differ between an ensemble's members live): a resume that accepted new values
    trains with them, not with the checkpoint's."""
    state = nnx.state(optimizer)
    injected = [(path, v) for path, v in nnx.to_flat_state(state) if "hyperparams" in path]
    if not injected:  # one model: its values are compiled into the step
        return
    fresh = dict(nnx.to_flat_state(nnx.state(create_optimizer(model, config))))
    for path, variable in injected:
        old = variable[...]
        variable[...] = jax.device_put(fresh[path][...].astype(old.dtype), old.sharding)
    nnx.update(optimizer, state)


def loss_fn(
    model: nnx.Module, x: jax.Array, y: jax.Array, config: Config, key: jax.Array | None = None
) -> tuple[jax.Array, Metrics]:
    """The batch's mean loss and the mean of every metric of `task.per_example`; a term may
    ask for the images, the model and `key` (`task.EXTRAS`; default: step 0's)."""
    key = task.step_key(config, 0) if key is None else key
    values = task.per_example(model(x), y, config, images=x, model=model, key=key)
    metrics = {name: jnp.mean(v) for name, v in values.items()}
    return metrics["loss"], metrics


def _accumulated(
    model: nnx.Module, xs: jax.Array, ys: jax.Array, config: Config, key: jax.Array | None
) -> tuple:
    """The mean gradient and metrics of the micro-batches along the leading axis of xs, ys,
    computed one micro-batch at a time (a scan), so only one batch's activations are alive.
    Micro-batch i's key is `key` folded with i."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, rest, x, y, i):
        module = nnx.merge(graphdef, params, rest)  # BatchNorm statistics, dropout's stream
        folded = None if key is None else jax.random.fold_in(key, i)
        value, metrics = loss_fn(module, x, y, config, folded)
        return value, (metrics, nnx.split(module, nnx.Param, ...)[2])

    grad = jax.value_and_grad(loss, has_aux=True)
    (_, (metrics, rest)), grads = grad(params, rest, xs[0], ys[0], 0)

    def micro(carry, batch):
        rest, grads, metrics = carry
        (_, (more, rest)), more_grads = grad(params, rest, *batch)
        return (
            rest,
            jax.tree.map(jnp.add, grads, more_grads),
            jax.tree.map(jnp.add, metrics, more),
        ), None

    micro_batches = (xs[1:], ys[1:], jnp.arange(1, len(xs)))
    (rest, grads, metrics), _ = jax.lax.scan(micro, (rest, grads, metrics), micro_batches)
    nnx.update(model, rest)
    return jax.tree.map(lambda g: g / len(xs), grads), {k: v / len(xs) for k, v in metrics.items()}


UpdateHook = Callable[[nnx.Module, nnx.Optimizer, Config], None]
# Run inside the compiled step after each optimizer update, in the order added, for the runs
# that import the module adding them; the EMA's update (`ema.update`) runs after them all, so
# it averages the parameters they leave. Keyed by the hook's module and name.
UPDATE_HOOKS = Registry("update hook")


def after_update(hook: UpdateHook) -> UpdateHook:
    """Decorator: run `hook(model, optimizer, config)` after each optimizer update, inside the
    compiled step (a weight clamp, a norm constraint); it changes the model in place. Add it
    before training starts (from a module of `config.imports`): compiled steps keep theirs."""
    return UPDATE_HOOKS.add(hook)


# hook(step, metrics, run) -> True to end the run (an early stop), called after each evaluation
# in training with (a copy of) its `test_*` metrics and the run (its model, dataset and config),
# for the runs that import the module adding it; what it adds to `metrics` must be a number
# under a name of its own (`plugins.after_evaluation` checks each call).
EvaluationHook = Callable[[int, dict[str, float], experiment.Run], bool | None]
AFTER_EVALUATION = Registry("after-evaluation hook")
STOPPED_AT = "stopped_at"  # the progress and summary entry of a step where a hook ended the run


def after_evaluation(hook: EvaluationHook) -> EvaluationHook:
    """Decorator: call `hook(step, metrics, run)` after each evaluation during training; what it
    adds to `metrics` (`val_loss`) is logged and saved with them. A True return ends the run
    there, saved, said in one line and its outputs written; the same command again does not
    train past it. A hook that fails stops the run in one line naming it, the steps since the
    last save saved first."""
    return AFTER_EVALUATION.add(hook)


def train_step(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    x: jax.Array,
    y: jax.Array,
    config: Config,
    log: bool | jax.Array = True,
) -> Metrics:
    """One optimizer update in place; returns `loss_fn`'s metrics and the gradient's L2 norm.

    With `config.optimizer.accumulate` = K > 1, x and y hold K micro-batches (K, B, ...) whose
    mean gradient makes the one update. The norm is one more pass over every gradient, so
    inside a fused chunk it is computed only when `log` (the chunk's last step) holds. The
    update hooks (`after_update`) run after the update. Called as is, every operation is
    dispatched from Python (the codelab's eager baseline).
    """
    key = task.step_key(config, optimizer.step[...])
    if config.optimizer.accumulate > 1:
        grads, metrics = _accumulated(model, x, y, config, key)
    else:
        (_, metrics), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, x, y, config, key)
    optimizer.update(model, grads)
    for hook in (*UPDATE_HOOKS.active(config.imports).values(), ema.update):
        hook(model, optimizer, config)
    if log is True:
        metrics["grad_norm"] = optax.tree.norm(grads)
    else:
        metrics["grad_norm"] = jax.lax.cond(log, optax.tree.norm, _zero_norm, grads)
    return metrics


def _zero_norm(grads: nnx.State) -> jax.Array:
    return jnp.zeros((), jnp.float32)


# The same step, compiled once for fixed shapes. Tree mode (graph=False) treats the model and
# optimizer as plain pytrees: no shared references here, and it skips the graph traversal
# that graph mode pays at every call (the Flax performance guide's advice). Their buffers are
# donated and updated in place, with no copy of the state: arrays taken from the model or optimizer
# before a call are invalid after it; copy them first if you need them.
jit_train_step = nnx.jit(train_step, graph=False, static_argnames="config", donate_argnums=(0, 1))


def chunk_steps(
    graphdef: nnx.GraphDef,
    config: Config,
    image_shape: tuple[int, int, int],
    mesh: jax.sharding.Mesh | None = None,
    schedule: Schedule | None = None,
) -> Callable[..., tuple[Any, Metrics, Metrics]]:
    """`steps(state, sums, order, aug_key, *, images, labels, start, count, first_step,
    cadence)`: `count` steps of the model whose state is `state` (`split_state`'s dicts) in a
    `fori_loop` (with `config.fused_steps=False`, exactly one step). Batches are picked from
    the epoch's order (no order: steps start.. of a host-fed block), normalised (and augmented,
    when asked) on the device. Augmentation draws from `fold_in(aug_key, step)`, so a resumed
    run repeats it.

    Each step where a row is written (`next_row` of the `cadence`, the schedule's)
    ends one: its sums and gradient norm go to the next slot of the returned rows (a last
    axis of `schedule.rows_per_call`) and the sums start again from zero. With no schedule, a
    row ends at the call's last step."""
    batch_size = config.batch_size
    accumulate = config.optimizer.accumulate
    max_shift = config.augment.max_shift
    flip = config.augment.flip
    fused = config.fused_steps
    step_fn = ensemble.step_for(train_step, config)
    slots = schedule.rows_per_call if schedule is not None else 1

    def steps(state, sums, order, aug_key, *, images, labels, start, count, first_step, cadence):
        def body(i, carry):
            state, sums, rows, slot, phase = carry
            model, opt = nnx.merge(graphdef, state)

            def batch(order, aug_key):
                if order is None:  # step i of a block of batches fed from the host (Grain)
                    x, y = images[start + i], labels[start + i]
                    x = input_pipeline.normalize(x).reshape(*y.shape, *image_shape)
                else:
                    x, y = input_pipeline.batch_at(
                        images,
                        labels,
                        order,
                        start + i,
                        batch_size,
                        image_shape,
                        mesh,
                        accumulate,
                    )
                if max_shift or flip:
                    key = jax.random.fold_in(aug_key, first_step + i)
                    x = input_pipeline.augment(x, key, max_shift, flip)
                return x, y

            x, y = ensemble.batch_for(batch, order, aug_key)
            if schedule is None:
                ends_row = i == count - 1
            else:
                ends_row, phase = next_row(first_step + i + 1, phase, cadence)
            # Only a row's last step computes the gradient norm (a further pass over every
            # gradient, which small batches feel).
            metrics = step_fn(model, opt, x, y, config, ends_row if fused else True)
            sums = {name: total + metrics[name] for name, total in sums.items()}
            row = sums | {"grad_norm": metrics["grad_norm"]}
            rows = jax.tree.map(
                lambda kept, new: jnp.where(ends_row, kept.at[..., slot].set(new), kept), rows, row
            )
            sums = jax.tree.map(lambda total: jnp.where(ends_row, 0, total), sums)
            state = nnx.to_pure_dict(nnx.state((model, opt)))
            return state, sums, rows, slot + ends_row, phase

        shapes = sums | {"grad_norm": sums["loss"]}  # every row value has a metric's shape
        rows = jax.tree.map(lambda s: jnp.zeros((*s.shape, slots), jnp.float32), shapes)
        phase = jnp.zeros(2, jnp.int32) if schedule is None else row_phase(first_step, cadence)
        carry = (state, sums, rows, jnp.int32(0), phase)
        # Without config.fused_steps exactly one step, no loop around it.
        state, sums, rows, *_ = (
            body(0, carry) if not fused else jax.lax.fori_loop(0, count, body, carry)
        )
        return state, sums, rows

    return steps


@functools.lru_cache(maxsize=8)
def make_train_chunk(
    graphdef: nnx.GraphDef,
    config: Config,
    image_shape: tuple[int, int, int],
    mesh: jax.sharding.Mesh | None = None,
    schedule: Schedule | None = None,
) -> Callable[..., tuple[Any, Metrics, Metrics]]:
    """Compile `count` steps (`chunk_steps`) into one call: the default, fastest training path.

    With `config.fused_steps=False` each call runs one step (the host loops): XLA's CPU backend
    runs convolutions inside a loop body far slower than at top level, so the CNN uses it.

    The state buffers are donated (updated in place). `sums` (every metric summed since the
    last logged row) goes in and comes out with this call's steps added; the rows its steps
    ended come out too. `count` is a traced loop bound, so chunks of any length share one
    compilation; with a `schedule`, `cadence` is its `cadence` (an argument, so schedules
    that differ in steps or rows share it too). On a `mesh`, each batch is split along its
    `data` axis and XLA adds the collectives.
    """
    steps = chunk_steps(graphdef, config, image_shape, mesh, schedule)
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()

    @functools.partial(jax.jit, donate_argnums=0)
    def train_chunk(
        state, sums, images, labels, order, start, count, first_step=0, aug_key=None, cadence=None
    ):
        run = functools.partial(
            steps,
            images=images,
            labels=labels,
            start=start,
            count=count,
            first_step=first_step,
            cadence=cadence,
        )
        return ensemble.in_passes(run, config, platform)(state, sums, order, aug_key)

    return train_chunk


def zero_sums(
    model: nnx.Module, config: Config, image_shape: tuple[int, int, int], mesh: jax.sharding.Mesh
) -> Metrics:
    """A zero for each metric `loss_fn` returns, where a logged row's sums start: replicated on
    `mesh`, as a chunk returns its sums, so a chunk called with either runs one compilation."""
    x = jax.ShapeDtypeStruct((config.batch_size, *image_shape), jnp.float32)
    y = jax.ShapeDtypeStruct((config.batch_size,), jnp.int32)
    shapes = ensemble.shapes_per_member(lambda m, x, y: loss_fn(m, x, y, config)[1], model, x, y)
    zeros = {name: np.zeros(s.shape, s.dtype) for name, s in shapes.items()}
    return jax.device_put(zeros, parallel.replicated(mesh))


def training_batches(
    config: ml_collections.ConfigDict,
    dataset: datasets.Dataset,
    device_data: input_pipeline.DeviceData,
    resumed: dict[str, Any],
    start_step: int,
) -> Any:
    """What feeds training from `start_step` on: the Grain pipeline (its iterator where the
    checkpoint left it) or the device pipeline."""
    if config.input_pipeline != "grain":
        return input_pipeline.DeviceBatches(device_data, config)
    source = grain_pipeline.train_source(dataset)
    return grain_pipeline.from_config(
        config, source, device_data.mesh, resumed.get("data_iterator"), start_step
    )


def warm_start(
    model: nnx.Module, config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh
) -> tuple[nnx.Optimizer, int]:
    """Load the model of `config.init_from` (WORKDIR or WORKDIR:STEP) into `model`: its
    parameters and BatchNorm statistics, shapes checked in one line; returns a fresh
    optimizer for it and the step it was loaded from."""
    workdir, step, member = experiment.parse_init_from(config.init_from)
    source, used, _, _ = inference.restore_model(
        workdir, step, flag="--init_from", member=member, imports=False
    )
    source = ensemble.from_one_model(source, model, config.init_from, workdir)
    learned = nnx.Any(nnx.Param, nnx.BatchStat)
    loaded = nnx.state(source, learned)
    restore.check_shapes(
        nnx.state(model, learned),
        loaded,
        f"--init_from={config.init_from}",
        advice="a warm start needs the same model fields and number of classes",
    )
    nnx.update(model, loaded)
    optimizer = create_optimizer(model, config)
    place_state(model, optimizer, mesh, config.param_sharding)
    parallel.say(f"initialised from {workdir}, step {used}: its parameters, a fresh optimizer")
    return optimizer, used


def ema_test_metrics(run: experiment.Run, model: nnx.Module) -> dict[str, float]:
    """The test metrics of the model's EMA (`ema.averaged`), as test_ema_loss, ...: {} when
    the run keeps none."""
    if not run.config.ema.decay:
        return {}
    return ema_columns(experiment.evaluate_test(run, ema.averaged(model)))


def ema_columns(full: dict[str, Any]) -> dict[str, float]:
    """An evaluation of the EMA as a row's columns: test_ema_loss, test_ema_accuracy, ..."""
    tested = experiment.test_metrics(full).items()
    return {ema.TEST_PREFIX + k.removeprefix("test_"): v for k, v in tested}


def restore_train_state(
    config: ml_collections.ConfigDict,
    dataset: datasets.Dataset,
    mesh: jax.sharding.Mesh,
    checkpoints: checkpoint_lib.Checkpoints,
    schedule: Schedule,
    accept_config_change: bool,
) -> tuple[nnx.Module, nnx.Optimizer, int, dict[str, Any], list[dict[str, Any]]]:
    """A fresh model and optimizer, then the newest intact checkpoint (or the model of
    --init_from) restored into them; returns them, their step, the checkpoint's progress item
    (with `init_from_step`, the step --init_from loaded) and the config's changes since it."""
    model, optimizer = create_train_state(config, dataset.image_shape, dataset.num_classes, mesh)
    changes = experiment.check_config_changes(checkpoints, config, dataset, accept_config_change)
    checkpoints.metadata["changes"] = {"changes": changes}
    optimizer_changed = any(c["field"].startswith(config_lib.OPTIMIZER_FIELDS) for c in changes)
    start_step, resumed = restore.resume(
        checkpoints,
        model,
        optimizer,
        schedule.progress(0),
        optimizer_changed,
        # The EMA's debiasing counts the optimizer's updates: update 1 copies the parameters.
        "the EMA starts again from the parameters" if config.ema.decay else "",
    )
    if start_step:
        refresh_hyperparams(model, optimizer, config)
    if config.keep_best and jax.process_count() == 1:  # processes could not agree to move it
        restore.check_best(checkpoints, model, start_step)
    if not start_step and config.init_from:
        optimizer, resumed["init_from_step"] = warm_start(model, config, mesh)
    return model, optimizer, start_step, resumed, changes


def finished_summary(run: experiment.Run, end: int) -> dict[str, Any] | None:
    """The summary to return when the run's workdir already holds the run, to
    `config.steps` or to `end` where an after-evaluation hook ended it (saying so), else None.
    An unreadable summary.json (a kill while it was replaced is not one: it is written
    atomically), or one of a run stopped before its outputs were finished, is written again
    from the final checkpoint, with the training rate that one saved."""
    workdir, start_step, config = run.workdir, run.start_step, run.config
    summary = workdir_lib.read_json(workdir / workdir_lib.SUMMARY_FILE)
    if start_step == end and summary and summary.get("finished") is False:
        run.examples_per_sec = float(summary.get("train_examples_per_sec") or "nan")
        return None
    if start_step > config.steps or (start_step == end and summary):
        parallel.say(
            f"workdir {workdir} already holds step {start_step}; nothing to do for "
            + (
                f"--steps={config.steps} (pass a larger --steps to continue)"
                if end == config.steps
                else "it: an after-evaluation hook ended the run there (use a new --workdir)"
            )
        )
        return summary or {}
    return None


@functools.lru_cache(maxsize=8)
def test_program(graphdef: nnx.GraphDef, config: Config) -> Callable[..., list[tuple]]:
    """`outputs(state, images, labels, mask)`, compiled: `evaluate.evaluate_batches`'s outputs
    for a call of the test set of the model in `state` (`split_state`'s) and, with an EMA, of
    its EMA. One per model graph and config, so a call hashes neither."""

    @jax.jit
    def outputs(state: Any, *call: jax.Array) -> list[tuple]:
        model, _ = nnx.merge(graphdef, state)
        model.eval()
        models = [model, ema.averaged(model)] if config.ema.decay else [model]
        return [evaluate.evaluate_batches(m, *call, config) for m in models]

    return outputs


class Evaluations:
    """The test-set evaluations during training, each of the newest state.

    The loop waits for one whose metrics something needs at once (a save, `keep_best`, an
    after-evaluation hook) and for the first unless `compile_ahead` compiled its program: its
    time is left out of the training rate (`run.eval_seconds`), and the model is brought up to
    date for the hooks. With `overlap` (an accelerator) the others are only queued on the
    devices between training's calls, on the test set kept there: the chip does not idle
    while the host looks, the metrics reach the host on the metrics writer's thread, and their
    time counts as training's."""

    def __init__(
        self, run: experiment.Run, model: nnx.Module, optimizer: nnx.Optimizer, overlap: bool
    ):
        self.run, self.model, self.optimizer = run, model, optimizer
        self.config = config = Config(run.config)
        self.test = experiment.test_set(run)
        self.classes = evaluate.num_classes(model, self.test[0], config)
        mesh = run.device_data.mesh
        # With `overlap`, the test set's calls placed on the devices once.
        self.resident = (
            list(evaluate.test_calls(*self.test, config.batch_size, mesh)) if overlap else None
        )
        self.compiled = False  # until `compile_ahead`, the first evaluation compiles `outputs`
        self.averaged: dict[str, float] = {}  # the EMA's metrics at the last one waited for
        self.outputs = test_program(split_state(model, optimizer)[0], config)
        self.hooks = AFTER_EVALUATION.active(config.imports)
        self.stopped_by: str | None = None  # the hook that ended the run, when one did
        metrics = (task.LOSS_TERMS, task.METRICS)  # a hook's best_metric needs a hook:
        run_config.check_best_metric(config, task.BUILT_IN, metrics, hooked=bool(self.hooks))

    def at(
        self, step: int, state: Any, writer: metrics_writer.MetricsWriter, saving: bool
    ) -> tuple[metrics_writer.Tested, UserError | None]:
        """The evaluation at `step` (`evaluate`) with what the run's after-evaluation hooks
        add, and a plug-in's failure there (the loop saves the step, then stops with it);
        `stopped_by` names a hook that asked to end the run at `step`."""
        wait = saving or self.config.keep_best or bool(self.hooks)
        tested = {}
        try:
            tested = self.evaluate(step, state, writer, wait)
            if self.hooks:  # `tested` was waited for
                taken = writer.sums.keys()  # the training metrics' names
                added, self.stopped_by = plugins.after_evaluation(
                    self.hooks, step, tested, self.run, taken
                )
                tested |= added
        except plugins.PluginFailed as failure:
            return tested, failure
        return tested, self.run.checkpoints.unranked(step, tested)

    def compile_ahead(self, state: Any) -> None:
        """Compile the evaluation of the resident test set (an accelerator's), on the thread
        compiling ahead: no evaluation during training then waits for its program."""
        if self.resident:
            self.outputs.lower(state, *self.resident[0]).compile()
            self.compiled = True

    def evaluate(
        self, step: int, state: Any, writer: metrics_writer.MetricsWriter, wait: bool
    ) -> metrics_writer.Tested:
        """The test metrics of `state` at `step` (the EMA's among them); or, where the loop
        does not need them now (`wait` False) and they may overlap training (`overlap`, not
        the first), a function that waits for them."""
        wait = wait or self.resident is None or not self.compiled
        self.compiled = True
        if wait:
            jax.block_until_ready(state)  # training's own asynchronous work is done
            writer.wait_timed()  # the rows before are timed before the evaluation
            began = time.perf_counter()
            nnx.update((self.model, self.optimizer), state)  # what the hooks see
        images, labels = self.test
        mesh = self.run.device_data.mesh
        calls = self.resident or evaluate.test_calls(images, labels, self.config.batch_size, mesh)
        pending = [self.outputs(state, *call) for call in calls]

        def metrics() -> dict[str, float]:
            per_model = (
                zip(*pending, strict=True) if pending else [()] * (1 + bool(self.config.ema.decay))
            )
            full, *of_ema = [
                evaluate.summarize(list(each), labels, self.config, self.classes)
                for each in per_model
            ]
            averaged = ema_columns(of_ema[0]) if of_ema else {}
            if wait:
                self.run.evaluation, self.averaged = (step, full), averaged
            return experiment.test_metrics(full) | averaged

        if not wait:
            return metrics
        tested = metrics()
        self.run.eval_seconds += time.perf_counter() - began
        return tested


def finish(
    run: experiment.Run,
    extensions: Sequence[experiment.Extension],
    stop: stopping.Stop,
    evaluations: Evaluations,
) -> dict[str, Any]:
    """After training: the final save on disk and summary.json with the training rate, the
    training table, the final evaluation, summary.json again, the extensions' tables and
    figures, report/ and the finished summary; returns it. A signal stops it at once, with its
    line (`stop.after_training`): the same command finishes the outputs. `evaluations`: the
    training's, whose last one waited for gives the EMA's test metrics."""
    steps = run.config.steps
    if evaluations.stopped_by and run.summary.get(STOPPED_AT, steps) < steps:
        stopped = run.summary[STOPPED_AT]
        parallel.say(
            f"{evaluations.stopped_by} ended the run at step {stopped} of {steps}: an early "
            "stop, saved at that step"
        )
    clock = run.clock
    clock.stage("checkpoint waits")
    run.checkpoints.wait()
    with stop.after_training(run.summary.get(STOPPED_AT, run.config.steps), run.checkpoints):
        experiment.write_summary(run, None, finished=False)
        clock.stage("final evaluation")
        experiment.show_training(run)
        # summary.json's EMA test metrics: the last step's, or evaluated now if none was.
        averaged = evaluations.averaged
        run.summary |= averaged if run.evaluation else ema_test_metrics(run, run.model)
        evaluation = experiment.evaluate_model(run, extensions)
        experiment.write_summary(run, evaluation, finished=False)
        clock.stage("demonstrations")
        for extension in extensions:
            stop.look()
            extension.after_training(run)
        stop.look()
        clock.stage("report")
        return experiment.write_outputs(run, evaluation)


def train_and_evaluate(
    config: ml_collections.ConfigDict,
    workdir: str | pathlib.Path | None,
    extensions: Sequence[experiment.Extension] = (),
    *,
    accept_config_change: bool = False,
    devices: list[jax.Device] | None = None,
    started: float | None = None,
) -> dict[str, Any]:
    """Train (resuming from the workdir's checkpoints), evaluate and write every output.

    Writes summary.json, metrics.jsonl, tensorboard/, checkpoints/ and report/ in the workdir
    and returns the summary. SIGINT and SIGTERM stop it with a saved checkpoint and one line,
    whenever they come; resuming with values that change the computation needs
    `accept_config_change`. `devices`: what to train on (default: every device). `started`:
    the time.perf_counter() reading at which the command started, for summary.json's
    `stage_seconds` (the time before this call is its start-up).
    """
    with contextlib.ExitStack() as cleanup:
        stop = cleanup.enter_context(stopping.Stop())
        workdir, dataset, device_data, clock = experiment.prepare(
            config, workdir, cleanup, devices, step=train_step, started=started
        )
        # The report's figures are drawn on a thread, which imports matplotlib now.
        painter = experiment.start_painter(config, cleanup)
        mesh = device_data.mesh
        schedule = Schedule(config, device_data.batches_per_epoch, mesh.devices.flat[0].platform)

        # The state: the newest intact checkpoint's, the model of --init_from's, or fresh.
        clock.stage("model")
        checkpoints = checkpoint_lib.Checkpoints(
            workdir,
            max_to_keep=config.max_to_keep,
            keep_best=config.keep_best,
            metadata={"config": config.to_dict(), "dataset": dataset.info()},
            min_interval_secs=config.checkpoint_min_interval_secs,
        )
        cleanup.callback(checkpoints.close)
        cleanup.callback(checkpoints.wait)  # runs first: the last save is on disk before closing
        model, optimizer, start_step, resumed, changes = restore_train_state(
            config, dataset, mesh, checkpoints, schedule, accept_config_change
        )
        init_step = resumed.get("init_from_step")  # a resume keeps it in its progress
        batches = training_batches(config, dataset, device_data, resumed, start_step)
        run = experiment.Run(
            config,
            workdir,
            dataset,
            device_data,
            checkpoints,
            model,
            optimizer,
            start_step,
            painter=painter,
            clock=clock,
        )
        run.summary["config_changes"] = changes
        if config.init_from:
            run.summary |= {"init_from": config.init_from, "init_from_step": init_step}
        end = resumed.get(STOPPED_AT, config.steps)  # where an after-evaluation hook stopped it
        if (summary := finished_summary(run, end)) is not None:
            return summary
        stop.before_training()

        # The loop: compiled chunks of steps (`make_train_chunk`) between the steps where the
        # host looks (`schedule.next_stop`). The state lives in `state` (donated, updated in
        # place); `model` and `optimizer` are brought up to date only to evaluate or save.
        model.train()  # dropout on, BatchNorm on batch statistics (no-ops for the MLP)
        graphdef, state = split_state(model, optimizer)
        frozen = Config(config)
        train_chunk = make_train_chunk(graphdef, frozen, dataset.image_shape, mesh, schedule)
        zeros = zero_sums(model, frozen, dataset.image_shape, mesh)
        aug_key = input_pipeline.augment_key(config)
        # Every call's last arguments: the augmentation's key, where rows end.
        last = (aug_key, jax.device_put(schedule.cadence, parallel.replicated(mesh)))
        evaluations = Evaluations(run, model, optimizer, overlap=schedule.accelerated)
        # Its first programs compile on a thread while the set-up tables and extensions run.
        first_call = batches.first_call(start_step)
        ahead = compile_ahead.start(
            train_chunk,
            state,
            zeros,
            last,
            first_call,
            model,
            optimizer,
            stop,
            also=(functools.partial(evaluations.compile_ahead, state),),
        )
        clock.stage("set-up tables")
        experiment.show_setup(run)
        clock.stage("demonstrations")
        for extension in extensions:
            extension.before_training(run)
        clock.stage("compilation")
        ahead.join()
        # The set-up's figures do not share the host with training (drawn beside the loop, they
        # slow an accelerator's host-bound loop too).
        run.figures_drawn()
        stop.before_training()
        _, state = split_state(model, optimizer)  # as the extensions left it
        step = start_step
        timed_from = None  # (time, step) once the first call, which compiles, is done
        trained = None  # (time, eval_seconds) when the last step is computed, before its save
        # Examples/sec counts every model's: an ensemble of 8 at 1x does the work of 8 runs.
        per_step = device_data.examples_per_step * config.ensemble.size
        writer = metrics_writer.MetricsWriter(
            workdir,
            config,
            start_step,
            per_step,
            checkpoints,
            zeros=zeros,
            saved_row=resumed.get("row"),
            stop=stop,
            schedule=schedule,
            loss_terms=tuple(task.LOSS_TERMS.active(config.imports)),
        )
        clock.stage("training")
        began = time.perf_counter()
        with writer:
            while step < end:
                # A call runs at most about half a second (`stop.steps_per_call`, timed), and
                # the host looks for a signal after each, not only at the next logged step.
                next_stop = schedule.next_stop(step, stop.steps_per_call, checkpoints)
                # Each call: images, labels, order, first batch index, count, first step.
                for call in batches.chunks(step, next_stop):
                    state, writer.sums, rows = train_chunk(state, writer.sums, *call, *last)
                    if (early := stop.early_step(batches.next, rows)) is not None:
                        next_stop = early  # a signal: saved at this step, a row's sums too
                        break
                step = next_stop
                if timed_from is None:  # the first call compiled: timed once it is done
                    jax.block_until_ready(rows)
                    timed_from = (time.perf_counter(), step)
                    clock.move(timed_from[0] - began, "training", "compilation")
                if step == end:  # training's time ends here; the last save's is not its
                    jax.block_until_ready(state)
                    trained = (time.perf_counter(), run.eval_seconds)
                writer.check()  # a row written since the last stop had a non-finite loss

                # Where the host looks. A signal to any process stops all of them at the same
                # step (saving is collective).
                signum = stop.requested
                saving = schedule.saves(step, signum, checkpoints) or step == end
                tested, failed = {}, None
                if schedule.evaluates(step):
                    # Waited for where its metrics are needed now; else queued on the devices.
                    # A plug-in's failure: the steps since the last save are saved first.
                    tested, failed = evaluations.at(step, state, writer, saving)
                    if evaluations.stopped_by:
                        end = step  # an early stop: saved below, and kept on resume
                # Written by the writer's thread while the next chunks run.
                writer.write(step, rows, run.eval_seconds, tested)

                # Save: at the end, on a signal, when due; with keep_best, at each evaluation;
                # before a plug-in's failure stops the run.
                if saving or step == end or (tested and config.keep_best) or failed:
                    writer.flush()
                    progress = schedule.progress(step) | batches.state() | writer.state()
                    if step == end < config.steps:
                        progress[STOPPED_AT] = step
                    if init_step is not None:
                        progress["init_from_step"] = init_step
                    stopping.save_if_finite(
                        checkpoints, step, model, optimizer, state, progress | tested, failed
                    )
                if failed:
                    raise stop.failed(failed, step, checkpoints)
                # Stop on a signal, the checkpoint of this step saved.
                if signum:
                    raise stop.interrupted(signum, step, checkpoints)

        jax.block_until_ready(state)
        nnx.update((model, optimizer), state)
        model.eval()
        if timed_from is not None and timed_from[1] < step:  # else nothing was timed
            trained = trained or (time.perf_counter(), run.eval_seconds)  # a hook's early stop
            seconds = trained[0] - timed_from[0] - trained[1]
            run.examples_per_sec = (step - timed_from[1]) * per_step / seconds
        clock.move(run.eval_seconds, "training", "evaluations")
        if end < config.steps:
            run.summary[STOPPED_AT] = end
        return finish(run, extensions, stop, evaluations)
