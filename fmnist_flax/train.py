"""Optimizer, the compiled train step, and the loop that runs every stage (sections 6, 8, 9)."""

from __future__ import annotations

import contextlib
import functools
import signal
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

from fmnist_flax import benchmark, data, evaluate, parallel, report, tables
from fmnist_flax import checkpoint as checkpoint_lib
from fmnist_flax import config as config_lib
from fmnist_flax import workdir as workdir_lib
from fmnist_flax.errors import UserError
from fmnist_flax.model import create_model
from fmnist_flax.tables import Table

Metrics = dict[str, jax.Array]
METRIC_NAMES = ("loss", "accuracy", "grad_norm")  # what train_step_eager returns
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
    config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, seed: int | None = None
) -> tuple[nnx.Module, nnx.Optimizer]:
    """A fresh model and its optimizer, laid out on the mesh as `config.param_sharding` says."""
    model = create_model(config, seed)
    optimizer = create_optimizer(model, config)
    parallel.place_module((model, optimizer), mesh, config.param_sharding)
    return model, optimizer


def loss_with_metrics(
    model: nnx.Module, x: jax.Array, y: jax.Array, label_smoothing: float = 0.0
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean softmax cross-entropy (labels smoothed when asked); batch accuracy as aux."""
    logits = model(x)
    if label_smoothing:
        targets = optax.smooth_labels(jax.nn.one_hot(y, logits.shape[-1]), label_smoothing)
        loss = optax.softmax_cross_entropy(logits, targets).mean()
    else:
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, axis=-1) == y)}


def loss_fn(model: nnx.Module, x: jax.Array, y: jax.Array) -> jax.Array:
    """The scalar loss `nnx.grad` differentiates."""
    return loss_with_metrics(model, x, y)[0]


def apply_gradients(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    x: jax.Array,
    y: jax.Array,
    label_smoothing: float = 0.0,
) -> tuple[jax.Array, jax.Array, nnx.State]:
    """One AdamW update in place; returns the loss, the batch accuracy and the gradients."""
    (loss, aux), grads = nnx.value_and_grad(loss_with_metrics, has_aux=True)(
        model, x, y, label_smoothing
    )
    optimizer.update(model, grads)
    return loss, aux["accuracy"], grads


def train_step_eager(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    x: jax.Array,
    y: jax.Array,
    label_smoothing: float = 0.0,
) -> Metrics:
    """One AdamW update in place; returns loss, batch accuracy and the gradient's L2 norm.

    Called as is, every operation is dispatched from Python (the codelab's eager baseline).
    """
    loss, accuracy, grads = apply_gradients(model, optimizer, x, y, label_smoothing)
    return {"loss": loss, "accuracy": accuracy, "grad_norm": optax.tree.norm(grads)}


# The same step, compiled once for fixed shapes. Tree mode (graph=False) treats the model and
# optimizer as plain pytrees: no shared references here, and it skips the graph traversal
# that costs graph mode ~15% per call (the Flax performance guide's advice). Their buffers are
# donated and updated in place (~6% at batch 512): arrays taken from the model or optimizer
# before a call are invalid after it; copy them first if you need them.
train_step = nnx.jit(
    train_step_eager, graph=False, static_argnames="label_smoothing", donate_argnums=(0, 1)
)


@nnx.jit
def _gradient_check(model, x, y, learning_rate):
    grads_only = nnx.grad(loss_fn)(model, x, y)
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    # The codelab's hand-written SGD step: a new parameter tree, the model left untouched.
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    stepped = jax.tree.map(lambda p, g: p - learning_rate * g, params, grads)
    loss_after = loss_fn(nnx.merge(graphdef, stepped, rest), x, y)
    scalars = {
        "loss": loss,
        "grad_norm": optax.tree.norm(grads),
        "grad_vs_value_and_grad": optax.tree.norm(jax.tree.map(jnp.subtract, grads, grads_only)),
        "loss_after_one_sgd_step": loss_after,
    }
    return grads, scalars


def gradient_check(
    model: nnx.Module, x: jax.Array, y: jax.Array, learning_rate: float
) -> tuple[Table, dict[str, Any]]:
    """Section 6: `nnx.grad` and `nnx.value_and_grad` agree and mirror the parameter tree.

    Compiled as one program, norms included: the codelab runs these eagerly, which here costs
    seconds of op-by-op compilation and shows nothing more.
    """
    # On a copy in eval mode: BatchNorm statistics and dropout's RNG state must stay as they
    # are, or a resumed run would not repeat the uninterrupted one.
    probe = nnx.clone(model)
    probe.eval()
    grads, scalars = _gradient_check(probe, x, y, learning_rate)
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
            x, y = data.batch_at(images, labels, order, start + i, batch_size, mesh)
            if max_shift or flip:
                x = data.augment(x, jax.random.fold_in(aug_key, first_step + i), max_shift, flip)
            loss, accuracy, grads = apply_gradients(model, optimizer, x, y, label_smoothing)
            # Only the last step's metrics leave the chunk: the gradient norm, one more pass
            # over every gradient, is skipped on the others (1.29x faster at batch 32).
            grad_norm = jax.lax.cond(i == count - 1, optax.tree.norm, _zero_norm, grads)
            metrics = {"loss": loss, "accuracy": accuracy, "grad_norm": grad_norm}
            return nnx.state((model, optimizer)), metrics

        zeros = {name: jnp.zeros((), jnp.float32) for name in METRIC_NAMES}
        if not fused:  # exactly one step, no loop around it
            return body(0, (state, zeros))
        return jax.lax.fori_loop(0, count, body, (state, zeros))

    return train_chunk


def _zero_norm(grads: nnx.State) -> jax.Array:
    return jnp.zeros((), jnp.float32)


def chunk_for(
    graphdef: nnx.GraphDef, config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh
) -> Callable[..., tuple[Any, Metrics]]:
    """The compiled chunk a config's recipe needs (label smoothing, augmentation) on a mesh."""
    return make_train_chunk(
        graphdef,
        config.batch_size,
        config.label_smoothing,
        config.augment.max_shift,
        config.augment.flip,
        config.fused_steps,
        mesh,
    )


def is_log_step(step: int, config: ml_collections.ConfigDict) -> bool:
    return step == 1 or step % config.log_every == 0 or step == config.steps


def next_stop(step: int, config: ml_collections.ConfigDict, batches_per_epoch: int) -> int:
    """The next step where the host must look: a log or checkpoint step, an epoch's end, the end."""
    if step == 0:
        return 1  # step 1 is logged (and compiles the chunk)
    after = [
        (step // every + 1) * every
        for every in (config.log_every, config.checkpoint_every, batches_per_epoch)
    ]
    return min(*after, config.steps)


def train(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    device_data: data.DeviceData,
    config: ml_collections.ConfigDict,
    *,
    start_step: int,
    checkpoints: checkpoint_lib.Checkpoints,
    on_log: Callable[[dict[str, float]], None],
) -> float:
    """Run updates start_step+1..config.steps in fused chunks; returns examples/sec.

    Metrics reach the host only at step 1, every `log_every` steps and the last step. The clock
    starts after the first (compiling) step and stops at `block_until_ready` on the final state.
    Checkpoints are saved every `checkpoint_every` steps, at the end and on SIGINT/SIGTERM.
    """
    batch_size, per_epoch = device_data.batch_size, device_data.batches_per_epoch
    num_examples = len(device_data.train_labels)
    model.train()  # dropout on, BatchNorm on batch statistics (no-ops for the MLP)
    graphdef, state = nnx.split((model, optimizer))
    train_chunk = chunk_for(graphdef, config, device_data.mesh)
    aug_key = None  # built only when used: two more compiles at start-up otherwise
    if config.augment.max_shift or config.augment.flip:
        aug_key = jax.random.fold_in(jax.random.key(config.seed), AUGMENT_STREAM)
    last_finite = start_step

    def sync_objects() -> None:
        """Point model and optimizer at the newest (donated-into) state buffers."""
        nnx.update((model, optimizer), state)

    def stop_non_finite(what: str) -> None:
        checkpoints.wait()
        kept = checkpoints.steps()
        raise UserError(
            f"{what}; training stopped, the last good checkpoint is "
            f"{kept[-1] if kept else 'none'}; lower --learning_rate and retry"
        )

    def log(step: int, metrics: Metrics) -> None:
        nonlocal last_finite
        row = {"step": step, **{k: float(v) for k, v in parallel.to_host(metrics).items()}}
        if not np.isfinite(row["loss"]):
            stop_non_finite(f"the loss became {row['loss']} between steps {last_finite} and {step}")
        last_finite = step
        on_log(row)

    def save(step: int) -> None:
        sync_objects()
        if not all_finite(nnx.state(model, nnx.Param)):
            stop_non_finite(
                f"the parameters became non-finite between steps {last_finite} and {step}"
            )
        checkpoints.save(step, model, optimizer, progress_of(step, per_epoch, config), config)

    clock = None
    order_epoch, order = None, None
    step = start_step
    with StopSignals() as signals:
        while step < config.steps:
            epoch, index = divmod(step, per_epoch)
            if epoch != order_epoch:
                order_epoch = epoch
                order = parallel.place(
                    data.epoch_order(config.seed, epoch, num_examples), device_data.mesh
                )
            stop = next_stop(step, config, per_epoch)
            per_call = stop - step if config.fused_steps else 1
            for first in range(step, stop, per_call):
                state, metrics = train_chunk(
                    state, device_data.train_images, device_data.train_labels, order,
                    index + first - step, per_call, first, aug_key,
                )  # fmt: skip
            step = stop
            if clock is None:  # the first call compiled; time the rest
                jax.block_until_ready(metrics)
                clock = time.perf_counter(), step
            if is_log_step(step, config):
                log(step, metrics)
            # A signal to any process stops all of them at the same step (saving is collective).
            signum = max(parallel.from_every_process(signals.signum))
            if step % config.checkpoint_every == 0 or step == config.steps or signum:
                save(step)
            if signum:
                checkpoints.wait()
                name = signal.Signals(signum).name
                raise Interrupted(
                    f"{name} at step {step}: checkpoint {step} saved in {checkpoints.directory}; "
                    "resume by running the same command with the same --workdir",
                    signum,
                )
    jax.block_until_ready(state)
    sync_objects()
    model.eval()
    if clock is None:  # nothing left to train: a run killed after its final checkpoint
        return float("nan")
    timed_steps = config.steps - clock[1]
    elapsed = time.perf_counter() - clock[0]
    return timed_steps * batch_size / elapsed if timed_steps else float("nan")


def resume(
    checkpoints: checkpoint_lib.Checkpoints,
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    config: ml_collections.ConfigDict,
    num_batches: int,
) -> int:
    """Restore the newest intact checkpoint into model and optimizer; returns its step (0: none)."""
    restored = checkpoints.restore(
        {"model": nnx.state(model), "optimizer": nnx.state(optimizer), "progress": None}
    )
    if restored is None:
        return 0
    step, saved = restored["step"], restored["progress"]
    expected = progress_of(step, num_batches, config)
    for key in ("batch_size", "seed", "num_batches"):
        if saved[key] != expected[key]:
            raise UserError(
                f"{checkpoints.directory} was trained with {key}={saved[key]}, this run has "
                f"{expected[key]}; resume with the same value or use a new --workdir"
            )
    nnx.update(model, restored["model"])
    nnx.update(optimizer, restored["optimizer"])
    return step


def versions() -> dict[str, str]:
    return {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__}


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | None) -> dict[str, Any]:
    """Every stage of the codelab for one config; resumes from the workdir's checkpoints.

    Writes summary.json, metrics.jsonl and checkpoints/ in the workdir and returns the summary.
    """
    wall_start = time.perf_counter()
    # Everything a user can get wrong is checked before anything is printed or compiled.
    config_lib.validate(config)
    if jax.process_count() > 1 and not workdir:
        raise UserError(
            "a multi-process run needs --workdir=DIR, on a filesystem every process shares"
        )
    workdir = workdir_lib.prepare_workdir(workdir)
    dataset = data.load_dataset(config.data_dir or None)
    mesh = parallel.make_mesh()
    device_data = data.to_device(dataset, config.batch_size, mesh)
    checkpoints = checkpoint_lib.Checkpoints(workdir, max_to_keep=config.max_to_keep)
    try:
        return _run(config, workdir, dataset, device_data, checkpoints, wall_start)
    finally:
        checkpoints.wait()
        checkpoints.close()


def _run(config, workdir, dataset, device_data, checkpoints, wall_start) -> dict[str, Any]:
    # Every process runs every computation; process 0 alone prints and writes files.
    primary, say = parallel.is_primary(), parallel.say
    mesh = device_data.mesh
    model, optimizer = create_train_state(config, mesh)
    start_step = resume(checkpoints, model, optimizer, config, device_data.batches_per_epoch)
    summary_path = workdir / workdir_lib.SUMMARY_FILE
    finished = summary_path.exists() and start_step >= config.steps
    if finished or start_step > config.steps:
        say(
            f"workdir {workdir} already holds step {start_step}; nothing to do for "
            f"--steps={config.steps} (pass a larger --steps to continue)"
        )
        return workdir_lib.read_json(summary_path)
    say(f"workdir: {workdir}")
    if start_step:
        say(f"resuming from checkpoint {start_step} in {checkpoints.directory}")

    shown: dict[str, Table] = {}

    def show(key: str, table: Table) -> None:
        shown[key] = table
        say(table.format())

    layout = parallel.describe(mesh, config.batch_size, config.param_sharding)
    show("setup", tables.setup_table({n.capitalize(): v for n, v in versions().items()}, layout))
    if primary and jax.default_backend() != "gpu":
        logging.warning(
            "No GPU found: running on %s. Install '.[cuda12]' on a GPU host.", jax.devices()[0]
        )
    show(
        "splits",
        tables.splits_table(
            [
                ("train", dataset.train_images, dataset.train_labels,
                 dataset.sources[data.TRAIN_IMAGES.stem]),
                ("test", dataset.test_images, dataset.test_labels,
                 dataset.sources[data.TEST_IMAGES.stem]),
            ]
        ),
    )  # fmt: skip
    arrays = {k: v for k, v in vars(device_data).items() if isinstance(v, jax.Array)}
    show("batches", tables.arrays_table("Data arrays on the device", arrays))
    show("params", tables.params_table(model))
    first_batch = jax.jit(data.batch_at, static_argnums=(3, 4, 5))(
        device_data.train_images, device_data.train_labels,
        data.epoch_order(config.seed, 0, len(device_data.train_labels)), 0, config.batch_size,
        mesh,
    )  # fmt: skip
    grad_table, grad_check = gradient_check(model, *first_batch, config.optimizer.learning_rate)
    show("gradients", grad_table)

    metrics_path = workdir / workdir_lib.METRICS_FILE
    with contextlib.ExitStack() as outputs:
        if primary:
            metrics_log = workdir_lib.MetricsLog(metrics_path, keep_until=start_step)
            progress = tables.ProgressBar(config.steps)
            outputs.callback(metrics_log.close)
            outputs.callback(progress.close)

        def on_log(row: dict[str, float]) -> None:
            if primary:
                metrics_log.write(row)
                progress.update(row)

        examples_per_sec = train(
            model, optimizer, device_data, config,
            start_step=start_step, checkpoints=checkpoints, on_log=on_log,
        )  # fmt: skip
    compared = parallel.check_replicas(nnx.state(model, nnx.Param), "the trained parameters")
    if jax.process_count() > 1:
        say(
            f"the {compared} replicated parameter arrays are identical in all "
            f"{jax.process_count()} processes"
        )
    full_eval = evaluate.evaluate(
        model, device_data.test_x, device_data.test_y, device_data.test_mask
    )
    # The codelab's extra comparisons run after training, on fresh models, so they cannot
    # disturb the training measurement above. Every process takes part in them.
    dispatch = precision = None
    checkpoints.wait()  # the final save's writer thread would otherwise share the CPU
    if config.report == "full":
        dispatch = benchmark.dispatch_vs_jit(config, device_data)
        precision = benchmark.precision_comparison(config, device_data)
    if not primary:
        return {"test_accuracy": full_eval["accuracy"], "process_index": jax.process_index()}

    history = workdir_lib.read_jsonl(metrics_path)  # every logged step, resumed runs included
    show("training", tables.training_log_table(history, examples_per_sec))
    codelab_eval = evaluate.first_batches(full_eval, device_data.codelab_test_batches)
    last = history[-1]
    show(
        "evaluation",
        tables.evaluation_table(
            {
                "last train batch": {**last, "examples": config.batch_size},
                "test, codelab (whole batches only)": codelab_eval,
                "test, full (last batch padded, masked)": full_eval,
            }
        ),
    )
    show(
        "placement",
        tables.placement_table(
            {
                "params": nnx.state(model, nnx.Param),
                "optimizer state": nnx.state(optimizer, nnx.OptState),
                "train data": (device_data.train_images, device_data.train_labels),
                "test batches": (device_data.test_x, device_data.test_y),
            }
        ),
    )
    counts = evaluate.confusion_matrix(
        dataset.test_labels, full_eval["predictions"], data.NUM_CLASSES
    )
    report_path = None
    if config.report != "none":
        report_path = report.write_report(
            workdir / "report",
            tables=shown,
            train_images=dataset.train_images,
            train_labels=dataset.train_labels,
            test_images=dataset.test_images,
            test_labels=dataset.test_labels,
            test_predictions=full_eval["predictions"],
            confusion_counts=counts,
            history=history,
            examples_per_sec=examples_per_sec,
            dispatch=dispatch,
            precision=precision,
            config=config.to_dict(),
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
        "resumed_from_step": start_step,
        "batch_size": config.batch_size,
        "compute_dtype": config.compute_dtype,
        "seed": config.seed,
        "backend": jax.default_backend(),
        "num_devices": mesh.size,
        "num_processes": jax.process_count(),
        "mesh": dict(mesh.shape),
        "param_sharding": config.param_sharding,
        "layout": layout,
        "gradient_check": grad_check,
        "confusion_matrix": counts.tolist(),
        "dispatch_vs_jit": dispatch,
        "precision": precision,
        "report": str(report_path) if report_path else None,
        "wall_seconds": time.perf_counter() - wall_start,
        "peak_rss_mb": benchmark.peak_rss_mb(),
        "versions": versions(),
        "config": config.to_dict(),
    }
    workdir_lib.write_json(summary_path, summary)
    # The key results again at the end, where a person looks first.
    for rows, key, title in (
        (dispatch, "mode", report.DISPATCH_TITLE),
        (precision, "dtype", report.PRECISION_TITLE),
    ):
        if rows:
            print(report.timing_table(title, key, rows).format())
    print(shown["evaluation"].format())
    print(
        f"test accuracy {full_eval['accuracy']:.4f} on {full_eval['examples']:,} examples "
        f"({codelab_eval['accuracy']:.4f} on the codelab's {codelab_eval['examples']:,})",
        f"report: {report_path}" if report_path else "report: none (--report=none)",
        f"workdir: {workdir}",
        sep="\n",
        flush=True,
    )
    return summary
