"""The table of docs/distributed.md: `dion3 plan` for Llama-8B, 70B and 405B on 8 to 4096 GPUs,
FSDP2 and FSDP2 + TP 8, Muon (Gram + kernels) and Dion3 f=1/4, default H200 settings.

Usage: PYTHONPATH=src python benchmarks/plan_table.py DIR
Each configuration's `dion3 plan --json` goes to DIR (kept: a second run only fills the gaps),
then the markdown table is printed. The largest worlds take minutes each on a 2-core CPU.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from dion3.tools.plan import cli

PRESETS = ("llama-8b", "llama-70b", "llama-405b")
WORLDS = (8, 64, 512, 4096)


def layouts(world: int) -> list[str]:
    return [f"fsdp={world}", f"fsdp={world // 8},tp=8"]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    lines = ["| model | GPUs | layout | Muon step ms | Dion3 f=¼ step ms | Muon GB/rank | Dion3 GB/rank | "
             "owner imbalance Muon / Dion3 |", "|---|---|---|---|---|---|---|---|"]
    for preset in PRESETS:
        for world in WORLDS:
            for layout in layouts(world):
                path = out / f"{preset}-{layout}.json"
                if not path.exists():
                    cli.main(["--preset", preset, "--layout", layout, "--optimizers", "muon,dion3", "--ranks", "0",
                              "--json", str(path), "--quiet"])
                muon, dion3 = json.loads(path.read_text())["optimizers"]
                lines.append(f"| {preset} | {world} | {layout} | {muon['step_ms']:.1f} | {dion3['step_ms']:.1f} | "
                             f"{muon['memory_gb_max']:.1f} | {dion3['memory_gb_max']:.1f} | "
                             f"{muon['imbalance']:.2f} / {dion3['imbalance']:.2f} |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
