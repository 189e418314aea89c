"""Colours for the study's pictures: one per setting, all distinct however many settings the records
hold (a fixed ten-colour cycle would repeat, or run out, once the screened variants join)."""
from __future__ import annotations


def distinct_colours(count: int) -> list[tuple]:
    """`count` RGBA colours, no two alike: matplotlib's ten-colour cycle while it suffices (the
    pictures keep their familiar colours), its twenty-colour map up to twenty, else hues spread
    evenly around the wheel."""
    import matplotlib

    if count <= 10:
        return [matplotlib.colormaps["tab10"](i) for i in range(count)]
    if count <= 20:
        return [matplotlib.colormaps["tab20"](i) for i in range(count)]
    return [matplotlib.colormaps["hsv"](i / count) for i in range(count)]
