"""`python -m fmnist_flax.new_project DIR --name=NAME`: a new project from this template, its
package renamed NAME, depending on the runtime library instead of copying it
(`runtime/project_template.py`); `--with_codelab` keeps the codelab's demonstrations."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

from fmnist_flax.runtime import project_template

PACKAGE = pathlib.Path(__file__).parent
TEMPLATE = project_template.Template(
    root=PACKAGE.parent,
    package=PACKAGE.name,
    never=("tests/runtime", "tests/repository"),  # the runtime's and this repository's own
    optional=(f"{PACKAGE.name}/codelab", "tests/codelab", "scripts"),  # --with_codelab's
)


def main(argv: Sequence[str] | None = None) -> None:
    project_template.main(TEMPLATE, f"python -m {__name__}", argv, optional_flag="with_codelab")


if __name__ == "__main__":
    main()
