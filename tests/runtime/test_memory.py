"""What the machine can hold (runtime/memory.py): host memory as the least of its limits, the
models sized from abstract shapes, the training step's and Grain's memory, each refusal one
line naming the field."""

from __future__ import annotations

import functools
import pathlib
import re
import resource

import pytest
from conftest import REPO, load_config
from flax import nnx

from fmnist_flax import experiment, task, train
from fmnist_flax.model import create_model
from fmnist_flax.runtime import grain_pipeline, parallel
from fmnist_flax.runtime import memory as memory_lib
from fmnist_flax.runtime.errors import UserError


def fake_host(root, cgroup_lines, files):
    """A /proc and a /sys/fs/cgroup of real files under `root`: MemAvailable 8 GiB, this
    process in the cgroups of `cgroup_lines`, the cgroup `files` {relative path: text}."""
    (root / "proc" / "self").mkdir(parents=True)
    (root / "proc" / "meminfo").write_text(f"MemTotal: 9 kB\nMemAvailable: {8 * 2**20} kB\n")
    (root / "proc" / "self" / "cgroup").write_text("\n".join(cgroup_lines) + "\n")
    for name, text in files.items():
        (root / "cg" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "cg" / name).write_text(text)
    return memory_lib.host_memory(root / "proc", root / "cg")


def test_host_memory_is_the_least_of_meminfo_and_every_enclosing_cgroup(tmp_path):
    gib = 2**30
    v1 = {
        "memory/jobs/a/memory.limit_in_bytes": f"{3 * gib}",
        "memory/jobs/a/memory.usage_in_bytes": f"{gib}",
        "memory/jobs/memory.limit_in_bytes": f"{5 * gib // 2}",  # the parent leaves less
        "memory/jobs/memory.usage_in_bytes": f"{gib}",
    }
    memory = fake_host(tmp_path / "v1", ["7:cpu:/jobs/a", "4:memory:/jobs/a"], v1)
    assert memory == memory_lib.Memory(3 * gib // 2, "the memory limit of cgroup /jobs less use")
    v2 = {"jobs/a/memory.max": "max", "jobs/a/memory.current": "5", "memory.max": f"{gib}"}
    v2["memory.current"] = f"{gib // 4}"
    memory = fake_host(tmp_path / "v2", ["0::/jobs/a"], v2)
    assert memory == memory_lib.Memory(3 * gib // 4, "the memory limit of cgroup / less use")
    memory = fake_host(tmp_path / "none", ["0::/"], {})  # no limits: MemAvailable
    assert memory == memory_lib.Memory(8 * gib, "MemAvailable in /proc/meminfo")
    assert str(memory) == "8.00 GiB available (MemAvailable in /proc/meminfo)"


def test_an_address_space_limit_counts_as_the_data_limit_does():
    """`ulimit -v` (RLIMIT_AS) was ignored: a run that could not fit died in XLA with a
    RESOURCE_EXHAUSTED traceback where `ulimit -d` refused it in one line. What is left under
    it is the limit less this process's address space (VmSize), named as such."""
    status = pathlib.Path("/proc/self/status").read_text()
    size = int(status.split("VmSize:")[1].split()[0]) * 1024
    before = resource.getrlimit(resource.RLIMIT_AS)
    limit = size + 2 * 2**30  # far below MemAvailable here: the least of the figures
    resource.setrlimit(resource.RLIMIT_AS, (limit, before[1]))
    try:
        memory = memory_lib.host_memory()
    finally:
        resource.setrlimit(resource.RLIMIT_AS, before)
    assert memory.source.startswith("ulimit -v of "), memory
    assert 2 * 2**30 - 64 * 2**20 < memory.free <= 2 * 2**30, memory


def test_grain_read_threads_beyond_the_cores_are_refused(quick_config):
    cores = grain_pipeline.usable_cores()
    quick_config.grain.workers = cores + 1
    memory_lib.check_threads(quick_config)  # the device pipeline starts no read threads
    quick_config.input_pipeline = "grain"
    with pytest.raises(UserError, match=rf"--config.grain.workers={cores + 1} is more read") as exc:
        memory_lib.check_threads(quick_config)
    assert f"use at most {cores}, or 0" in str(exc.value) and "\n" not in str(exc.value)
    quick_config.grain.workers = cores
    memory_lib.check_threads(quick_config)


def test_the_abstract_size_of_a_model_is_what_the_real_one_holds(quick_config):
    """member_bytes (no array allocated) equals the real model's state, its gradients and
    its optimizer's state to the byte; an ensemble member adds its share of an evaluation."""
    model = create_model(quick_config, (28, 28, 1), 10)
    optimizer = train.create_optimizer(model, quick_config)
    real = memory_lib.tree_bytes(nnx.state(model)) + memory_lib.tree_bytes(
        nnx.state(optimizer, nnx.OptState)
    )
    params = memory_lib.tree_bytes(nnx.state(model, nnx.Param))
    one = experiment.member_bytes(quick_config, (28, 28, 1), 10, saved_copy=False)
    assert one == real + params
    assert experiment.member_bytes(quick_config, (28, 28, 1), 10) == 2 * real + params
    quick_config.ensemble.size = 2
    member = experiment.member_bytes(quick_config, (28, 28, 1), 10, saved_copy=False)
    # 10,240 test images a call: each member's activations, at least 256 + 128 floats each
    assert member - one > 10_240 * 384 * 4


class _Fashion:  # the shape of the data check_step sizes a step for
    image_shape = (28, 28, 1)
    num_classes = 10


def test_a_training_step_whose_activations_cannot_fit_is_one_line_naming_the_batch(quick_config):
    """Batch 60,000 through 16,000 units: the models' check passed it, then XLA asked for
    11.5 GB when the step first ran. Its compiled (never run) step's memory is now checked
    besides the models', before anything of that size is allocated."""
    gib = 2**30
    memory = memory_lib.Memory(4 * gib, "a test's figure")
    mesh = parallel.mesh_for(quick_config)
    step = functools.partial(
        memory_lib.step_bytes,
        train_step=train.train_step,
        abstract_state=experiment.abstract_state,
    )
    small = memory_lib.check_step(quick_config, _Fashion, mesh, memory, 0, step)
    assert 128 * 784 * 4 < small < 64 * 2**20  # the batch and more, not gigabytes
    quick_config.batch_size = 60_000
    quick_config.model.hidden = (16_000,)
    with pytest.raises(UserError) as exc:
        memory_lib.check_step(quick_config, _Fashion, mesh, memory, 300 * 2**20, step)
    line = str(exc.value)
    assert re.match(r"--batch_size=60000: a training step needs about 1\d\.\d\d GiB ", line), line
    assert "besides 300.0 MiB for the model, on the host, which has 4.00 GiB available (a " in line
    fit = int(re.search(r"use at most about --batch_size=([\d,]+)$", line)[1].replace(",", ""))
    assert 10_000 < fit < 20_000 and "\n" not in line


@pytest.mark.usefixtures("registries")
def test_a_step_is_traced_once_per_config_and_again_when_an_entry_it_sees_is_added(quick_config):
    """The step's bound is traced once for a config in a process (the next run with it reads
    the size kept), and again for another config or once a registry gains an entry the run
    sees: a loss term then changes the step."""
    traced = []

    def counted(model, optimizer, x, y, config):
        traced.append(config.batch_size)
        return train.train_step(model, optimizer, x, y, config)

    def size():
        step = functools.partial(
            memory_lib.step_bytes, train_step=counted, abstract_state=experiment.abstract_state
        )
        return step(quick_config, (28, 28, 1), 10, quick_config.batch_size, 2**40)

    first = size()
    assert size() == first and len(traced) == 1
    quick_config.batch_size *= 2
    assert size() > first and len(traced) == 2
    task.LOSS_TERMS["doubled_loss"] = lambda logits, labels, config: 2 * logits.mean(-1)
    assert size() > 0 and len(traced) == 3


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO / "configs").glob("*.py")))
def test_every_config_passes_the_step_check(name):
    config = load_config(name)
    mesh = parallel.mesh_for(config)
    step = functools.partial(
        memory_lib.step_bytes,
        train_step=train.train_step,
        abstract_state=experiment.abstract_state,
    )
    held = memory_lib.check_step(config, _Fashion, mesh, memory_lib.host_memory(), 0, step)
    assert held >= config.batch_size * 784 * 4


def test_sizes_that_cannot_fit_are_one_line_naming_the_field(quick_config):
    mib = 2**20
    memory = memory_lib.Memory(400 * mib, "a test's figure")
    quick_config.ensemble.size = 8
    with pytest.raises(UserError, match=r"--config.ensemble.size=8: 8 members need about") as exc:
        memory_lib.check_models(
            quick_config, (28, 28, 1), 10, memory, True, experiment.member_bytes
        )
    assert "400.0 MiB available (a test's figure)" in str(exc.value)
    assert re.search(r"use at most about [1-7] members$", str(exc.value)), str(exc.value)
    quick_config.ensemble.size = 1
    held = memory_lib.check_models(
        quick_config, (28, 28, 1), 10, memory, True, experiment.member_bytes
    )
    quick_config.model.hidden = (16_384, 16_384)  # 1.1 GB of parameters, shapes only
    with pytest.raises(UserError, match=r"--config.model: the model needs about 7\.\d\d GiB"):
        memory_lib.check_models(
            quick_config, (28, 28, 1), 10, memory, True, experiment.member_bytes
        )
    quick_config.grain.block_examples = 2**31 - 1
    with pytest.raises(UserError, match=r"block_examples=2147483647 with .* 4,194,303 steps"):
        memory_lib.check_grain(quick_config, (28, 28, 1), memory, held)
    quick_config.grain.block_examples = 16_384
    memory_lib.check_grain(quick_config, (28, 28, 1), memory, held)
    quick_config.grain.prefetch = 10_000
    with pytest.raises(UserError, match=r"prefetch=10000 .* keeps 10,002 blocks of 32 steps"):
        memory_lib.check_grain(quick_config, (28, 28, 1), memory, held)
