"""The codelab's config and the checks that run before any data is read."""

from __future__ import annotations

import sys

import pytest
from conftest import load_config

from fmnist_flax import config as config_lib
from fmnist_flax.runtime.errors import UserError


def test_default_config_has_the_codelab_values():
    config = load_config("default")
    config_lib.validate(config)
    assert (config.batch_size, config.steps, config.log_every) == (512, 400, 25)
    assert tuple(config.model.hidden) == (256, 128)
    assert (config.optimizer.learning_rate, config.optimizer.weight_decay) == (3e-3, 1e-4)
    assert config.compute_dtype == "float32"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("compute_dtype", "float16x", "--compute_dtype='float16x' is not one of float32, bfloat16"),
        ("steps", -1, "--steps=-1 must be a whole number in 1..2,147,483,647"),
        ("steps", 10**19, "--steps=10000000000000000000 must be a whole number in 1.."),
        ("batch_size", 0, "--batch_size=0 must be a whole number in 1.."),
        ("log_every", 0, "--log_every=0 must be a whole number in 1.."),
        ("steps", True, "--steps=True must be a whole number in 1.."),  # it trained 1 step
        ("seed", True, "--seed=True must be a whole number in 0.."),
        ("eval_every", True, "--config.eval_every=True must be 0 "),
        ("grain.prefetch", True, "--config.grain.prefetch=True must be a whole number >= 1"),
        ("seed", -1, "--seed=-1 must be a whole number in 0..4,294,967,295"),
        ("seed", 2**32, "--seed=4294967296 must be a whole number in 0.."),
        ("optimizer.learning_rate", 0.0, "--learning_rate=0.0 must be positive"),
        ("optimizer.weight_decay", -1.0, "weight_decay=-1.0 must be >= 0"),
        ("checkpoint_min_interval_secs", -1.0, "checkpoint_min_interval_secs=-1.0 must be a"),
        ("checkpoint_min_interval_secs", float("nan"), "checkpoint_min_interval_secs=nan must"),
        ("grain.workers", -1, "--config.grain.workers=-1 must be a whole number >= 0"),
        ("grain.block_examples", 0, "--config.grain.block_examples=0 must be a whole number >= 1"),
        ("grain.prefetch", 0, "--config.grain.prefetch=0 must be a whole number >= 1"),
    ],
)
def test_bad_values_are_refused_with_one_line(field, value, message):
    config = load_config("default")
    config.update_from_flattened_dict({field: value})
    with pytest.raises(UserError, match=message.replace("(", r"\(")) as exc:
        config_lib.validate(config)
    assert "\n" not in str(exc.value)


def test_a_module_of_config_imports_that_exits_is_one_line(tmp_path, monkeypatch):
    """sys.exit in a plug-in ended the run with no line (exit status 0 or its code)."""
    (tmp_path / "exiting_plug_in.py").write_text("import sys\n\nsys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "exiting_plug_in", raising=False)
    with pytest.raises(UserError) as refused:
        config_lib.import_modules(("exiting_plug_in",))
    assert str(refused.value) == (
        "--config.imports: importing 'exiting_plug_in' called sys.exit(3); a module of "
        "config.imports must not exit"
    )
