"""The report: every figure and table of the codelab from one run, as files a person opens."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from conftest import load_config
from flax import nnx
from PIL import Image

from fmnist_flax import datasets, train
from fmnist_flax.model import MLP
from fmnist_flax.runtime import inference, report

TABLE_TITLES = (  # every table of a run without the codelab's demonstrations
    "Set-up",
    "Fashion-MNIST loaded from IDX files",
    "Data arrays on the device",
    "MLP parameters: 235,146 trainable values",
    "Training metrics",
    "Evaluation",
    "Device placement",
)
FIGURE_SIZES = {  # (width, height) in pixels: figsize * DPI
    "examples_per_class.png": (1000, 500),
    "training_curve.png": (800, 400),
    "predictions.png": (1000, 1060),
    "confusion_matrix.png": (800, 700),
}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """A run with no extension: what report.py draws for any project copied from this one."""
    config = load_config("default")
    config.steps = 30
    config.log_every = 10
    workdir = tmp_path_factory.mktemp("report") / "w"
    return workdir, train.train_and_evaluate(config, workdir)


def blank(path) -> bool:
    with Image.open(path) as image:
        return np.asarray(image.convert("L"), np.float32).std() <= 10


@pytest.mark.slow
def test_a_full_run_writes_every_figure_readable_and_not_blank(full_run):
    workdir, summary = full_run
    assert {p.name for p in (workdir / "report").iterdir()} == {*FIGURE_SIZES, "report.html"}
    for name, size in FIGURE_SIZES.items():
        with Image.open(workdir / "report" / name) as image:
            assert image.size == size, name
        assert not blank(workdir / "report" / name), f"{name} looks blank"
    assert summary["report"] == str(workdir / "report" / "report.html")


@pytest.mark.slow
def test_report_html_is_self_contained_with_every_table_figure_and_the_config(full_run):
    workdir, _ = full_run
    page = (workdir / "report" / "report.html").read_text()
    for title in TABLE_TITLES:
        assert f"<h3>{title}" in page, title
    for name in FIGURE_SIZES:
        assert f"alt='{name}' src='data:image/png;base64," in page, name
    assert "235,146" in page
    assert re.search(r"""(src|href)\s*=\s*['"]?\s*(https?:)?//""", page) is None
    assert "<script" not in page and "<link" not in page and "@import" not in page
    assert '"steps": 30' in page  # the run's config


@pytest.mark.slow
def test_confusion_rows_sum_to_one_and_count_every_example(full_run):
    _, summary = full_run
    counts = np.array(summary["confusion_matrix"])
    assert counts.sum() == summary["test_examples"] == 10_000
    np.testing.assert_allclose(report.row_normalise(counts).sum(axis=1), 1.0, rtol=1e-12)
    assert report.row_normalise(np.zeros((2, 2))).sum() == 0  # empty rows stay finite


def test_colour_images_are_drawn_in_colour_and_grey_ones_in_grey():
    rng = np.random.default_rng(0)
    for channels in (3, 1):
        images = rng.integers(0, 256, (10, 8, 6, channels), dtype=np.uint8)
        labels = np.arange(10) % 5
        names = [f"class {i}" for i in range(5)]
        figures = (
            report.examples_per_class(images, labels, names, "Colours"),
            report.prediction_grid(images, labels, labels, names),
        )
        for fig in figures:
            (ax,) = fig.axes
            (shown,) = ax.images
            picture = shown.get_array()
            assert (shown.get_cmap().name == "gray") == (channels == 1)
            # The first image, in the picture's first drawn rows: as it is in colour, scaled
            # to its own range in grey.
            if channels == 3:
                drawn = np.flatnonzero(picture[..., 3].any(axis=1))
                np.testing.assert_array_equal(picture[drawn[0] : drawn[0] + 8, :6, :3], images[0])
            else:
                drawn = np.flatnonzero((~np.ma.getmaskarray(picture)).any(axis=1))
                grey = images[0, ..., 0].astype(np.float64)
                scaled = (grey - grey.min()) / (grey.max() - grey.min())
                np.testing.assert_allclose(picture[drawn[0] : drawn[0] + 8, :6], scaled)


def test_prediction_grid_marks_a_known_wrong_prediction_red(real_dataset):
    model = MLP(rngs=nnx.Rngs(0))
    model.layers[-1].bias[...] = model.layers[-1].bias[...].at[0].set(1e4)  # always "T-shirt"
    picks = report.sample_indices(len(real_dataset.test_images))
    images, labels = real_dataset.test_images[picks], real_dataset.test_labels[picks]
    predictions = inference.predict(model, images).argmax(axis=1)
    assert (predictions == 0).all()
    names = datasets.IDX_DATASETS["fashion_mnist"].class_names
    fig = report.prediction_grid(images, labels, predictions, names)
    for title, label in zip(fig.axes[0].texts, labels, strict=True):
        expected = report.GREEN if label == 0 else report.RED
        assert title.get_color() == expected
        assert title.get_text() == f"{names[0]} / {names[label]}"
    assert (labels != 0).any() and (labels == 0).any()  # both colours were exercised


def test_progress_bar_redraws_only_when_told(tmp_path):
    from fmnist_flax.runtime.tables import ProgressBar

    with (tmp_path / "log").open("w") as stream:
        bar = ProgressBar(400, stream)
        for step in (1, 200, 400):
            bar.update({"step": step, "loss": 1.0, "accuracy": 0.5, "grad_norm": 2.0})
        bar.close()
    lines = (tmp_path / "log").read_text().splitlines()
    assert len(lines) == 3
    assert lines[1].startswith("[" + "#" * 15 + "." * 15 + "] 200/400")


def test_progress_on_a_terminal_fits_its_width_and_keeps_the_newest_test_metrics(monkeypatch):
    """One line redrawn in place, never wider than the terminal: the bar and then the least
    telling fields go first; step, elapsed time, rate and ETA stay, and the test metrics of
    the last evaluation stay shown on the rows after it."""
    import io

    from fmnist_flax.runtime.tables import ProgressBar

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    row = {"step": 200, "loss": 0.41, "accuracy": 0.85, "grad_norm": 1.5}
    tested = {"test_loss": 0.45, "test_accuracy": 0.84}
    for columns in (80, 100, 200):
        monkeypatch.setenv("COLUMNS", str(columns))
        stream = Terminal()
        bar = ProgressBar(400, stream, examples_per_step=512)
        bar.update(row | tested, examples_per_sec=15_000.0)
        bar.update(row | {"step": 225}, examples_per_sec=15_000.0)
        bar.close()
        drawn = [line.replace("\x1b[K", "") for line in stream.getvalue().split("\r")[1:]]
        assert all(len(line.strip()) < columns for line in drawn), drawn
        assert drawn[1].startswith(("225/400", "[")) and "elapsed 0:00" in drawn[1]
        assert "15k ex/s" in drawn[1] and "eta 0:05" in drawn[1]  # 175 steps of 512
        assert "test_accuracy 84.0%" in drawn[1]  # the evaluation's, one row later
    assert drawn[1].startswith("[" + "#" * 16)  # 200 columns: room for the bar too


def test_progress_on_a_terminal_moves_between_rows_and_a_log_file_gets_rows_only(monkeypatch):
    """The CNN logs every 468 steps, minutes apart on a CPU: between rows the line on a
    terminal moves on with the step (`tick`), keeping the row's metrics and rate; a log
    file gets no line for a tick."""
    import io

    from fmnist_flax.runtime.tables import ProgressBar

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setenv("COLUMNS", "200")
    row = {"step": 100, "loss": 0.41, "accuracy": 0.85, "grad_norm": 1.5}
    for stream in (Terminal(), io.StringIO()):
        bar = ProgressBar(400, stream, examples_per_step=512)
        bar.tick(50)  # nothing drawn before the first row
        bar.update(row, examples_per_sec=10_240.0)
        bar.tick(300)
        bar.close()
        drawn = stream.getvalue()
        if stream.isatty():
            lines = [line.replace("\x1b[K", "") for line in drawn.split("\r")[1:]]
            assert len(lines) == 2 and "300/400" in lines[1] and "loss 0.4100" in lines[1]
            assert "eta 0:05" in lines[1]  # 100 steps of 512 at 10,240 examples/s
        else:
            assert drawn.count("\n") == 1 and "100/400" in drawn


def test_progress_shows_a_rate_and_eta_before_the_second_row(monkeypatch):
    """The CNN's rows are 468 steps apart and the first one's rate is unknown (its call
    compiled): minutes of training showed no rate or ETA. Between rows whose rate is unknown
    the line now times the steps since that row itself."""
    import io
    import time

    from fmnist_flax.runtime.tables import ProgressBar

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setenv("COLUMNS", "200")
    bar = ProgressBar(4680, Terminal(), examples_per_step=128)
    bar.update({"step": 1, "loss": 2.3, "accuracy": 0.1, "grad_norm": 1.0})
    began = time.perf_counter()
    time.sleep(0.2)
    bar.tick(41)  # 40 steps of 128 in about 0.2 s: about 25k examples/s
    seconds = time.perf_counter() - began
    bar.close()
    lines = [line.replace("\x1b[K", "") for line in bar.stream.getvalue().split("\r")[1:]]
    assert "ex/s" not in lines[0] and "eta" not in lines[0], lines  # the compiling call's
    rate = float(re.search(r"([\d.]+)k ex/s", lines[1]).group(1)) * 1000
    assert 40 * 128 / seconds * 0.8 < rate <= 40 * 128 / 0.2 * 1.01, (rate, lines[1])
    assert "eta " in lines[1] and "41/4680" in lines[1] and "loss 2.3000" in lines[1]


def test_the_report_names_its_run_and_right_aligns_numbers(tmp_path):
    """Every run's report had the same title and nothing said which run it was from."""
    from fmnist_flax.runtime.tables import Table

    table = Table.of("Scores", ("split", "accuracy", "examples"), [("test", "87.28%", "10,000")])
    about = {"workdir": "runs/w", "test accuracy": "0.8728 after 400 steps", "backend": "cpu"}
    page = report.write_html(
        tmp_path / "r.html", title="t", sections=[("1. S", [table])], config={}, about=about
    ).read_text()
    assert "<tr><th>workdir</th><td>runs/w</td></tr>" in page
    assert "<td>0.8728 after 400 steps</td>" in page  # said, not a column of numbers
    assert "<td>test</td><td class='num'>87.28%</td><td class='num'>10,000</td>" in page


def words_whole(table, lines: list[str]) -> list[str]:
    """The words (runs of letters and digits) of a table's cells and title that its printed
    `lines` cut in two: a path may break after a `/`, never inside a name."""
    printed = set(re.findall(r"\w+", " ".join(lines)))
    cells = [table.title, *table.headers, *(cell for row in table.rows for cell in row)]
    return sorted({word for cell in cells for word in re.findall(r"\w+", cell)} - printed)


def test_the_runs_tables_fit_80_columns_with_every_word_whole(real_dataset, monkeypatch):
    """At 80 columns the set-up table (100 wide), the data table (96) and the evaluation table
    (87) wrapped in the terminal mid-word. Laid out for the terminal's width, 80 with none
    (a file, a pipe), each line fits and no word is cut."""
    from fmnist_flax.runtime import parallel, tables
    from fmnist_flax.runtime import workdir as workdir_lib

    mesh = parallel.make_mesh()
    versions = {name.capitalize(): v for name, v in workdir_lib.versions().items()}
    model = MLP(rngs=nnx.Rngs(0))
    metrics = {"loss": 0.5216, "accuracy": 0.8185, "examples": 10_000}
    built = [
        tables.setup_table(versions, parallel.layout(mesh, 512, "replicated"), "bfloat16"),
        tables.splits_table(real_dataset),
        tables.params_table(model),
        tables.arrays_table("Data arrays on the device", {"train_labels": jax.numpy.zeros(3)}),
        tables.evaluation_table(
            {
                "train, steps 26-50": {**metrics, "grad_norm": 1.133, "examples": 12_800},
                "test, codelab (whole batches only)": {**metrics, "examples": 9_728},
                "test, full (last batch padded, masked)": metrics,
            }
        ),
    ]
    monkeypatch.delenv("COLUMNS", raising=False)
    for columns in (None, 80):  # no terminal (pytest captures stdout), then an 80-column one
        if columns:
            monkeypatch.setenv("COLUMNS", str(columns))
        assert tables.text_width() == 80
        for table in built:
            lines = table.format().splitlines()
            assert max(map(len, lines)) <= 80, table.format()
            assert words_whole(table, lines) == [], table.format()
    computes = [row for row in built[0].rows if row[0] == "Compute dtype"]
    assert computes == [("Compute dtype", "bfloat16 (parameters and optimizer state float32)")]
    monkeypatch.setenv("COLUMNS", "200")  # a wide terminal: tables as wide as MAX_WIDTH
    assert tables.text_width() == tables.MAX_WIDTH


def test_a_table_wider_than_100_columns_wraps_its_widest_text_column():
    """The set-up table's layout cell (129 columns) made the terminal wrap every line; now
    the long cell wraps onto lines of its own under its column, numbers untouched."""
    from fmnist_flax.runtime.tables import Table

    long = "mesh {'data': 1} over 1 cpu device(s); batch 512 split 512 per device; " * 2
    text = Table.of("A title " * 20, ("Item", "Value", "Count"), [("Layout", long, "512")])
    lines = text.format(width=100).splitlines()  # a terminal of 100 columns or more
    assert max(map(len, lines)) <= 100
    assert " ".join(" ".join(lines).split()).count("512 per device") == 2  # nothing lost
    assert lines[-1].startswith(" " * len("Layout"))  # a continuation, under its column


def test_a_table_of_more_numeric_columns_than_fit_goes_on_in_blocks_led_by_its_first():
    """A training table with a test accuracy per class was 304 columns wide: numbers never
    wrap, so its columns now go on in blocks below, each led by the step, none wider than
    100 and every cell kept."""
    from fmnist_flax.runtime.tables import Table

    headers = ["Step", "Loss", *(f"Test class accuracy {k}" for k in range(10))]
    rows = [[str(step), "0.4933", *(f"{k}{step}.5%" for k in range(10))] for step in (25, 50)]
    lines = Table.of("Training", headers, rows).format().splitlines()
    assert max(map(len, lines)) <= 100
    led = [line for line in lines if line.startswith("Step")]
    assert len(led) > 1 and all(line.split()[0] == "Step" for line in led)
    text = " ".join(lines)
    assert all(h in text for h in headers) and all(c in text for row in rows for c in row)
    assert sum(line.lstrip().startswith("25 ") for line in lines) == len(led)
