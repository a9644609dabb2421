"""The README and docs/ stay true: the README is a short landing page, its test command is the
one CI runs, every relative link (and #anchor) resolves, and every flag a command in them uses
is one main.py takes, so a renamed flag or a moved page fails here rather than for a reader."""

from __future__ import annotations

import ast
import functools
import importlib.util
import pathlib
import re
import shlex
import shutil
import subprocess
from typing import Any

import ml_collections
import pytest

from fmnist_flax import cli
from fmnist_flax.runtime import command_line

REPO = pathlib.Path(__file__).resolve().parents[2]
README = REPO / "README.md"
CI = REPO / ".ci" / "run"
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [README, *DOCS]
MAX_README_LINES = 200
TEST_COMMAND_START = ".venv/bin/ruff check"
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"`([^`\n]+)`")
# What says how the work went rather than what the software does: "stop 12" (a unit after the
# number is a duration or a count: "stop 2 s after") and a word that names a commit.
WORK_STEP = re.compile(r"\bstop \d+\b(?!\s*(?:s|ms|seconds?|minutes?|steps?)\b)", re.I)
HEX_WORD = re.compile(r"\b[0-9a-f]{7,40}\b")


def code_blocks(text: str) -> list[str]:
    """The contents of the fenced code blocks of a markdown text."""
    return FENCE.findall(text)


def prose(text: str) -> str:
    """The text outside fenced code blocks (where links and headings are)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", prose(text), re.M):
        base, n = slug(heading), 0
        while (name := base if n == 0 else f"{base}-{n}") in found:
            n += 1
        found.add(name)
    return found


def broken_links(page: pathlib.Path, text: str) -> list[str]:
    """Each relative link of `text` (written in `page`) whose file or #anchor does not exist."""
    broken = []
    for target in LINK.findall(prose(text)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target} (no file {file.relative_to(REPO)})")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            broken.append(f"{target} (no heading #{anchor} in {file.relative_to(REPO)})")
    return broken


def main_commands(text: str) -> list[list[str]]:
    """The arguments after `main.py` of every command in `text`'s code: fenced blocks line by
    line (backslash continuations joined), and inline code spans."""
    pieces = [
        line for block in code_blocks(text) for line in block.replace("\\\n", " ").splitlines()
    ]
    pieces += INLINE_CODE.findall(prose(text))
    commands = []
    for piece in pieces:
        try:
            words = shlex.split(piece, comments=True)
        except ValueError:  # an unbalanced quote in a prose span: not a command
            continue
        for i, word in enumerate(words):
            if word.endswith("main.py"):
                args = []
                for arg in words[i + 1 :]:
                    if arg in ("&&", "||", ";", "|", "&") or arg.endswith(";"):
                        break
                    args.append(arg)
                commands.append(args)
    return commands


def has_field(config: Any, dotted: str) -> bool:
    node = config
    for part in dotted.split("."):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            return False
        node = node[part]
    return True


@functools.cache
def config_of(path: str) -> Any:
    """`get_config()` of a config file, as main.py would load it."""
    spec = importlib.util.spec_from_file_location(f"_docs_config_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def unknown_flags(args: list[str], known: set[str]) -> list[str]:
    """The flags of one main.py command that main.py does not take: a name `--help` does not
    list, or a `--config.FIELD` that the command's config (default or `--config=FILE`) lacks."""
    config_file = str(REPO / "fmnist_flax" / "config.py")
    for arg in args:
        if arg.startswith("--config="):
            candidate = REPO / arg.split("=", 1)[1]
            if not candidate.is_file():
                return [arg]  # a config file that is gone: nothing else can be checked
            config_file = str(candidate)
    unknown = []
    for arg in args:
        if not arg.startswith("--"):
            continue
        name = arg[2:].split("=", 1)[0]
        if name.startswith("config."):
            if not has_field(config_of(config_file), name.removeprefix("config.")):
                unknown.append(arg)
        elif name not in known and not (name.startswith("no") and name[2:] in known):
            unknown.append(arg)
    return unknown


def git_repo() -> pathlib.Path | None:
    """This checkout's git directory's work tree, when git is installed and REPO is one (not a
    copy of the files, where commits cannot be looked up)."""
    if shutil.which("git") is None:
        return None
    top = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--show-toplevel"], capture_output=True, text=True
    )
    if top.returncode or pathlib.Path(top.stdout.strip()).resolve() != REPO:
        return None
    return REPO


def commits_named(words: list[str], repo: pathlib.Path) -> set[str]:
    """The words that git resolves to a commit of `repo` (one `git cat-file` for all)."""
    if not words:
        return set()
    found = subprocess.run(
        ["git", "-C", str(repo), "cat-file", "--batch-check"],
        input="".join(f"{word}^{{commit}}\n" for word in words),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    # "<sha> commit <size>" for a commit; "<word>^{commit} missing" (or ambiguous) otherwise
    return {word for word, line in zip(words, found, strict=True) if line.split()[1] == "commit"}


def diary_entries(texts: dict[str, str], repo: pathlib.Path | None) -> list[str]:
    """Each "stop N" and each commit hash of `repo` in `texts` (name -> text), as name: match."""
    entries = [
        f"{name}: {m.group()!r}" for name, text in texts.items() for m in WORK_STEP.finditer(text)
    ]
    if repo is not None:
        words = sorted({w for text in texts.values() for w in HEX_WORD.findall(text)})
        commits = commits_named(words, repo)
        entries += [
            f"{name}: commit {word}"
            for name, text in texts.items()
            for word in sorted(set(HEX_WORD.findall(text)) & commits)
        ]
    return entries


def test_no_page_or_module_keeps_a_diary_of_the_work() -> None:
    """The docs, the README and the package say what the software does: no "stop N" and no
    hash of one of this repository's commits (their history is in git)."""
    files = [*PAGES, *sorted((REPO / "fmnist_flax").rglob("*.py"))]
    texts = {str(path.relative_to(REPO)): path.read_text() for path in files}
    assert diary_entries(texts, git_repo()) == []


def test_the_diary_check_catches_a_step_and_a_commit() -> None:
    assert diary_entries({"a.md": "As stop 44 found, ..."}, None) == ["a.md: 'stop 44'"]
    calm = "Ctrl-C makes the run stop 2 s later; stop 3 steps on; md5 8d4fb7e6c68d591d; 2147483647"
    assert diary_entries({"a.md": calm}, git_repo()) == []
    repo = git_repo()
    if repo is None:
        return  # a copy of the files, or no git: only the "stop N" part can be checked
    head = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--short=9", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert diary_entries({"b.py": f"# fixed in {head}, see"}, repo) == [f"b.py: commit {head}"]


def test_the_readme_is_a_landing_page() -> None:
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; reference goes in docs/"


def test_the_readme_test_command_is_the_one_ci_runs() -> None:
    ci = [line for line in CI.read_text().splitlines() if line.startswith(TEST_COMMAND_START)]
    readme = [
        line
        for block in code_blocks(README.read_text())
        for line in block.splitlines()
        if line.startswith(TEST_COMMAND_START)
    ]
    assert len(ci) == 1, ci
    assert readme == ci, f"README: {readme}\n.ci/run: {ci}"


def test_the_readme_set_up_installs_what_ci_installs() -> None:
    """The README's first command sets up what .ci/run sets up before the tests."""
    setup = next(
        block for block in code_blocks(README.read_text()) if "python3 -m venv .venv" in block
    )
    ci = CI.read_text()
    for step in ("dataset-fashion-mnist", "python3 -m venv .venv", "-e '.[test]'"):
        assert step in ci, f".ci/run no longer has {step!r}: update this test and the README"
        assert step in setup, f"the README's set-up lacks .ci/run's {step!r}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page: pathlib.Path) -> None:
    assert broken_links(page, page.read_text()) == []


# extending.md's recipes add the config fields their commands use; test_template.py runs them.
COMMAND_PAGES = [page for page in PAGES if page.name != "extending.md"]


@pytest.mark.parametrize("page", COMMAND_PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_flag_of_a_command_is_one_main_py_takes(
    page: pathlib.Path, help_flags: set[str]
) -> None:
    commands = main_commands(page.read_text())
    if page == README:
        assert len(commands) >= 10, commands  # the parser still finds the README's commands
    unknown = {
        arg
        for args in commands
        for arg in unknown_flags(args, help_flags)
        if cli.BENCHMARK or not arg.startswith("--bench_")  # docs a copy is left to edit
    }
    assert not unknown, f"{page.name} uses flags main.py does not take: {sorted(unknown)}"


def test_the_checks_catch_rot(help_flags: set[str]) -> None:
    """Each check above fails on a page that has rotted."""
    page = REPO / "docs" / "running.md"
    assert broken_links(page, "[x](missing.md)") != []
    assert broken_links(page, "[x](configs.md#no-such-heading)") != []
    assert broken_links(page, "[x](configs.md#fine-tuning---init_from)") == []
    assert broken_links(page, "```\n[x](missing.md)\n```\n") == []  # code is not a link
    rotted = "```bash\n.venv/bin/python main.py --stepz=4 --config.modle.hidden=1 # --x\n```\n"
    (args,) = main_commands(rotted)
    assert unknown_flags(args, help_flags) == ["--stepz=4", "--config.modle.hidden=1"]
    (args,) = main_commands("run `python main.py --steps=4 --config.model.hidden='(8,)'`")
    assert unknown_flags(args, help_flags) == []
    (args,) = main_commands("`python main.py --config=configs/cnn.py --config.model.dense=8`")
    assert unknown_flags(args, help_flags) == []
    (args,) = main_commands("`python main.py --config=configs/gone.py --steps=4`")
    assert unknown_flags(args, help_flags) == ["--config=configs/gone.py"]
    assert slug("Fine-tuning: `--init_from`") == "fine-tuning---init_from"


# Flags that leave what a run computes as it is: where it writes, how far it trains, its
# report, how it is spread over processes. A config file that is the default is none.
SAME_COMPUTATION = ("--workdir=", "--steps=", "--report=", "--config=configs/default.py")
SAME_COMPUTATION += tuple(f"--{name}=" for name in command_line.MULTIPROCESS_FLAGS)


def workdir_clashes(pages: dict[str, str]) -> list[str]:
    """Each training command of `pages` (name -> text, in reading order) that names a
    --workdir an earlier one trained with other values: followed in order, main.py refuses it
    as a changed config."""
    first: dict[str, tuple[str, list[str]]] = {}
    clashes = []
    for name, text in pages.items():
        for args in main_commands(text):
            workdirs = [arg.split("=", 1)[1] for arg in args if arg.startswith("--workdir=")]
            if not workdirs or any(arg.startswith("--mode=") for arg in args):
                continue
            values = sorted(arg for arg in args if not arg.startswith(SAME_COMPUTATION))
            where, before = first.setdefault(workdirs[-1], (name, values))
            if values != before:
                clashes.append(f"{name}: --workdir={workdirs[-1]} {values}, {where}: {before}")
    return clashes


def test_no_two_commands_of_the_docs_train_one_workdir_differently() -> None:
    """docs/running.md and docs/configs.md trained in runs/wide after the README trained there
    with another learning rate: a reader following the pages in order was refused."""
    assert workdir_clashes({page.name: page.read_text() for page in COMMAND_PAGES}) == []
    same = "`python main.py --workdir=runs/a --steps=200` then `python main.py --workdir=runs/a`"
    assert workdir_clashes({"a.md": same}) == []
    other = "`python main.py --workdir=runs/a --learning_rate=1e-3`"
    assert workdir_clashes({"a.md": same, "b.md": other}) == [
        "b.md: --workdir=runs/a ['--learning_rate=1e-3'], a.md: []"
    ]


ACCURACY = re.compile(r"\*{0,2}(\d\.\d+)\*{0,2}")


def accuracies(text: str) -> list[tuple[list[str], str, str]]:
    """(the main.py command's arguments, its test accuracy as written, the row) of each row of
    the tables in `text` with a `test accuracy` column and a command column."""
    found = []
    for table in re.findall(r"(?:^\|.*\|\n)+", prose(text), re.M):
        header, _, *rows = [line.strip("|").split(" | ") for line in table.splitlines()]
        header = [cell.strip().lower() for cell in header]
        if "test accuracy" not in header or "command" not in header:
            continue
        for cells in rows:
            figure = ACCURACY.match(cells[header.index("test accuracy")].strip())
            commands = main_commands(cells[header.index("command")])
            if figure and commands:
                found.append((commands[0], figure.group(1), " | ".join(cells)))
    return found


def config_built(args: list[str]) -> dict[str, Any]:
    """The config a main.py command trains with: its --config file, then its shorthand flags
    and --config.FIELD overrides (each parsed as its field's type)."""
    files = [arg.split("=", 1)[1] for arg in args if arg.startswith("--config=")]
    config = config_of(str(REPO / files[-1]) if files else str(REPO / "fmnist_flax/config.py"))
    config = ml_collections.ConfigDict(config.to_dict())
    for arg in args:
        name, _, value = arg.removeprefix("--").partition("=")
        field = cli.SHORTHANDS.get(name) or name.removeprefix("config.")
        if name in cli.SHORTHANDS or name.startswith("config."):
            node, *path = [config, *field.split(".")]
            for part in path[:-1]:
                node = node[part]
            now = node[path[-1]]
            node[path[-1]] = value if isinstance(now, str) else type(now)(ast.literal_eval(value))
    return config.to_dict()


def disagreeing_accuracies(pages: dict[str, str]) -> list[str]:
    """Each accuracy of a page's table that differs from another page's for a command that
    trains the same config (rows measured on a TPU left out: they differ by design)."""
    rows = [
        (name, config_built(args), figure, row)
        for name, text in pages.items()
        for args, figure, row in accuracies(text)
        if "TPU" not in row
    ]
    return [
        f"{name}: {figure} ({row}) but {other}: {other_figure} ({other_row})"
        for i, (name, config, figure, row) in enumerate(rows)
        for other, other_config, other_figure, other_row in rows[i + 1 :]
        if other != name and other_config == config and other_figure != figure
    ]


def test_every_page_gives_one_runs_test_accuracy_alike() -> None:
    """docs/configs.md gave bf16's accuracy as 0.872 and the default's as 0.873 where the
    README says 0.8728 for both (AVX-512)."""
    pages = {page.name: page.read_text() for page in PAGES}
    assert len(accuracies(pages["README.md"])) >= 5  # the parser still finds the tables
    assert disagreeing_accuracies(pages) == []
    readme = "| a | `python main.py --compute_dtype=bfloat16` | 0.8728 | 3 s |\n"
    header = "| run | command | test accuracy | training |\n|---|---|---|---|\n"
    configs = "| `python main.py --config=configs/bf16.py` | 0.872 |\n"
    configs = "| command | test accuracy |\n|---|---|\n" + configs
    assert len(disagreeing_accuracies({"a.md": header + readme, "b.md": configs})) == 1


@pytest.mark.slow
def test_a_tuple_field_given_one_value_holds_it_alone_as_docs_configs_says(tmp_path):
    """docs/configs.md's one conversion rule, as the command line applies it: one hidden
    layer of 256, said in the model table before training."""
    import json

    from conftest import REPO, run_main

    result = run_main(
        "--config.model.hidden=256", "--steps=1", "--report=none", f"--workdir={tmp_path}"
    )
    assert result.returncode == 0, result.stderr
    assert "MLP parameters: 203,530 trainable values" in result.stdout
    assert json.loads((tmp_path / "summary.json").read_text())["config"]["model"]["hidden"] == [256]
    rule = "`--config.model.hidden=256` is the one-hidden-layer MLP 784-256-10"
    assert rule in (REPO / "docs" / "configs.md").read_text()
