"""A/B helper: `dion3 bench` with every Hopper symmetric-kernel config capped at N registers per
thread (Triton's maxnreg), to measure a config change on whole optimizer steps before it goes
into kernels/configs.py. Usage (CUDA):

    PYTHONPATH=src python3 benchmarks/step_with_register_cap.py 128 --preset llama-8b --optimizers dion3-1/4
"""
import dataclasses
import sys

from dion3 import cli
from dion3.kernels import configs


def cap_hopper_configs(registers: int) -> None:
    capped = tuple((min_n, dataclasses.replace(cfg, max_registers=registers)) for min_n, cfg in configs.HOPPER)
    for major in (9, 10):
        configs.TABLES[major] = capped
    configs.HOPPER_LONG_REDUCTION = dataclasses.replace(configs.HOPPER_LONG_REDUCTION, max_registers=registers)


if __name__ == "__main__":
    cap_hopper_configs(int(sys.argv[1]))
    sys.exit(cli.main(["bench", *sys.argv[2:]]))
