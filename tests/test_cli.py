"""`python main.py` as a user runs it: outputs, and one clear line for each mistake."""

from __future__ import annotations

import errno
import itertools
import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest
from absl import flags
from conftest import REPO, assert_one_line_error, run_main
from flax import nnx
from ml_collections import config_flags

from fmnist_flax import cli, experiment, launch
from fmnist_flax.runtime import command_line, ensemble, errors
from fmnist_flax.runtime.errors import UserError


@pytest.mark.slow
def test_main_trains_with_shorthand_flags_and_config_overrides(tmp_path):
    args = (
        "--compute_dtype=bfloat16",
        "--steps=12",
        "--log_every=5",
        "--config.model.hidden=(64,32)",
        "--report=basic",
        f"--workdir={tmp_path / 'w'}",
    )
    result = run_main(*args)
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "w" / "summary.json").read_text())
    assert summary["compute_dtype"] == "bfloat16"
    assert summary["config"]["model"]["hidden"] == [64, 32]
    assert summary["steps"] == 12
    assert "Training metrics" in result.stdout and "Device placement" in result.stdout
    # The set-up says it computes in bfloat16 (the parameter table's dtypes say float32).
    assert "Compute dtype    bfloat16 (parameters and optimizer state float32)" in result.stdout
    steps = [json.loads(r)["step"] for r in (tmp_path / "w" / "metrics.jsonl").open()]
    assert steps == [1, 5, 10, 12]
    # The same command again: nothing to do, and the finished run is left as it was.
    before = (tmp_path / "w" / "summary.json").read_bytes()
    again = run_main(*args)
    assert again.returncode == 0 and "nothing to do" in again.stdout
    assert (tmp_path / "w" / "summary.json").read_bytes() == before


@pytest.mark.slow
def test_without_workdir_a_fresh_run_directory_is_made_and_printed(tmp_path):
    result = run_main("--steps=2", "--report=none", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert result.stdout.count(f"workdir: runs/{run_dir.name}") == 2  # at start and at end
    assert (run_dir / "summary.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flag", "expected"),
    [
        ("--compute_dtype=float16x", "--compute_dtype='float16x' is not one of"),
        ("--steps=-1", "--steps=-1 must be a whole number in 1.."),
        ("--batch_size=0", "--batch_size=0 must be a whole number in 1.."),
        ("--batch_size=60001", "is larger than the 60,000 training examples"),
        ("--steps=many", "--steps"),
        ("--no_such_flag=1", "no_such_flag"),
        ("--report=pretty", "--report='pretty' is not one of full, basic, none"),
        ("--config.checkpoint_min_interval_secs=-5", "must be a number of seconds >= 0"),
        ("--mode=serve", "--mode"),
        ("--data_dir=/nonexistent/fmnist", "is not a directory"),
        ("shoe.png", "unexpected arguments shoe.png; flags look like --steps=400"),
        ("--config.optimizer.momentum=0.9", "optimizer 'adamw' does not take momentum; its own"),
        ("--config.optimizer.name=adagrad", "--config.optimizer.name='adagrad' is not one of"),
        ("--init_from=/nonexistent/run", "--init_from /nonexistent/run does not exist"),
        ("--config.dataset.name=arrays", "needs --data_dir=DIR holding train.npz and test.npz"),
    ],
)
def test_bad_flags_exit_non_zero_with_one_line(flag, expected, tmp_path):
    assert_one_line_error(run_main(flag, f"--workdir={tmp_path / 'w'}"), expected)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (("--mode=eval", "--step=²"), "--step=² must be a step number or 'best'"),
        (("--mode=predict", "--member=²"), "--member=² must be a member number, 'best' or"),
        (("--init_from=/nonexistent/run:²",), "--init_from /nonexistent/run:² does not exist"),
        (("--init_from=/nonexistent/run@²",), "--init_from /nonexistent/run@² does not exist"),
    ],
)
def test_digits_int_refuses_are_no_numbers(flags, expected, tmp_path):
    """'²' passes str.isdigit and fails int(): each was a ValueError traceback."""
    assert_one_line_error(run_main(*flags, f"--workdir={tmp_path / 'w'}"), expected)


def test_a_directory_whose_name_ends_as_a_step_or_member_is_taken_whole(tmp_path):
    """`--init_from=runs/a:20` named runs/a, step 20, even where runs/a:20 is the directory."""
    for name in ("a:20", "b:best", "c@3", "d:20@best"):
        directory = str(tmp_path / name)
        (tmp_path / name).mkdir()
        assert experiment.parse_init_from(directory) == (directory, None, None)
    assert experiment.parse_init_from(f"{tmp_path}/a:20:10") == (f"{tmp_path}/a:20", 10, None)
    assert experiment.parse_init_from(f"{tmp_path}/c@3@1") == (f"{tmp_path}/c@3", None, 1)
    (tmp_path / "a").mkdir()  # beside a:20, step 20 of `a` is `a/:20`
    assert experiment.parse_init_from(f"{tmp_path}/a/:20") == (f"{tmp_path}/a/", 20, None)
    assert experiment.parse_init_from(f"{tmp_path}/e:20@3") == (f"{tmp_path}/e", 20, 3)


def test_only_ascii_digits_make_a_step_or_member_number():
    assert errors.is_digits("120") and not errors.is_digits("²") and not errors.is_digits("")
    assert experiment.parse_init_from("runs/a:²@²") == ("runs/a:²@²", None, None)
    assert experiment.parse_init_from("runs/a:20@3") == ("runs/a", 20, 3)
    with pytest.raises(UserError, match="--member=² must be a member number"):
        ensemble.parse_member("²")


@pytest.mark.slow
def test_importing_the_package_main_runs_nothing(tmp_path):
    """It ran the whole CLI: a training run, or "flag 'config' is defined twice"."""
    done = subprocess.run(
        [sys.executable, "-c", "import fmnist_flax.__main__"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    assert list(tmp_path.iterdir()) == []


TOO_LONG = "x" * 300  # one name past every common filesystem's limit of 255 bytes


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (("--data_dir=/tmp/" + TOO_LONG,), "a name in it is longer than the filesystem allows"),
        (("--mode=prepare", "--output=/tmp/" + TOO_LONG), "longer than the filesystem allows"),
        (("--mode=eval", "--workdir=/tmp/" + TOO_LONG), "cannot be looked at (File name too"),
    ],
)
def test_a_path_with_a_name_too_long_is_one_line(flags, expected, tmp_path):
    """ENAMETOOLONG from any path flag: it was a traceback wherever no check looked first."""
    workdir = () if "--mode=" in flags[0] else (f"--workdir={tmp_path / 'w'}",)  # training
    assert_one_line_error(run_main(*flags, *workdir), expected)


# main.py with an object whose finaliser speaks if the interpreter's teardown runs.
WITH_FINALISER = """
import sys
class Teardown:
    def __del__(self):
        print("interpreter teardown", flush=True)
keep = Teardown()
sys.argv[0] = "main.py"
from fmnist_flax import cli
if sys.argv[1:]:
    cli.run()
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "status", "last_line"),
    [
        (("--steps=2", "--report=none"), 0, "time "),  # + --workdir below
        (("--steps=0",), 1, ""),
        (("--no_such_flag=1",), 2, ""),
        ((), 0, "interpreter teardown"),  # the package imported, no command run
    ],
)
def test_a_finished_command_leaves_without_the_interpreters_teardown(
    args, status, last_line, tmp_path
):
    """The exit status and every line of output stay; only the interpreter's teardown is skipped."""
    args = (*args, f"--workdir={tmp_path / 'w'}") if "--report=none" in args else args
    result = subprocess.run(
        [sys.executable, "-c", WITH_FINALISER, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == status, result.stderr
    lines = result.stdout.splitlines() or [""]
    assert lines[-1].startswith(last_line)
    assert ("interpreter teardown" in result.stdout) == (not args)
    if status:
        assert result.stderr.startswith("error: ")


@pytest.mark.slow
def test_output_closed_by_its_reader_stops_with_one_line_not_a_traceback(tmp_path):
    """`main.py | head -1`: the run stops as a pipe's writer does (status 141), no traceback."""
    process = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "main.py"),
            "--steps=2",
            "--report=none",
            f"--workdir={tmp_path / 'w'}",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout.readline().startswith("workdir: ")
    process.stdout.close()  # what `head -1` does after its line
    stderr = process.stderr.read()
    assert process.wait(timeout=300) == errors.PIPE_CLOSED_STATUS
    assert "Traceback" not in stderr
    assert stderr.splitlines()[-1].startswith("error: the output was closed by the command")


@pytest.mark.slow
def test_help_lists_the_projects_flags_and_exits_zero():
    result = run_main("--help")
    assert result.returncode == 0, result.stderr
    for flag in ("--steps", "--compute_dtype", "--workdir", "--mode", "--config.FIELD"):
        assert flag in result.stdout, flag
    assert "(default: fmnist_flax/config.py)" in result.stdout  # not the config as YAML
    assert "!!python" not in result.stdout and "  --config.model.hidden=" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("config_file", "flag", "expected"),
    [
        (None, "--config=configs/nope.py", "--config=configs/nope.py cannot be loaded"),
        (None, "--config=configs", "--config=configs cannot be loaded (it is a directory)"),
        ("x = 1\n", None, "cannot be loaded (it defines no get_config())"),
        ("def get_config():\n    raise ValueError('boom')\n", None, "cannot be loaded (boom)"),
        ("def get_config(:\n", None, "cannot be loaded ("),
        (None, "--config.nonexistent=1", "--config.nonexistent: config has no field"),
        (None, "--config.model.hiden=1", "config.model has no field 'hiden'; its fields are"),
        (None, "--config.steps=abc", "--config.steps=abc: not a valid int for this field"),
    ],
)
def test_every_config_mistake_is_one_line(config_file, flag, expected, tmp_path):
    if config_file is not None:
        (tmp_path / "bad.py").write_text(config_file)
        flag = f"--config={tmp_path / 'bad.py'}"
    assert_one_line_error(run_main(flag, f"--workdir={tmp_path / 'w'}"), expected)


@pytest.mark.slow
def test_python_m_runs_the_packaged_default_from_any_directory(tmp_path):
    """No configs/ around: the default config comes from the package."""
    result = subprocess.run(
        [sys.executable, "-m", "fmnist_flax", "--steps=3", "--report=none", "--workdir=w"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "w" / "summary.json").read_text())["steps"] == 3


def test_config_mistakes_are_explained_in_process(tmp_path):
    """The fast tier's check of the explanations the slow tests above see as a user does."""
    (tmp_path / "bad.py").write_text("x = 1\n")
    bad = f"--config={tmp_path / 'bad.py'}"
    default = cli.DEFAULT_CONFIG
    explain = command_line.explain_config_error
    assert "defines no get_config()" in explain(["m", bad], ValueError(), default)
    assert "its fields are hidden, name" in explain(
        ["m", "--config.model.hiden=1"], ValueError(), default
    )
    assert explain(["m", "--config.steps=x"], ValueError(), default).startswith(
        "--config.steps=x: not a valid int"
    )


# Mistakes an attacker found blamed on an earlier valid flag, or printed as a 25-line dump.
LATER_CONFIG_MISTAKES = [
    (
        ("--config.checkpoint_min_interval_secs=0", "--config.nope=2"),
        "--config.nope: config has no field 'nope'",
    ),
    (
        ("--config.dataset.name=records", "--config.grain.workers=1.5"),
        "--config.grain.workers=1.5: not a valid int for this field (0 now)",
    ),
    (("--config.steps=1", "--config.steps=abc"), "--config.steps=abc: not a valid int"),
    (("--config.optimizer=3",), "--config.optimizer=3: config.optimizer is a group of fields"),
]


def config_mistake(*overrides: str) -> str:
    """The line for `overrides`, explaining the exception ml_collections really raises."""
    argv = ["main.py", *overrides]
    values = flags.FlagValues()
    try:
        holder = config_flags.DEFINE_config_file(
            "config", cli.DEFAULT_CONFIG, flag_values=values, sys_argv=argv
        )
        values(argv)
        holder.value.to_dict()
    except Exception as exc:  # what cli.define_config_flag and cli.parse_flags catch
        return command_line.explain_config_error(argv, exc, cli.DEFAULT_CONFIG)
    pytest.fail(f"{overrides} were accepted")


@pytest.mark.parametrize(("overrides", "expected"), LATER_CONFIG_MISTAKES)
def test_the_config_flag_that_fails_is_named_not_an_earlier_valid_one(overrides, expected):
    line = config_mistake(*overrides)
    assert line.startswith(expected), line
    assert "\n" not in line and "FieldReference" not in line and len(line) < 400


@pytest.mark.slow
@pytest.mark.parametrize(("overrides", "expected"), LATER_CONFIG_MISTAKES)
def test_a_later_config_mistake_is_one_true_line_for_a_user(overrides, expected, tmp_path):
    assert_one_line_error(run_main(*overrides, f"--workdir={tmp_path / 'w'}"), expected)


def test_a_long_reason_is_shortened_between_words_keeping_its_cause():
    with pytest.raises(ValueError) as flax_error:  # 231 characters, once cut at 200 mid-word
        nnx.Param(jnp.ones(2), out_sharding=jax.sharding.PartitionSpec("x"))
    assert errors.reason(flax_error.value) == str(flax_error.value)
    assert errors.reason(flax_error.value).endswith("4844-var-eager-sharding.html.")
    chain = (
        "DATA_LOSS: Error opening driver: "
        + "Error reading a key in the database at a local file: " * 6
        + "Encoded length (5) is less than minimum length (16)"
    )
    short = errors.shorten(chain)
    assert short.startswith("DATA_LOSS: ...: ") and len(short) <= errors.REASON_CHARS
    assert short.endswith(": Encoded length (5) is less than minimum length (16)")
    prose = "The model cannot be built. " + "Its reason goes on at length. " * 20
    assert errors.shorten(prose).startswith("The model cannot be built. Its reason")
    assert errors.shorten(prose).endswith("at length. ...")
    words = errors.shorten("averyveryverylongword " * 30)
    assert words.endswith("averyveryverylongword ...") and len(words) <= errors.REASON_CHARS


@pytest.mark.parametrize(
    ("argv", "variable", "wanted"),
    [
        (["--debug"], "", True),
        (["--debug=false"], "", False),
        (["--debug", "--nodebug"], "", False),
        ([], "1", True),
        ([], "true", True),
        ([], "0", False),
        ([], "false", False),
        ([], " False ", False),
        ([], "off", False),
    ],
)
def test_debug_is_the_flag_or_the_environment_variable(argv, variable, wanted, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["main.py", *argv])
    monkeypatch.setenv(errors.DEBUG_VARIABLE, variable)
    assert errors.debugging() is wanted


@pytest.mark.slow
@pytest.mark.parametrize("how", ["--debug", errors.DEBUG_VARIABLE])
def test_debug_prints_the_full_traceback_above_the_one_line(how, tmp_path):
    """A flag mistake (reported before absl parses --debug) and a mode's UserError."""
    env = {**os.environ, errors.DEBUG_VARIABLE: "1" if how != "--debug" else "0"}
    flag = ["--debug"] if how == "--debug" else []
    for args, said, where in [
        (("--config.steps=abc",), "error: --config.steps=abc: not a valid int", "absl"),
        (("--mode=eval", f"--workdir={tmp_path}"), "error: --workdir ", "inference.py"),
    ]:
        result = run_main(*args, *flag, env=env)
        assert result.returncode != 0
        assert result.stderr.splitlines()[-1].startswith(said), result.stderr
        assert "Traceback (most recent call last)" in result.stderr and where in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("signum", errors.STOP_SIGNALS)
@pytest.mark.parametrize("after", [0.3, 0.8, 1.5])  # after the interpreter starts
def test_a_signal_while_starting_is_one_line_with_its_status(signum, after, tmp_path):
    """Ctrl-C, SIGTERM, SIGHUP or SIGQUIT while the libraries are imported, the config read or
    the data loaded: one `error:` line and the signal's exit status, never a traceback, a
    silent 143 or a core dump; nothing is written."""
    process = subprocess.Popen(
        [sys.executable, str(REPO / "main.py"), f"--workdir={tmp_path / 'w'}", "--report=none"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(after)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signum, stderr
    lines = [line for line in stderr.splitlines() if line and "No GPU found" not in line]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert signal.Signals(signum).name in lines[0], lines[0]
    if " at step " not in lines[0]:  # stopped before training (the usual case): no checkpoint
        checkpoints = tmp_path / "w" / "checkpoints"
        assert not checkpoints.exists() or not any(checkpoints.iterdir())


def test_the_packages_notebook_names_show_in_dir():
    """`dir(fmnist_flax)` (a notebook's tab completion) hid load_model and the rest: they are
    imported when first used."""
    import fmnist_flax

    assert set(fmnist_flax.__all__) <= set(dir(fmnist_flax)), dir(fmnist_flax)
    assert "load_model" in fmnist_flax.__all__ and "__name__" in dir(fmnist_flax)


def test_the_launcher_answers_the_signals_the_runtime_stops_on():
    """launch.py answers signals before the runtime is imported, so it keeps its own tuple."""
    assert launch.STOP_SIGNALS == errors.STOP_SIGNALS


def test_a_failed_write_to_the_output_is_said_once_naming_its_cause():
    """A write to /dev/full, or to a pipe whose reader left, raised OSError wherever it was
    printed. The guarded output says it once, as one `OutputFailed` line with the exit
    status a user expects (a pipe writer's 141), or tells a listener (training, which saves
    first); later writes go to /dev/null."""
    with open("/dev/full", "w") as full:
        guarded = errors.GuardedOutput(full)
        with pytest.raises(errors.OutputFailed) as exc:
            print("x" * 10_000, file=guarded, flush=True)
        assert str(exc.value).startswith("the output could not be written (No space left on ")
        assert exc.value.exit_code == 1 and "\n" not in str(exc.value)
        print("more", file=guarded, flush=True)  # into /dev/null now
    reader, writer = os.pipe()
    os.close(reader)
    with os.fdopen(writer, "w") as pipe:
        heard: list[OSError] = []
        guarded = errors.GuardedOutput(pipe)
        guarded.listener = heard.append
        print("row", file=guarded, flush=True)
        assert [error.errno for error in heard] == [errno.EPIPE]
        said = errors.OutputFailed(heard[0])
        assert said.exit_code == errors.PIPE_CLOSED_STATUS == 141
        assert str(said).startswith("the output was closed by the command reading it")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--step=50"],
            "--step is not used by --mode=train (it is for --mode=eval/predict/export); did you "
            "mean --steps? Nothing was run",
        ),
        (
            ["--output=x.json"],
            "--output is not used by --mode=train (it is for --mode=eval/predict/export/prepare"
            "/benchmark); remove it. Nothing was run",
        ),
        (["--images=a.png"], "--images is not used by --mode=train (it is for --mode=predict)"),
        (
            ["--mode=eval", "--workdir=w", "--batch_size=8"],
            "--batch_size is not used by --mode=eval",
        ),
        (["--mode=predict", "--workdir=w", "--config.steps=3"], "--config.steps is not used by"),
        (["--mode=export", "--workdir=w", "--shards=3"], "--shards is not used by --mode=export"),
    ],
)
def test_a_flag_the_mode_does_not_use_is_one_line_and_nothing_runs(args, expected):
    with pytest.raises(errors.UserError) as exc:
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["main.py", *[a for a in args if not a.startswith("--config.")]])
        try:
            cli.check_mode_flags(["main.py", *args], flags.FLAGS.mode)
        finally:
            flags.FLAGS.unparse_flags()
    assert expected in str(exc.value) and "\n" not in str(exc.value)


def test_flags_a_mode_uses_pass_the_check():
    for mode, args in {
        "train": ["--steps=5", "--batch_size=8", "--workdir=w", "--report=none"],
        "eval": ["--workdir=w", "--step=best", "--output=e.json", "--data_dir=d"],
        "predict": ["--workdir=w", "--images=a.png", "--member=best", "--ema"],
        "prepare": ["--output=o", "--shards=2", "--data_dir=d"],
    }.items():
        argv = ["main.py", f"--mode={mode}", *args]
        flags.FLAGS.unparse_flags()
        try:
            flags.FLAGS(argv)
            cli.check_mode_flags([*argv, "--config.imports=()"], mode)
        finally:
            flags.FLAGS.unparse_flags()


def test_help_starts_with_usage_and_examples_and_shows_the_training_defaults():
    text = cli.help_text()
    lines = text.splitlines()
    assert lines[0].startswith("usage: python main.py")
    assert lines[2] == "Examples:" and all(
        line.startswith("  python main.py") for line in lines[3:6]
    )
    train = text.index("train (the default mode")
    assert train < text.index("--steps ") < text.index("eval, predict, export")
    for flag, default in (("steps", 400), ("batch_size", 512), ("learning_rate", 0.003)):
        first = next(k for k, line in enumerate(lines) if line.startswith(f"  --{flag} "))
        entry = [
            lines[first],
            *itertools.takewhile(lambda line: line.startswith(" " * 26), lines[first + 1 :]),
        ]
        assert f"(default: {default})" in entry[-1], entry  # whole, never split over lines
    assert max(len(line) for line in lines) <= 100


def test_help_fits_the_terminal_and_lists_the_config_as_flags(monkeypatch):
    """--help was laid out for 100 columns and showed the config only as --config's default,
    a YAML dump (`!!python/tuple - 256 - 128`). It fits the terminal's width (80 with none)
    and lists every field as the flag that sets it, with the default config's value."""
    monkeypatch.delenv("COLUMNS", raising=False)  # no terminal: pytest captures stdout
    text = cli.help_text()
    lines = text.splitlines()
    assert max(map(len, lines)) <= 80, [line for line in lines if len(line) > 80]
    assert "!!python" not in text
    fields = [line.strip() for line in lines if line.startswith("  --config.")]
    for field in (
        "--config.model.hidden='(256, 128)'",
        "--config.optimizer.learning_rate=0.003",
        "--config.augment.flip=False",
        "--config.data_dir=''",
        "--config.dataset.name=fashion_mnist",
        """--config.mesh.rules="(('mlp', 'model'), ('embed', None), ('classes', None))\"""",
    ):
        assert field in fields, fields
    assert len(fields) == len(set(fields)) > 40
    monkeypatch.setenv("COLUMNS", "120")
    assert 80 < max(map(len, cli.help_text().splitlines())) <= 100


def test_demonstrations_asked_for_once_the_codelab_is_deleted_are_none(quick_config, monkeypatch):
    """config.demonstrations=True with fmnist_flax/codelab/ gone: the run has no extension."""
    monkeypatch.setattr(cli, "EXTENSIONS", ("fmnist_flax.codelab_deleted.demonstrations",))
    assert quick_config.demonstrations is True and cli.extensions(quick_config) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("def get_config():\n    raise SystemExit(3)\n", "loading it called sys.exit(3)"),
        ("def get_config():\n    raise ValueError('bad')\n", "cannot be loaded (bad)"),
    ],
)
def test_a_config_file_that_exits_or_fails_is_one_line_and_runs_once(body, expected, tmp_path):
    """A config calling sys.exit ended the run silently with its status; one that raised ran
    its top level a second time to explain the error."""
    path = tmp_path / "config.py"
    path.write_text(f"print('top level ran')\n{body}")
    result = run_main(f"--config={path}", "--steps=1")
    assert_one_line_error(result, f"--config={path}")
    assert expected in result.stderr and result.returncode == 2
    assert result.stdout.count("top level ran") == 1
