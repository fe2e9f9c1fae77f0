"""Checks of the files a report writes: PNG figures and well-formed Markdown."""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib.image
import numpy as np

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> np.ndarray:
    """A PNG file of a drawn figure (not a blank canvas), larger than 50x50 pixels; its pixels."""
    assert path.is_file(), path
    assert path.read_bytes()[:8] == PNG_MAGIC, path
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 50 and image.shape[1] > 50, image.shape
    assert image[..., :3].std() > 0.01  # not a blank canvas
    return image


def cells(line: str) -> list[str]:
    """The cells of one row of a Markdown table."""
    return re.split(r"(?<!\\)\|", line.strip())[1:-1]  # split on unescaped pipes


def assert_valid_markdown(path: Path) -> str:
    """Headings, well-formed tables (same cell count in every row, separator second) and image links
    that point at PNG files next to the report."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert lines[0].startswith("# "), lines[0]
    in_code = False
    table: list[str] = []
    for line in [*lines, ""]:
        if line.startswith("```"):
            in_code = not in_code
        if not in_code and line.startswith("|"):
            table.append(line)
            continue
        if table:
            widths = {len(cells(row)) for row in table}
            assert len(widths) == 1, table
            assert re.fullmatch(r"\|(---\|)+", table[1]), table[1]
            table = []
    assert not in_code, "unclosed code fence"
    for target in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):
        assert_png(path.parent / target)
    return text
