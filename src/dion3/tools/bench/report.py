"""`dion3 bench`'s output: the table of measured rows and the one-line progress on stderr."""
from __future__ import annotations

import sys

COLUMNS = (
    ("variant", "name", "{}"), ("mode", "mode", "{}"), ("device ms", "device_ms", "{:.2f}"),
    ("host ms", "host_ms", "{:.3f}"), ("launches", "launches", "{}"), ("first s", "first_step_s", "{:.2f}"),
    ("ready s", "ready_s", "{:.2f}"),
    ("TFLOP/s", "tflops", "{:.3g}"), ("GB/s", "gbps", "{:.3g}"), ("sent MB", "bytes_sent", "{:.1f}"),
    ("speedup", "speedup", "{:.2f}x"), ("peak GB", "peak_gb", "{:.1f}"), ("ms/layer", "layer_ms", "{:.2f}"),
)


def format_table(rows: list[dict]) -> str:
    def cell(row, key, fmt):
        value = row.get(key)
        if key == "bytes_sent" and value is not None:
            value /= 1e6
        return "-" if value is None else fmt.format(value)

    header = [title for title, _, _ in COLUMNS]
    measured = [[cell(row, key, fmt) for _, key, fmt in COLUMNS] for row in rows if "error" not in row]
    widths = [max(len(r[i]) for r in [header] + measured) for i in range(len(COLUMNS))]

    def line(cells):  # names left-aligned, numbers right-aligned
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    lines = [line(header)]
    for row in rows:
        if "error" in row:  # the message runs on past the columns
            lines.append(f"{row['name'].ljust(widths[0])}  {row['mode'].ljust(widths[1])}  error: {row['error'][:160]}")
        else:
            lines.append(line([cell(row, key, fmt) for _, key, fmt in COLUMNS]))
    return "\n".join(lines)


class Progress:
    """One status line on stderr: rewritten in place on a terminal, one line per run otherwise."""

    def __init__(self, total: int):
        self.total, self.index, self.label = total, 0, ""
        self.live = sys.stderr.isatty()

    def start(self, label: str) -> None:
        self.index += 1
        self.label = f"[{self.index}/{self.total}] {label}"
        self("first step (compiling)")

    def __call__(self, status: str) -> None:
        if self.live:
            sys.stderr.write(f"\r\033[K{self.label}: {status}")
            sys.stderr.flush()

    def finish(self, row: dict) -> None:
        outcome = f"error: {row['error']}" if "error" in row else f"{row['device_ms']:.2f} ms"
        sys.stderr.write(("\r\033[K" if self.live else "") + f"{self.label}: {outcome}\n")
        sys.stderr.flush()
