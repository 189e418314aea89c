"""The `dion3` command: `dion3 compare` (training comparison), `dion3 bench` (optimizer step
time), `dion3 bench kernels` (kernel micro-benchmarks), `dion3 plan` (the distributed step at W GPUs, planned
on this CPU), `dion3 fractions` (Dion3's fractions by cost per matrix shape)."""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "compare": ("dion3.tools.train.compare", "train the same model with AdamW, Muon, NorMuon and Dion3; compare"),
    "bench": ("dion3.tools.bench.step_time", "time optimizer steps on model-shaped parameters"),
    "bench kernels": ("dion3.tools.bench.kernel_time", "time symmetric-matmul kernels and NS variants against cuBLAS"),
    "plan": ("dion3.tools.plan.cli", "predict step time, traffic and memory per rank on W GPUs (real planner, on CPU)"),
    "fractions": ("dion3.tools.plan.fractions", "Dion3's fractions by cost per matrix shape, with k and modeled H200 time"),
}


def _usage() -> str:
    lines = ["usage: dion3 COMMAND [options]   (dion3 COMMAND --help for its options; dion3 --version)", ""]
    lines += [f"  {name:<14} {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from .. import __version__
        import torch

        print(f"dion3 {__version__} (torch {torch.__version__})")
        return 0
    name = " ".join(argv[:2]) if " ".join(argv[:2]) in COMMANDS else argv[0]
    if name not in COMMANDS:
        print(f"dion3: unknown command {argv[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(argv[len(name.split()):]) or 0)


if __name__ == "__main__":
    sys.exit(main())
