"""Property tests: whatever bytes or arrays arrive, the readers answer with data or a UserError.

Hypothesis draws random and mutated inputs; each test is kept to a few dozen examples so the
file runs in seconds in the fast tier.
"""

from __future__ import annotations

import io
import pathlib
import struct
import tempfile

import numpy as np
from conftest import idx_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from PIL import Image

from fmnist_flax import datasets
from fmnist_flax.runtime import inference
from fmnist_flax.runtime.errors import UserError
from fmnist_flax.runtime.inference import PIXEL_SCALE

FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def one_line(exc: UserError) -> str:
    message = str(exc)
    assert message and "\n" not in message
    return message


@st.composite
def mutated(draw, valid: bytes) -> bytes:
    """`valid` with a few bytes overwritten, then perhaps cut short or extended."""
    payload = bytearray(valid)
    for _ in range(draw(st.integers(0, 4))):
        if payload:
            payload[draw(st.integers(0, len(payload) - 1))] = draw(st.integers(0, 255))
    cut = draw(st.integers(0, len(payload)))
    return (
        bytes(payload[:cut])
        if draw(st.booleans())
        else bytes(payload) + draw(st.binary(max_size=8))
    )


@st.composite
def idx_payloads(draw) -> tuple[bytes, bool]:
    images = draw(st.booleans())
    n, h, w = draw(st.integers(0, 3)), draw(st.integers(0, 4)), draw(st.integers(0, 4))
    valid = idx_bytes(np.zeros((n, h, w) if images else (n,), np.uint8))
    return draw(st.one_of(st.binary(max_size=64), mutated(valid))), images


@FAST
@given(idx_payloads())
def test_parse_idx_returns_what_its_header_says_or_a_user_error(case):
    payload, images = case
    try:
        array = datasets.parse_idx(payload, "x.idx", images=images)
    except UserError as exc:
        assert one_line(exc).startswith("x.idx: ")
        return
    count, *dims = struct.unpack_from(">IIII" if images else ">II", payload)[1:]
    assert array.dtype == np.uint8 and array.shape == (count, *dims)


PIXEL_DTYPES = st.one_of(
    hnp.scalar_dtypes(),  # bool, ints, floats, complex, datetime64, timedelta64
    hnp.byte_string_dtypes(max_len=3),
    hnp.unicode_string_dtypes(max_len=3),
)


@st.composite
def pixel_arrays(draw) -> tuple[np.ndarray, tuple[int, int, int]]:
    h, w, c = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.sampled_from([1, 3]))
    n = draw(st.integers(0, 3))
    shape = draw(
        st.one_of(
            st.sampled_from([(h, w), (n, h, w), (h, w, c), (n, h, w, c), (n, h * w * c)]),
            hnp.array_shapes(min_dims=0, max_dims=5, min_side=0, max_side=4),
        )
    )
    return draw(hnp.arrays(draw(PIXEL_DTYPES), shape)), (h, w, c)


@FAST
@given(pixel_arrays())
def test_the_input_rule_gives_pixels_in_0_1_or_a_one_line_refusal(case):
    array, (h, w, c) = case
    try:
        x = inference.model_input(array, (h, w, c))
    except UserError as exc:
        assert one_line(exc).startswith("images: ")
        return
    assert x.dtype == np.float32 and x.ndim == 4 and len(x) >= 1 and x.shape[1:] == (h, w, c)
    assert (
        array.shape[-2:] == (h, w) or array.shape[-3:] == (h, w, c) or array.shape[-1] == x[0].size
    )
    assert np.isfinite(x).all() and x.min() >= 0 and x.max() <= 1
    if array.dtype.kind in "ui":
        expected = array.astype(np.float32) * PIXEL_SCALE
        np.testing.assert_array_equal(x, expected.reshape(x.shape))
    else:
        np.testing.assert_array_equal(x, array.astype(np.float32).reshape(x.shape))


def valid_file(suffix: str) -> bytes:
    buffer = io.BytesIO()
    if suffix == ".npy":
        np.save(buffer, np.arange(2 * 28 * 28, dtype=np.uint8).reshape(2, 28, 28))
    else:
        Image.fromarray(np.arange(30 * 20, dtype=np.uint16).reshape(20, 30)).save(buffer, "PNG")
    return buffer.getvalue()


@FAST
@given(st.sampled_from([".png", ".npy"]), st.data())
def test_read_images_on_random_or_mutated_bytes_reads_them_or_refuses_in_one_line(suffix, data):
    magic = b"\x89PNG\r\n\x1a\n" if suffix == ".png" else b"\x93NUMPY\x01\x00"
    payload = data.draw(
        st.one_of(
            st.binary(max_size=200),
            st.binary(max_size=200).map(lambda tail: magic + tail),
            mutated(valid_file(suffix)),
        )
    )
    with tempfile.TemporaryDirectory() as directory:
        path = pathlib.Path(directory) / f"x{suffix}"
        path.write_bytes(payload)
        try:
            named, notes = inference.read_images(path)
        except UserError as exc:
            assert one_line(exc).startswith(f"{path}: ")
            return
    assert named and all("\n" not in note for note in notes)
    for _, pixels in named:
        assert pixels.dtype == np.float32 and pixels.shape == (28, 28, 1)
        assert np.isfinite(pixels).all() and pixels.min() >= 0 and pixels.max() <= 1
