"""colours/{train,test}.npz and classes.txt: 32x32 RGB noise with a red, green or blue
square; and a colour and a grey picture to predict."""

import pathlib

import numpy as np
from PIL import Image

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220)}


def images(n, rng):
    labels = np.arange(n) % len(COLOURS)
    x = rng.integers(0, 90, (n, 32, 32, 3), dtype=np.uint8)
    for image, label in zip(x, labels, strict=True):
        top, left = rng.integers(2, 18, 2)
        image[top : top + 12, left : left + 12] = list(COLOURS.values())[label]
    return x, labels


rng, out = np.random.default_rng(0), pathlib.Path("colours")
out.mkdir(exist_ok=True)
for split, n in (("train", 1536), ("test", 300)):
    x, y = images(n, rng)
    np.savez(out / f"{split}.npz", images=x, labels=y)
(out / "classes.txt").write_text("\n".join(COLOURS) + "\n")
x, _ = images(3, rng)
Image.fromarray(x[2]).save("blue.png")  # label 2: blue
Image.fromarray(x[0]).convert("L").save("grey.png")
