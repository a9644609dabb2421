"""The command line's generic parts: one line and an exit status for every mistake (absl's
parser's, `--config`'s and those raised while a mode runs), the explanation of a bad `--config`
file or `--config.FIELD=VALUE` override (which field is missing, which value its type
refuses), for any ml_collections config, and --help listing each mode's flags.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import importlib.util
import os
import runpy
import shlex
import signal
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import ml_collections
from absl import flags
from ml_collections import config_flags
from ml_collections.config_flags import config_path as config_fields
from ml_collections.config_flags import tuple_parser

from . import ensemble, errors, export, inference, library_workarounds, parallel, stopping, tables
from .checkpoint import BEST
from .errors import UserError, error_line

HELP_FLAGS = {"-h", "--help", "-help", "--helpshort", "--helpfull"}
NO_BREAK = "\xa0"  # keeps "(default: 512)" on one line of --help

# The parsers of a --config.FIELD's value by the field's type, as ml_collections parses them.
FIELD_LIST_CHARS = 300  # how much of a group's field names a missing field's line lists
VALUE_PARSERS = {
    int: flags.IntegerParser,
    float: flags.FloatParser,
    bool: flags.BooleanParser,
    tuple: tuple_parser.TupleParser,
}


# A multi-process run (jax.distributed) starts the same command on every host with these.
MULTIPROCESS_FLAGS = (
    "coordinator_address",
    "num_processes",
    "process_id",
    "distributed",
    "distributed_timeout",
)


def define_multiprocess_flags() -> None:
    """Define MULTIPROCESS_FLAGS, which `start_processes` reads."""
    flags.DEFINE_string(
        "coordinator_address", None, "Multi-process: host:port of process 0, reachable from all."
    )
    flags.DEFINE_integer("num_processes", None, "Multi-process: how many in all.")
    flags.DEFINE_integer("process_id", None, "Multi-process: this one's index, 0..N-1.")
    flags.DEFINE_bool(
        "distributed",
        False,
        "Multi-process on a cluster JAX detects (SLURM, Open MPI, Kubernetes).",
    )
    flags.DEFINE_integer(
        "distributed_timeout", 300, "Multi-process: seconds to wait for every process to join."
    )


def multiprocess() -> bool:
    """Whether the command line asks for a multi-process run."""
    return bool(flags.FLAGS.coordinator_address or flags.FLAGS.distributed)


def start_processes() -> None:
    """Join the run's other processes as MULTIPROCESS_FLAGS say (`parallel.initialize`)."""
    given = flags.FLAGS
    parallel.initialize(
        given.coordinator_address,
        given.num_processes,
        given.process_id,
        auto=given.distributed,
        timeout_s=given.distributed_timeout,
    )


def define_inference_flags() -> None:
    """--step, --member, --ema and --images: what eval, predict and export read of a trained
    workdir (`run_inference`)."""
    flags.DEFINE_string(
        "step",
        None,
        "eval/predict/export: checkpoint step, or 'best' (the best evaluation, kept with "
        "--config.keep_best=True); default the newest.",
    )
    flags.DEFINE_string(
        "member",
        None,
        "eval/predict/export of an ensemble run: a member number, 'best' (by test accuracy) or "
        "'ensemble' (the members' mean probabilities, the default).",
    )
    flags.DEFINE_bool(
        "ema",
        False,
        "eval/predict/export: the run's EMA of its parameters instead of the parameters (a run "
        "trained with --config.ema.decay > 0).",
    )
    flags.DEFINE_list(
        "images",
        [],
        "predict: pictures (PNG, JPEG, ...) or .npy arrays (H, W[, C]) or (N, H, W[, C]).",
    )


def run_inference(mode: str, workdir: str | None, output: str | None) -> None:
    """--mode=eval, predict or export of `workdir`, as `define_inference_flags`' flags,
    --compute_dtype and --data_dir say; `output`: the JSON file or the artifact."""
    if not workdir:
        raise UserError(f"--mode={mode} needs --workdir=DIR of a training run")
    given = flags.FLAGS
    chosen = {  # which step, member and parameters of the run
        "step": step_flag(given.step),
        "compute_dtype": given.compute_dtype,
        "member": ensemble.parse_member(given.member),
        "ema": given.ema,
    }
    if mode == "eval":
        inference.run_eval(workdir, data_dir=given.data_dir, output=output, **chosen)
    elif mode == "export":
        meta = export.export_model(workdir, output, **chosen)
        parallel.say(
            f"wrote {output} (step {meta['source']['step']}, for "
            f"{', '.join(meta['platforms'])}) and {output}{export.METADATA_SUFFIX}"
        )
    else:
        _, failed = inference.run_predict(workdir, given.images, output=output, **chosen)
        for line in failed:
            error_line(line)
        if failed:
            sys.exit(1)


def exists(name: str) -> bool:
    """Whether module `name` can be imported; False when it or its package was deleted."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # its package is gone
        return False


def fail(message: str, code: int, together: bool = False) -> None:
    """Say `message` in one line and exit with `code`. `together`: every process of a
    multi-process run stops here at once (a signal stops all at the same saved step).
    With --debug (or FMNIST_FLAX_DEBUG=1) the exception being handled comes first, whole."""
    errors.print_traceback(sys.exc_info()[1])
    error_line(message)
    # Leave at once (1) in a multi-process run: the other processes may be waiting in a
    # collective this one will never join, and a normal exit would wait for them at JAX's
    # shutdown barrier (is_initialized: process_count() would start the backends); (2) after
    # a failed save: Orbax's threads may still be inside tensorstore finishing its abandoned
    # writes, and the interpreter's shutdown would kill them mid-call (an abort, exit -6).
    if jax.distributed.is_initialized() or library_workarounds.abandoned_writes():
        if together and jax.distributed.is_initialized():
            # Leave through JAX's shutdown barrier: process 0 hosts the coordination service,
            # and a peer still leaving when it goes aborts with a C++ stack trace (exit -6).
            jax.distributed.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def parse_flags(
    argv: Sequence[str],
    help_text: Callable[[], str],
    config: flags.FlagHolder,
    default_config: str,
    check_mode: Callable[[], None],
    refused: dict[str, str],
) -> list[str]:
    """absl's parser, with --help printing `help_text()` and every mistake one line: the
    `config` flag's (`explain_config_error`), a flag value absl refuses (`refused`: absl's
    message prefix -> the line to say instead), then `check_mode()`'s UserError. The standard
    output is guarded first (`guard_output`): a failed write to it is one line too."""
    guard_output()
    asked = HELP_FLAGS & set(argv[1:])
    if asked:
        text = help_text()
        if "--helpfull" in asked:  # absl's own flags too (absl's --helpfull exits 1)
            text += f"\n\nEvery flag, absl's included:\n{flags.FLAGS.get_help()}"
        try:
            print(text, flush=True)
        except errors.OutputFailed as exc:  # `--help | head`: the reader has what it wanted
            if exc.exit_code != errors.PIPE_CLOSED_STATUS:
                fail(str(exc), exc.exit_code)
        sys.exit(0)
    try:
        remaining = flags.FLAGS(argv)
        config.value.to_dict()  # a file that failed to load raises only when used
    except flags.UnrecognizedFlagError as exc:
        if exc.flagname.startswith("config."):
            fail(explain_config_error(argv, exc, default_config), 2)
        fail(f"{exc} (see --help)", 2)
    except flags.Error as exc:
        if str(exc).startswith("flag --config"):
            fail(explain_config_error(argv, exc, default_config), 2)
        for prefix, line in refused.items():
            if str(exc).startswith(prefix):
                fail(line, 2)
        fail(f"{str(exc).splitlines()[0]} (see --help)", 2)
    except (Exception, SystemExit) as exc:  # the config file failed to load, or exited
        fail(explain_config_error(argv, exc, default_config), 2)
    try:
        check_mode()
    except UserError as exc:
        fail(str(exc), 2)
    return remaining


def define_config_flag(default_config: str) -> flags.FlagHolder:
    """`--config`, to be defined when the command line runs rather than at import:
    config_flags reads the `--config.FIELD` overrides from sys.argv as it defines the flag, and
    a mistake there must become one line like any other."""
    try:
        return config_flags.DEFINE_config_file(
            "config", default_config, "Config file; override fields with --config.FIELD=VALUE."
        )
    except (Exception, SystemExit) as exc:  # an unknown --config.FIELD, a file that fails
        fail(explain_config_error(sys.argv, exc, default_config), 2)


def guard_output() -> None:
    """Put `errors.GuardedOutput` around the standard output, before anything is printed: a
    failed write is then one line naming its cause (`one_line_errors`; in training, after
    saving the step reached). One closed from the start (`>&-`) is one line now."""
    try:
        errors.guard_output()
    except errors.OutputFailed as exc:
        fail(str(exc), exc.exit_code)


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """Every way a mode can stop, said in one line with its exit status: a UserError (a failed
    write to the standard output, `errors.OutputFailed`, among them), a signal (SIGINT, or
    another of `errors.STOP_SIGNALS` as `errors.Stopped`), a path name too long."""
    try:
        yield
    except UserError as exc:
        fail(str(exc), getattr(exc, "exit_code", 1), together=isinstance(exc, stopping.Interrupted))
    except KeyboardInterrupt as exc:  # a stop signal (`errors.Stopped`) outside training
        signum = getattr(exc, "signum", signal.SIGINT)
        fail(
            f"{signal.Signals(signum).name}: stopped; checkpoints saved so far are kept",
            128 + signum,
        )
    except OSError as exc:  # a path flag's name too long
        if exc.errno != errno.ENAMETOOLONG:
            raise
        fail(f"{exc.filename}: a name in it is longer than the filesystem allows; shorten it", 2)


def step_flag(value: str | None) -> int | str | None:
    """--step: a step number, 'best', or unset (the newest)."""
    if value is None or value == BEST:
        return value
    if not errors.is_digits(value):
        fail(f"--step={value} must be a step number or 'best'", 2)
    return int(value)


def config_path(argv: Sequence[str], default: str) -> str:
    """The --config file named on the command line, or `default`."""
    given = [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    return given[-1] if given else default


def explain_config_error(argv: Sequence[str], exc: BaseException, default_config: str) -> str:
    """One line for a --config mistake: a file that does not load, or a field it lacks;
    `default_config` is the file --config names when it is not given."""
    path = config_path(argv, default_config)
    said = str(exc)
    if isinstance(exc, SystemExit):
        return (
            f"--config={path}: loading it called sys.exit({exc.code!r}); a config file's "
            "get_config() must return a config"
        )
    if said.startswith(f"flag --config={path}: ") and "Traceback" in said:
        # The file raised as absl loaded it: said from its traceback, not run a second time.
        last = said.strip().splitlines()[-1]
        kind, _, message = last.partition(": ")
        reason = message if kind.isidentifier() and message else last
        return (
            f"--config={path} cannot be loaded ({reason}); pass a Python file whose "
            "get_config() returns a config, e.g. configs/bf16.py"
        )
    try:
        if os.path.isdir(path):
            raise IsADirectoryError("it is a directory")
        config = runpy.run_path(path)["get_config"]()
    except Exception as load_error:  # any error in the user's file is reported, not raised
        lines = str(load_error).strip().splitlines()
        reason = lines[-1] if lines else type(load_error).__name__
        if isinstance(load_error, KeyError):
            reason = "it defines no get_config()"
        return (
            f"--config={path} cannot be loaded ({reason}); pass a Python file whose "
            "get_config() returns a config, e.g. configs/bf16.py"
        )
    overrides = [arg.lstrip("-").partition("=")[::2] for arg in argv]
    overrides = [(name, value) for name, value in overrides if name.startswith("config.")]
    for name, _ in overrides:  # an unknown field first: no value of it can be checked
        missing = missing_field(config, name)
        if missing:
            return missing
    for name, value in overrides:  # absl names the flag whose value failed to parse
        if said.startswith(f"flag --{name}={value}: "):
            return bad_value(config, name, value)
    for name, value in overrides:  # else the first value its field's type refuses
        if value and refuses(config, name.removeprefix("config."), value):
            return bad_value(config, name, value)
    return f"{errors.shorten(said.splitlines()[0] if said else type(exc).__name__)} (see --help)"


def missing_field(config: ml_collections.ConfigDict, name: str) -> str | None:
    """The line for `--config.A.B` naming a field the config lacks, or None."""
    node, *parents = config, "config"
    for key in name.split(".")[1:]:
        if not isinstance(node, ml_collections.ConfigDict) or key not in node:
            fields = ", ".join(node.keys()) if isinstance(node, ml_collections.ConfigDict) else ""
            fields = errors.clip(fields, FIELD_LIST_CHARS)  # one line, however many there are
            return f"--{name}: {'.'.join(parents)} has no field {key!r}" + (
                f"; its fields are {fields}" if fields else ""
            )
        node, parents = node[key], [*parents, key]
    return None


def refuses(config: ml_collections.ConfigDict, field: str, value: str) -> bool:
    """Whether `value` cannot be parsed as `field`'s type (a group of fields takes none)."""
    kind = config_fields.get_type(field, config)
    if isinstance(kind, type) and issubclass(kind, ml_collections.ConfigDict):
        return True
    if kind not in VALUE_PARSERS:
        return False
    try:
        VALUE_PARSERS[kind]().parse(value)
    except ValueError:
        return True
    return False


def bad_value(config: ml_collections.ConfigDict, name: str, value: str) -> str:
    """The line for `--config.FIELD=VALUE` whose value its field cannot take."""
    field = name.removeprefix("config.")
    now = config_fields.get_value(field, config)
    if isinstance(now, ml_collections.ConfigDict):
        return (
            f"--{name}={value}: config.{field} is a group of fields, not a value; set them one "
            f"by one, --{name}.FIELD=VALUE; its fields are {', '.join(now.keys())}"
        )
    kind = config_fields.get_type(field, config)
    shown = errors.clip(repr(now), errors.QUOTE_CHARS)
    return f"--{name}={value}: not a valid {kind.__name__} for this field ({shown} now)"


def check_mode_flags(
    argv: Sequence[str],
    mode: str,
    given: Sequence[str],
    mode_flags: dict[str, Sequence[str]],
    every_mode: Sequence[str],
    config_fields_too: bool,
) -> None:
    """Refuse, in one line, a flag among `given` (those on the command line) that `mode` does
    not read (`every_mode`'s and `mode_flags[mode]`), with "did you mean" where one of its own
    is close, and, unless `config_fields_too`, a --config.FIELD other than --config.imports: it
    would be accepted and do nothing."""
    own = {*every_mode, *mode_flags[mode]}
    for name in given:
        if name not in own:
            close = difflib.get_close_matches(name, sorted(own), n=1, cutoff=0.75)
            users = [m for m, names in mode_flags.items() if name in names]
            hint = f"did you mean --{close[0]}?" if close else "remove it."
            raise UserError(
                f"--{name} is not used by --mode={mode} (it is for --mode={'/'.join(users)}); "
                f"{hint} Nothing was run"
            )
    fields = [a.split("=")[0] for a in argv[1:] if a.startswith("--config.")]
    unread = [field for field in fields if field != "--config.imports"]
    if unread and not config_fields_too:
        raise UserError(
            f"{unread[0]} is not used by --mode={mode}: it reads the run's saved config (only "
            "--config.imports, the modules it needs, may be given); remove it. Nothing was run"
        )


def help_text(
    usage: str,
    examples: Sequence[str],
    sections: dict[str, Sequence[str]],
    defaults: dict[str, Any],
    config: ml_collections.ConfigDict | None = None,
) -> str:
    """A usage line, examples, then each section's flags (those absl defines) with their help
    and default (`defaults` first, else the flag's), then `config`'s fields as the
    `--config.FIELD=VALUE` flags that set them, with its values; laid out for the terminal's
    width (`tables.text_width`: 80 where there is none)."""
    width = tables.text_width()
    lines = textwrap.wrap(f"usage: {usage}", width, subsequent_indent=" " * 7)
    lines += ["", "Examples:", *(f"  {example}" for example in examples)]
    for title, names in sections.items():
        lines += ["", f"{title}:"]
        for name in (name for name in names if name in flags.FLAGS):  # --config: once defined
            flag = flags.FLAGS[name]
            default = defaults.get(name, flag.default)
            if isinstance(default, list):
                default = ",".join(default)
            if isinstance(default, ml_collections.ConfigDict):  # --config: its file, not YAML
                default = shown_path(flag.config_filename)
            shown = "" if default in (None, "") else f" (default:{NO_BREAK}{default})"
            text = " ".join(flag.help.split()) + shown
            wrapped = textwrap.wrap(
                text,
                width,
                initial_indent=f"  --{name:<22}",
                subsequent_indent=" " * 26,
                break_on_hyphens=False,  # a path stays whole
            )
            lines += [line.replace(NO_BREAK, " ") for line in wrapped]
    if config is not None:
        lines += [
            "",
            "config fields (--config.FIELD=VALUE), with the values of the default config:",
        ]
        for field, value in config_fields_of(config):
            lines += textwrap.wrap(
                f"--config.{field}={value}",
                width,
                initial_indent="  ",
                subsequent_indent=" " * 6,
                break_long_words=False,
                break_on_hyphens=False,
            )
    else:
        example = "--config.model.hidden='(512, 128)'"
        lines += ["", f"Any config field: --config.FIELD=VALUE (e.g. {example})."]
    return "\n".join(lines)


def shown_path(path: str) -> str:
    """`path` relative to the current directory where it lies below it, else as it is."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def config_fields_of(
    config: ml_collections.ConfigDict, prefix: str = ""
) -> Iterator[tuple[str, str]]:
    """Each field of `config` (groups opened, in order) and its value as a command line
    takes it, quoted for a shell where needed: ('model.hidden', "'(256, 128)'")."""
    for name, value in config.items():
        if isinstance(value, ml_collections.ConfigDict):
            yield from config_fields_of(value, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", shell_word(value if isinstance(value, str) else repr(value))


def shell_word(text: str) -> str:
    """`text` as one word of a shell command: as it is where that is safe, else in single
    quotes, or double quotes around one that holds single quotes (a tuple of names)."""
    quoted = shlex.quote(text)
    if quoted != text and "'" in text and not any(c in text for c in '"$`\\!'):
        return f'"{text}"'
    return quoted
