"""Shared fixtures: small IDX files the tests write, the real Debian data, a quick config."""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import dataclasses
import functools
import gzip
import hashlib
import io
import json
import os
import pathlib
import re
import runpy
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING, ClassVar

import main_server
import numpy as np
import pytest

if TYPE_CHECKING:  # imported where used: xdist's controller, which runs no test, skips them
    import jax
    from flax import nnx

    from fmnist_flax import datasets

REPO = pathlib.Path(__file__).resolve().parents[1]
HELP_FLAG = re.compile(r"^  --([\w.]+)", re.M)  # a flag `main.py --help` lists


def pytest_configure(config: pytest.Config) -> None:
    """JAX's persistent compilation cache, the one `main.py` keeps by default: the tests'
    programs and those of the `main.py` runs they start are the same entries (JAX's key holds
    the cache's directory), and a second run of the tests compiles little (much of the fast
    tier's time is compiling). Delete that directory to time them from an empty cache."""
    if config.getoption("numprocesses", None) and not hasattr(config, "workerinput"):
        return  # xdist's controller: its workers run the tests (and import JAX)
    use_compilation_cache(compilation_cache_dir())


def compilation_cache_dir() -> pathlib.Path:
    """`main.py`'s default --compilation_cache."""
    from fmnist_flax.runtime import data_files

    return data_files.CACHE_ROOT / "jax"


def use_compilation_cache(directory: pathlib.Path) -> None:
    """Every compiled program kept in `directory`, shared by the test workers, the test
    processes that call this (mesh_worker.py) and `main.py`'s runs; each entry is written whole
    before another process can read it (`compilation_cache.write_whole`)."""
    from fmnist_flax.runtime import compilation_cache

    compilation_cache.use(directory)


@pytest.fixture(scope="session", autouse=True)
def quiet_orbax() -> None:
    """Orbax's noise dropped as the command line drops it, for the tests that save and read
    checkpoints in this process (set when the session starts: after pytest's own hooks)."""
    from fmnist_flax.runtime import library_workarounds

    library_workarounds.quiet_orbax()


# The longest tests, started before every other: most wait on 8 virtual devices or on a second
# process more than they compute, so they run beside the other worker's short tests instead of
# beside each other at the end, where one would hold its worker while the other is idle.
# The one that runs a copy's fast tier comes last of them: with -n 2 the other worker runs the
# fast tier meanwhile, filling the shared compilation cache the copy's tier reads (its entries
# do not depend on the source's path), and that tier then compiles little.
LONGEST = (
    "test_model_parallel_trains_like_one_device_and_moves_between_meshes",
    "test_eight_devices_train_like_one_and_arrays_are_really_sharded",
    "test_grain_on_eight_devices_and_in_two_processes_trains_like_one_device",
    "test_a_killed_grain_run_resumes_mid_epoch_bit_exact",
    "test_two_processes_killed_at_once_resume_from_records_exactly",
    "test_a_shard_only_one_process_can_read_stops_both_with_what_to_do",
    "test_the_model_parallel_recipe_trains_like_one_device_and_moves_between_meshes",
    "test_small_mode_prints_the_table_and_the_benchmark_writes_every_field",
    "test_a_signal_between_one_step_calls_saves_that_step_and_resumes_exactly",
    "test_deleting_the_demonstrations_leaves_a_working_trainer_and_a_passing_fast_tier",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow tests (processes, long training) first, LONGEST at their head, the many short
    ones after: with two workers stealing each other's queued tests from the back, they then
    finish together instead of one waiting while the other runs a long test started last."""

    def rank(item: pytest.Item) -> tuple[bool, int]:
        name = getattr(item, "originalname", item.name)
        first = LONGEST.index(name) if name in LONGEST else len(LONGEST)
        return item.get_closest_marker("slow") is None, first

    items.sort(key=rank)


@pytest.fixture(scope="session")
def help_flags() -> set[str]:
    """Every flag `main.py --help` lists (one process, about 2 s)."""
    out = subprocess.run(
        [sys.executable, str(REPO / "main.py"), "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    flags = set(HELP_FLAG.findall(out))
    assert {"steps", "workdir", "mode", "config"} <= flags, out[:2000]
    return flags


def run_main(
    *args, cwd=REPO, timeout=300, script=REPO / "main.py", **kwargs
) -> subprocess.CompletedProcess:
    """`python main.py ARGS` (or `script`) in a process of its own, as a user runs it: forked
    from `main_server` (whose libraries are imported, about 2 s a command) where it can run
    the same way (the repository's main.py, this process's environment, nothing to feed it)."""
    if script == REPO / "main.py" and set(kwargs) <= {"check"}:
        server = MainServer.running()
        return server.run([str(a) for a in args], cwd, timeout, **kwargs)
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


class MainServer:
    """A `main_server` for one project (this repository's, or a copy a test made), started at
    its first use, stopped at this process's exit or by `stop`."""

    _running: ClassVar[dict[tuple, MainServer]] = {}

    def __init__(self, python: pathlib.Path, root: pathlib.Path, env: dict[str, str]):
        self.env = env
        self.directory = directory = pathlib.Path(tempfile.mkdtemp(prefix="main-server-"))
        self.path = str(directory / "socket")
        preload = "template" if root == REPO else "libraries"
        with open(directory / "log", "w") as log:  # not this process's stderr, held open
            self.process = subprocess.Popen(
                [python, str(REPO / "tests" / "main_server.py"), self.path, str(root), preload],
                cwd=root,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        ready = self.process.stdout.readline()
        assert ready == "ready\n", (directory / "log").read_text()[-3000:]
        atexit.register(self.close)

    def close(self) -> None:
        """Stop the server and remove its socket and log."""
        self.process.kill()
        self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)

    @staticmethod
    def stable(env: dict[str, str]) -> dict[str, str]:
        """`env` but the variable pytest changes for each test (which a command gets as is)."""
        return {k: v for k, v in env.items() if k != "PYTEST_CURRENT_TEST"}

    @classmethod
    def running(
        cls, python=pathlib.Path(sys.executable), root=REPO, env: dict | None = None
    ) -> MainServer:
        env = cls.stable(os.environ if env is None else env)
        key = (root, tuple(sorted(env.items())))  # the environment the libraries imported in
        server = cls._running.get(key)
        if server is None or server.process.poll() is not None:
            server = cls._running[key] = cls(python, root, env)
        return server

    @classmethod
    def stop(cls, root: pathlib.Path) -> None:
        """Stop the servers of the project at `root`."""
        for key in [key for key in cls._running if key[0] == root]:
            cls._running.pop(key).close()

    def start(self, argv: list[str], cwd, stdout: int | None) -> ServedProcess:
        """One command, not waited for, as `subprocess.Popen(..., stdin=DEVNULL,
        stdout=stdout (PIPE or DEVNULL), stderr=PIPE, text=True)` starts it."""
        return ServedProcess(self, argv, cwd, stdout)

    def _env(self) -> dict[str, str]:
        env = dict(self.env)
        if "PYTEST_CURRENT_TEST" in os.environ:
            env["PYTEST_CURRENT_TEST"] = os.environ["PYTEST_CURRENT_TEST"]
        return env

    def run(self, argv: list[str], cwd, timeout: float, check: bool = False):
        """One command, as `subprocess.run(..., capture_output=True, text=True)` returns it."""
        process = self.start(argv, cwd, subprocess.PIPE)
        stdout, stderr = process.communicate(timeout)
        result = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
        if check:
            result.check_returncode()
        return result


class ServedProcess:
    """A command forked from a `MainServer`, with the part of `subprocess.Popen`'s interface
    the tests use: its pid (for signals), its streams, poll, wait, communicate."""

    def __init__(self, server: MainServer, argv: list[str], cwd, stdout: int | None):
        self.args, self.returncode = ["main.py", *argv], None
        pipes = {"stdout": os.pipe() if stdout == subprocess.PIPE else None, "stderr": os.pipe()}
        with open(os.devnull, "r+b") as null:
            ends = [null.fileno(), *(p[1] if p else null.fileno() for p in pipes.values())]
            self._connection = main_server.request(server.path, argv, str(cwd), server._env(), ends)
        for name, pipe in pipes.items():
            if pipe:
                os.close(pipe[1])
            setattr(self, name, io.TextIOWrapper(os.fdopen(pipe[0], "rb")) if pipe else None)
        self._received = b""
        self.pid = int(self._line(None))

    def _line(self, timeout: float | None) -> str | None:
        """The server's next line (pid, then exit status), or None after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._received:
            if not select.select([self._connection], [], [], _left(deadline))[0]:
                return None
            self._received += self._connection.recv(4096) or b"?\n"  # closed: no status
        line, self._received = self._received.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        return self.wait(0) if self.returncode is None else self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        if self.returncode is None:
            line = self._line(timeout)
            if line is None:
                if timeout == 0:
                    return None
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = int(line)
            self._connection.close()
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        """Both streams read to their end (on threads: neither pipe fills), then the status.
        Past `timeout` the command is killed (its streams' readers would wait for it)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            reads = [pool.submit(s.read) if s else None for s in (self.stdout, self.stderr)]
            try:
                done = concurrent.futures.wait([r for r in reads if r], timeout)
                if done.not_done or self.wait(_left(deadline)) is None:
                    raise TimeoutError
            except (TimeoutError, subprocess.TimeoutExpired):
                self.kill()
                raise subprocess.TimeoutExpired(self.args, timeout) from None
        out, err = (r.result() if r else None for r in reads)
        return out, err

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


# Runs its arguments as a child and writes the child's own peak RSS (wait4) to the file
# argv[1]: a process started from pytest would count the pytest process's memory as its own
# (Linux carries the peak over fork and exec); this small one's is negligible.
_MEASURE = """
import os, subprocess, sys
child = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(child.pid, 0)
open(sys.argv[1], "w").write(str(usage.ru_maxrss * 1024))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def start_main(
    workdir: pathlib.Path, *flags: str, stdout: int | None = subprocess.PIPE, **kwargs
) -> subprocess.Popen:
    """`python main.py --workdir=WORKDIR FLAGS` started in a process of its own, not waited
    for (to be signalled or killed); stderr piped, `stdout` as given (forked from the
    `MainServer` where nothing else is asked for)."""
    if not kwargs and stdout in (subprocess.PIPE, subprocess.DEVNULL):
        return MainServer.running().start([f"--workdir={workdir}", *flags], REPO, stdout)
    return subprocess.Popen(
        [sys.executable, str(REPO / "main.py"), f"--workdir={workdir}", *flags],
        cwd=REPO,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def wait_for(condition, timeout: float = 120) -> None:
    """Poll `condition` every 50 ms until it holds; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def run_main_measured(
    *args, timeout: float = 300, **kwargs
) -> tuple[subprocess.CompletedProcess, int, float]:
    """`run_main(ARGS)`, with the process's peak RSS in bytes and its wall seconds."""
    with tempfile.NamedTemporaryFile("r") as peak:
        began = time.monotonic()
        result = subprocess.run(
            [
                sys.executable,
                "-c",
                _MEASURE,
                peak.name,
                sys.executable,
                str(REPO / "main.py"),
                *args,
            ],
            cwd=kwargs.pop("cwd", REPO),
            capture_output=True,
            text=True,
            timeout=timeout,
            **kwargs,
        )
        return result, int(peak.read() or 0), time.monotonic() - began


@contextlib.contextmanager
def within(seconds: float):
    """The block must end within `seconds`: a read that would wait for ever (a FIFO nobody
    writes) fails the test with TimeoutError instead of hanging it."""

    def expire(signum, frame):
        raise TimeoutError(f"still waiting after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def env_without_device_count() -> dict[str, str]:
    """This environment without a CPU device count of its own: main.py then makes the devices
    an ensemble is split over (`--config.ensemble.shards`, `--bench_member_shards`)."""
    return {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}


def assert_one_line_error(result: subprocess.CompletedProcess, expected: str) -> str:
    """The run failed with exactly one line on stderr, `error: ...` containing `expected`."""
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and expected in lines[0], lines[0]
    return lines[0]


def edit_saved_configs(workdir: pathlib.Path, **fields) -> None:
    """Set `fields` in every checkpoint's saved config (a JSON item), as a hand edit would."""
    for metadata in workdir.glob("checkpoints/*/config/metadata"):
        saved = json.loads(metadata.read_text())
        metadata.write_text(json.dumps({**saved, **fields}))


@pytest.fixture
def forget_modules():
    """Names of modules a test imports, removed from sys.modules after it."""
    names: list[str] = []
    yield names
    for name in names:
        sys.modules.pop(name, None)


@pytest.fixture
def registries():
    """Every registry as it was before the test, restored after it: what the test registers
    (a model, a loss term, a hook) is gone for the next one."""
    from fmnist_flax import datasets, model, optimizer, task, train
    from fmnist_flax.runtime import plugins

    tables = (
        model.MODELS,
        datasets.DATASETS,
        task.LOSS_TERMS,
        task.METRICS,
        task.TEST_SET_METRICS,
        optimizer.OPTIMIZERS,
        optimizer.SCHEDULES,
        optimizer.DECAY_MASKS,
        train.UPDATE_HOOKS,
        train.AFTER_EVALUATION,
    )
    before = [{name: dict(entries) for name, entries in t.owned.items()} for t in tables]
    plug_ins = set(plugins.PLUG_INS)
    yield
    for table, kept in zip(tables, before, strict=True):
        table.owned.clear()
        table.owned.update(kept)
    plugins.PLUG_INS.intersection_update(plug_ins)


EVERY_DUE_SAVE = "--config.checkpoint_min_interval_secs=0"  # no time floor: tests count steps


def assert_same_models(one: pathlib.Path, other: pathlib.Path) -> None:
    """The newest models of two workdirs are equal to the bit, array for array."""
    import jax
    from flax import nnx

    from fmnist_flax import load_model

    for a, b in zip(
        jax.tree.leaves(nnx.state(load_model(one))),
        jax.tree.leaves(nnx.state(load_model(other))),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


def forward(model: nnx.Module, x: jax.Array) -> jax.Array:
    """`model(x)` compiled as one program: called eagerly, each of its operations would compile
    on its own, for each new shape."""
    return _compiled_call()(model, x)


@functools.cache
def _compiled_call():
    from flax import nnx

    return nnx.jit(lambda model, x: model(x))


def load_config(name: str):
    """A config of configs/ loaded by path, as --config loads it."""
    return runpy.run_path(str(REPO / "configs" / f"{name}.py"))["get_config"]()


def idx_bytes(array: np.ndarray, magic: int | None = None) -> bytes:
    """An IDX payload for uint8 images (N, H, W) or labels (N,)."""
    from fmnist_flax.runtime import data_files

    if magic is None:
        magic = data_files.IMAGES_MAGIC if array.ndim == 3 else data_files.LABELS_MAGIC
    header = struct.pack(f">I{array.ndim}I", magic, *array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_idx(path: pathlib.Path, payload: bytes, *, compress: bool) -> datasets.IdxFile:
    """Write `payload` (gzipped or raw) and return the spec that publishes its MD5s."""
    from fmnist_flax import datasets

    stem = path.name.removesuffix(".gz")
    blob = gzip.compress(payload) if compress else payload
    path.write_bytes(blob)
    return datasets.IdxFile(stem, hashlib.md5(blob).hexdigest(), hashlib.md5(payload).hexdigest())


def small_arrays(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (
        rng.integers(0, 256, (n, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, n, dtype=np.uint8),
    )


def offline(spec: datasets.DatasetSpec, root: pathlib.Path) -> datasets.DatasetSpec:
    """A dataset spec whose cache and system directory are empty and that never downloads."""
    return dataclasses.replace(spec, cache_root=root / "cache", system_dir=root, base_url=None)


@pytest.fixture
def small_dataset_dir(tmp_path: pathlib.Path) -> tuple[pathlib.Path, datasets.DatasetSpec]:
    """Four valid small IDX files (train 64, test 20) and a dataset spec with their MD5s."""
    from fmnist_flax import datasets

    specs = []
    for stem, n, seed in (
        ("train-images-idx3-ubyte", 64, 1),
        ("train-labels-idx1-ubyte", 64, 1),
        ("t10k-images-idx3-ubyte", 20, 2),
        ("t10k-labels-idx1-ubyte", 20, 2),
    ):
        images, labels = small_arrays(n, seed)
        array = images if "images" in stem else labels
        specs.append(write_idx(tmp_path / f"{stem}.gz", idx_bytes(array), compress=True))
    spec = datasets.DatasetSpec(
        "small", "Small", tuple(specs), datasets.IDX_DATASETS["mnist"].class_names
    )
    return tmp_path, spec


# What `pip install jax` brings, and flatbuffers, which jax.export.deserialize needs.
JAX_ONLY = ("jax", "jaxlib", "ml_dtypes", "numpy", "opt_einsum", "scipy", "flatbuffers")
# Run by a `python -S` whose only import path is a directory of JAX_ONLY: it proves the
# project's libraries are out of reach, then loads the artifact and classifies the images.
JAX_ONLY_SCRIPT = """
import importlib.util, json, sys
import jax, numpy as np
absent = ("flax", "orbax", "optax", "ml_collections", "absl", "fmnist_flax")
assert not [name for name in absent if importlib.util.find_spec(name)], "not JAX alone"
with open(sys.argv[1], "rb") as file:
    exported = jax.export.deserialize(file.read())
probabilities = np.asarray(exported.call(np.load(sys.argv[2])))
print(json.dumps({"dtype": str(probabilities.dtype), "probabilities": probabilities.tolist()}))
"""


@pytest.fixture(scope="session")
def jax_only(tmp_path_factory):
    """`jax_only(artifact, images)`: an exported artifact's probabilities for uint8 `images`,
    computed by a process that can import JAX_ONLY (linked from this venv) and nothing else."""
    import jax

    site_packages = pathlib.Path(jax.__file__).resolve().parents[1]
    directory = tmp_path_factory.mktemp("jax_only")
    for name in JAX_ONLY:
        for entry in (name, f"{name}.libs"):
            if (site_packages / entry).exists():
                (directory / entry).symlink_to(site_packages / entry)
    (directory / "run.py").write_text(JAX_ONLY_SCRIPT)

    def call(artifact: pathlib.Path, images: np.ndarray) -> np.ndarray:
        inputs = tmp_path_factory.mktemp("inputs") / "images.npy"
        np.save(inputs, images)
        result = subprocess.run(
            [sys.executable, "-S", str(directory / "run.py"), str(artifact), str(inputs)],
            cwd=inputs.parent,
            env={"PATH": os.environ["PATH"], "PYTHONPATH": str(directory)},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr
        out = json.loads(result.stdout)
        assert out["dtype"] == "float32"
        return np.array(out["probabilities"], np.float32)

    return call


@pytest.fixture(scope="session")
def real_dataset() -> datasets.Dataset:
    """The real Fashion-MNIST from Debian's dataset-fashion-mnist (never downloaded in tests)."""
    from fmnist_flax import datasets

    return datasets.load_dataset(download=False)


@pytest.fixture
def quick_config():
    """The codelab's config, shortened for tests."""
    config = load_config("default")
    config.steps = 100
    config.report = "none"  # the report has its own tests
    config.checkpoint_min_interval_secs = 0.0  # saves at every checkpoint_every step
    return config


@pytest.fixture(scope="session")
def fmnist_records(real_dataset, tmp_path_factory) -> pathlib.Path:
    """The real Fashion-MNIST written once as record files (--mode=prepare's writer)."""
    from fmnist_flax.runtime import records

    path = tmp_path_factory.mktemp("records") / "fashion_mnist"
    records.write_dataset(real_dataset, path)
    return path
