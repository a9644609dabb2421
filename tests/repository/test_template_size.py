"""This repository's template stays short enough to read in one sitting (a project that grows
from it carries no such limit): generic machinery belongs in the runtime, behind a small API."""

from __future__ import annotations

from conftest import REPO

PACKAGE = REPO / "fmnist_flax"
# The most lines the template's top-level modules hold together, and without the loop
# (train.py).
TEMPLATE_LINES = 2_500
TEMPLATE_BESIDES_LOOP_LINES = 1_650


def test_the_template_stays_short_enough_to_read_in_one_sitting():
    sizes = {path.name: len(path.read_text().splitlines()) for path in PACKAGE.glob("*.py")}
    besides_loop = sum(lines for name, lines in sizes.items() if name != "train.py")
    assert sum(sizes.values()) <= TEMPLATE_LINES, sorted(sizes.items())
    assert besides_loop <= TEMPLATE_BESIDES_LOOP_LINES, sorted(sizes.items())
