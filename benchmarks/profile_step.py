"""Where an optimizer step spends its GPU time: torch.profiler over a few eager steps of one
`dion3 bench` variant, kernels grouped by name. Usage (CUDA):

    PYTHONPATH=src python3 benchmarks/profile_step.py --preset llama-8b --optimizer dion3-1/4
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from dion3.tools.bench.presets import PRESETS
from dion3.tools.bench.step_time import make_optimizer, make_parameters, parse_variant


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-8b", choices=sorted(PRESETS))
    parser.add_argument("--optimizer", default="dion3-1/4")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rows", type=int, default=25, help="kernels to list")
    args = parser.parse_args()
    device = torch.device("cuda")
    matrices, scalars = make_parameters(PRESETS[args.preset], device, False)
    optimizer = make_optimizer(parse_variant(args.optimizer), matrices, scalars, device, graph=False)
    for _ in range(3):  # compile kernels, fill caches
        optimizer.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            optimizer.step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in events) / args.steps / 1e3
    print(f"{args.optimizer} on {args.preset}: {total:.1f} ms of kernel time per step")
    print(f"{'ms/step':>8}  {'share':>6}  {'calls':>6}  kernel")
    for e in sorted(events, key=lambda e: -e.device_time_total)[: args.rows]:
        ms = e.device_time_total / args.steps / 1e3
        print(f"{ms:8.2f}  {ms / total:6.1%}  {e.count // args.steps:6d}  {e.key[:110]}")


if __name__ == "__main__":
    main()
