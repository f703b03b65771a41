"""Text lines drawn with a 5x7 bitmap font, as a text recognizer's inputs, without an imaging library.

Each glyph is 7 rows of 5 bits; a line is drawn black on white, scaled up by whole pixels to
the recognizer's height (48: PP-OCR), normalized as rapidocr feeds it (``(v / 255 - 0.5) / 0.5``)
and padded with 0 on the right to a fixed width.
"""

from __future__ import annotations

import random

import numpy as np

GLYPHS = {
    "A": "01110 10001 10001 11111 10001 10001 10001",
    "B": "11110 10001 10001 11110 10001 10001 11110",
    "C": "01110 10001 10000 10000 10000 10001 01110",
    "D": "11110 10001 10001 10001 10001 10001 11110",
    "E": "11111 10000 10000 11110 10000 10000 11111",
    "F": "11111 10000 10000 11110 10000 10000 10000",
    "G": "01110 10001 10000 10111 10001 10001 01111",
    "H": "10001 10001 10001 11111 10001 10001 10001",
    "I": "01110 00100 00100 00100 00100 00100 01110",
    "K": "10001 10010 10100 11000 10100 10010 10001",
    "L": "10000 10000 10000 10000 10000 10000 11111",
    "M": "10001 11011 10101 10101 10001 10001 10001",
    "N": "10001 11001 10101 10011 10001 10001 10001",
    "O": "01110 10001 10001 10001 10001 10001 01110",
    "P": "11110 10001 10001 11110 10000 10000 10000",
    "R": "11110 10001 10001 11110 10100 10010 10001",
    "S": "01111 10000 10000 01110 00001 00001 11110",
    "T": "11111 00100 00100 00100 00100 00100 00100",
    "U": "10001 10001 10001 10001 10001 10001 01110",
    "V": "10001 10001 10001 10001 10001 01010 00100",
    "W": "10001 10001 10001 10101 10101 10101 01010",
    "Y": "10001 10001 01010 00100 00100 00100 00100",
    "0": "01110 10001 10011 10101 11001 10001 01110",
    "1": "00100 01100 00100 00100 00100 00100 01110",
    "2": "01110 10001 00001 00010 00100 01000 11111",
    "3": "11110 00001 00001 01110 00001 00001 11110",
    "4": "00010 00110 01010 10010 11111 00010 00010",
    "5": "11111 10000 11110 00001 00001 10001 01110",
    "6": "00110 01000 10000 11110 10001 10001 01110",
    "7": "11111 00001 00010 00100 01000 01000 01000",
    "8": "01110 10001 10001 01110 10001 10001 01110",
    "9": "01110 10001 10001 01111 00001 00010 01100",
    " ": "00000 00000 00000 00000 00000 00000 00000",
}
WORDS = ["TOTAL", "INVOICE", "DATE", "ORDER", "NUMBER", "PRICE", "ITEM", "PAGE", "STATUS", "MODEL"]


def draw(text: str, height: int = 48, width: int = 320) -> np.ndarray:
    """``x [3, height, width]``: ``text`` in the bitmap font, 1 pixel apart, 2 rows of margin."""
    columns = []
    for char in text:
        rows = GLYPHS[char].split()
        glyph = np.array([[bit == "1" for bit in row] for row in rows], np.float32)
        columns.extend([glyph, np.zeros((7, 1), np.float32)])
    ink = np.concatenate(columns, axis=1)
    ink = np.pad(ink, ((2, 2), (2, 2)))  # 11 rows
    scale = height // ink.shape[0]
    image = np.kron(ink, np.ones((scale, scale), np.float32))
    image = np.pad(image, ((0, height - image.shape[0]), (0, 0)))
    gray = 255.0 * (1.0 - image)  # black text on white
    line = np.zeros((3, height, width), np.float32)
    used = min(width, gray.shape[1])
    line[:, :, :used] = (gray[:, :used] / 255.0 - 0.5) / 0.5
    return line


def lines(count: int, seed: int, height: int = 48, width: int = 320) -> tuple[np.ndarray, list[str]]:
    """``x [count, 3, height, width]`` of short lines of words and numbers drawn in a fixed
    order, and their texts."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        parts = [rng.choice(WORDS) if rng.random() < 0.6 else str(rng.randint(0, 9999)) for _ in range(2)]
        texts.append(" ".join(parts))
    return np.stack([draw(text, height, width) for text in texts]), texts
