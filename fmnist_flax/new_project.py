"""`python -m fmnist_flax.new_project DIR --name=NAME`: a new project from this template, its
package renamed NAME, depending on the runtime library instead of copying it
(`runtime/project_template.py`); `--with_codelab` keeps the codelab's demonstrations."""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Sequence

from fmnist_flax.runtime import project_template
from fmnist_flax.runtime.errors import UserError, error_line

PACKAGE = pathlib.Path(__file__).parent
TEMPLATE = project_template.Template(
    root=PACKAGE.parent,
    package=PACKAGE.name,
    never=("tests/runtime", "tests/repository"),  # the runtime's and this repository's own
    optional=(f"{PACKAGE.name}/codelab", "tests/codelab", "scripts"),
)


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not argparse's usage and message
        error_line(f"{message} (usage: {self.format_usage().strip().removeprefix('usage: ')})")
        sys.exit(2)


def main(argv: Sequence[str] | None = None) -> None:
    parser = Parser(prog=f"python -m {__name__}", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="the new project's directory (new or empty)")
    parser.add_argument("--name", required=True, help="its package, e.g. my_project")
    parser.add_argument("--with_codelab", action="store_true", help="keep the demonstrations")
    args = parser.parse_args(argv)
    try:
        done = project_template.create(
            TEMPLATE, args.directory, args.name, with_optional=args.with_codelab
        )
    except UserError as exc:
        error_line(str(exc))
        sys.exit(1)
    print(done)


if __name__ == "__main__":
    main()
