"""library_workarounds: importing the package changes nothing global; `install()` does."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest
from conftest import REPO

PACKAGE = REPO / "fmnist_flax"

# Prints the global state the workarounds touch after the libraries are imported, after every
# module of the package is, and after install(). argv: the libraries, then the modules.
PROBE = """
import atexit, importlib, json, logging, sys
from absl import logging as absl_logging

def state():
    return {
        "absl_filters": [id(f) for f in absl_logging.get_absl_logger().filters],
        "asyncio_filters": [id(f) for f in logging.getLogger("asyncio").filters],
        "unraisablehook": id(sys.unraisablehook),
        "atexit_callbacks": atexit._ncallbacks(),
    }

libraries, modules = json.loads(sys.argv[1])
for name in libraries:
    importlib.import_module(name)
states = [state()]
for name in modules:
    importlib.import_module(name)
states.append(state())
from fmnist_flax.runtime import library_workarounds
library_workarounds.install()
states.append(state())
print(json.dumps(states))
"""


def package_modules() -> list[str]:
    """Every module of the package but `__main__` (which runs the command line)."""
    paths = sorted(PACKAGE.rglob("*.py"))
    names = [".".join(path.relative_to(REPO).with_suffix("").parts) for path in paths]
    return [name.removesuffix(".__init__") for name in names if not name.endswith("__main__")]


def libraries() -> list[str]:
    """The modules outside the package that the package imports, anywhere in its files."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module)
    return sorted(name for name in found if name.partition(".")[0] != "fmnist_flax")


def test_importing_the_package_changes_nothing_global_and_install_does():
    modules = ["fmnist_flax", *package_modules()]
    assert "fmnist_flax.runtime.checkpoint" in modules and "fmnist_flax.cli" in modules
    result = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps([libraries(), modules])],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    libraries_only, imported, installed = json.loads(result.stdout)
    assert imported == libraries_only  # log filters, unraisable hook, exit hooks: as they were
    for key in ("absl_filters", "asyncio_filters", "unraisablehook"):
        assert installed[key] != imported[key], key
    assert installed["atexit_callbacks"] == imported["atexit_callbacks"] + 1


def test_orbax_reading_a_step_marker_it_cannot_parse_is_dropped_and_nothing_else(tmp_path, caplog):
    """Orbax logs an ERROR with the whole file's content when a step's marker is not JSON: a
    full disk leaves an unfinished save's empty (checkpoint.py reports the failed save in one
    line), damage a finished step's (restore names the step in one warning line, without the
    content). Both are dropped (quiet_orbax, installed for the tests as for the command line);
    another error of Orbax's is still logged."""
    from absl import logging
    from orbax.checkpoint._src.metadata import checkpoint as orbax_metadata

    store = orbax_metadata.metadata_store(enable_write=False)
    for name, content in (("10.orbax-checkpoint-tmp", ""), ("10", "{secret content")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "_CHECKPOINT_METADATA").write_text(content)
        with caplog.at_level("ERROR"):
            assert store.read(tmp_path / name / "_CHECKPOINT_METADATA") is None
    assert not [r for r in caplog.records if "Metadata file" in r.getMessage()]
    with caplog.at_level("ERROR"):
        logging.error("Failed to write the array: disk gone")
    assert [r.getMessage() for r in caplog.records] == ["Failed to write the array: disk gone"]


def test_asyncio_logging_an_abandoned_read_of_a_damaged_array_is_dropped_and_nothing_else(
    tmp_path, caplog
):
    """When one of a restore's reads fails (a damaged file: checkpoint.py names the step in
    one line), asyncio logs each abandoned sibling read it collects as "Task exception was
    never retrieved", with tensorstore's error: those are dropped; another task's is logged."""
    import asyncio
    import gc

    import numpy as np
    import tensorstore as ts

    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(tmp_path / "a")}}
    array = ts.open(spec, create=True, dtype=ts.float32, shape=[4]).result()
    array.write(np.ones(4, np.float32)).result()
    zarray = tmp_path / "a" / ".zarray"
    zarray.write_bytes(zarray.read_bytes()[:5])  # damaged, as the fault tests damage a step

    async def read() -> None:
        await ts.open(spec)

    async def other() -> None:
        raise ValueError("something else")

    for coroutine in (read, other):
        loop = asyncio.new_event_loop()
        task = loop.create_task(coroutine())
        loop.run_until_complete(asyncio.wait([task]))
        loop.close()
        with caplog.at_level("ERROR"):
            del task
            gc.collect()
    logged = [r for r in caplog.records if "never retrieved" in r.getMessage()]
    assert [str(r.exc_info[1]) for r in logged] == ["something else"]


# A command that leaves with `os._exit` (`exit_after_hooks`): JAX's exit hook, which destroys
# the backends (seconds on a TPU), and the wait for background compilations are dropped; the
# other hooks run. Here JAX's hook and a compilation that would take 60 s are stand-ins.
LEAVING = """
import atexit, sys, time
from jax._src import api
from fmnist_flax.runtime import compile_ahead, library_workarounds
library_workarounds.install()
api.clean_up = lambda: print("jax's clean_up ran")
atexit.register(api.clean_up)
atexit.register(lambda: print("other hook ran"))
compile_ahead.in_background(lambda: time.sleep(60), "compile")
library_workarounds.exit_after_hooks(3)
sys.exit(3)
"""

# A process that tears the interpreter down waits for a compilation still running: a daemon
# thread inside XLA then aborts the process.
TEARING_DOWN = """
import time
from fmnist_flax.runtime import compile_ahead
compile_ahead.in_background(lambda: (time.sleep(0.5), print("compiled")), "compile")
"""


@pytest.mark.slow
def test_leaving_with_os_exit_skips_jaxs_backend_teardown_and_runs_the_other_hooks():
    # Waiting for the 60 s "compilation" would pass the timeout, and fail the test.
    result = subprocess.run(
        [sys.executable, "-c", LEAVING], capture_output=True, text=True, cwd=REPO, timeout=50
    )
    assert result.returncode == 3, result.stderr
    assert result.stdout.splitlines() == ["other hook ran"]


@pytest.mark.slow
def test_a_process_that_tears_down_waits_for_a_compilation_still_running():
    result = subprocess.run(
        [sys.executable, "-c", TEARING_DOWN], capture_output=True, text=True, cwd=REPO
    )
    assert (result.returncode, result.stdout) == (0, "compiled\n"), result.stderr
