"""Parameter shapes for the step-time benchmark and `dion3 plan`, read from the registry of model
names (dion3.tools.models, where each name's architecture and the commands that take it are).

PRESETS: the shapes `dion3 bench` allocates on one device, for every name it takes (llama-70b: 8
of its 80 layers). MODELS: every name's whole model (its slice for llama-70b-slice), which `dion3
plan` and `dion3 fractions` read on meta tensors, never allocated. config_matrices: a Hugging Face
config's matrices as the bench allocates them; check_fits: whether they fit the device.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Optional

import torch

from ...ortho.cost import MatrixShape  # noqa: F401 (the presets' matrices; re-exported)
from ..hf_config import ConfigModel, config_model
from ..models import REGISTRY, Preset, ScalarShape, llama, lookup, parse_shapes, refusal  # noqa: F401 (re-exported)

PRESETS = {name: model.bench_preset() for name, model in REGISTRY.items() if "bench" in model.commands}
MODELS = {name: model.preset() for name, model in REGISTRY.items()}


def named_model(preset: Optional[str], shapes: Optional[str], hf_config: Optional[str], command: str) -> ConfigModel:
    """The whole model a command's --preset, --shapes or --hf-config names (one of them; llama-8b
    where none is), with the parameters a token multiplies by: its matrices and LM head."""
    given = [flag for flag, value in (("--preset", preset), ("--shapes", shapes), ("--hf-config", hf_config)) if value]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)} each name the model: give one")
    if hf_config:
        return config_model(hf_config)
    if shapes:
        model = parse_shapes(shapes)
    elif (preset or "llama-8b") in MODELS:
        model = MODELS[preset or "llama-8b"]
    else:
        raise ValueError(f"--preset: {refusal(preset, command)}")
    return ConfigModel(model, None, model.matrix_numel + head_numel(model))


def head_numel(preset) -> int:
    """The LM head's parameters (the embedding when tied): a matrix the forward multiplies by."""
    heads = [s for s in preset.scalars if "lm_head" in s.name or s.name == "embedding"]
    return heads[0].numel // heads[0].count if heads else 0


def get_preset(name: str, layers: Optional[int] = None) -> Preset:
    """The shapes `dion3 bench --preset NAME` times; a name it does not take is refused naming the
    commands that do. layers: that many of the model's layers instead (a slice that fits a smaller
    GPU: the same shapes, so the same fractions by cost and time per layer), named NAME-<layers>l
    so that its times are not read as the whole model's."""
    try:
        model = lookup(name, "bench")
    except ValueError as error:
        raise ValueError(f"--preset: {error}") from None
    if layers is None:
        return model.bench_preset()
    if not 1 <= layers <= model.n_layer:
        raise ValueError(f"--layers: {name} has {model.n_layer} layers, got {layers}")
    return dataclasses.replace(model.preset(layers), name=f"{name}-{layers}l")


def free_bytes(device: torch.device) -> Optional[int]:
    """Memory free on the device now (CPU: the kernel's MemAvailable), None where unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


MATRIX_BYTES = 12  # a matrix element's fp32 parameter, gradient and momentum


def check_fits(source: Preset, device: torch.device, scalars: bool) -> None:
    """Refuse a model whose fp32 matrices, gradients and momentum alone exceed the free memory
    (a run would fail every variant, or on a CPU swap the machine to a halt). For a stack of
    layers the refusal names the most layers whose matrices would fit (--layers)."""
    need = MATRIX_BYTES * source.matrix_numel + (16 * source.scalar_numel if scalars else 0)
    free = free_bytes(device)
    if free is None or need <= free:
        return
    fitting = int(free // (MATRIX_BYTES * source.matrix_numel / source.layers)) if source.layers else 0
    instead = (f"time {fitting} of its layers with --layers {fitting} (their matrices alone fill the free memory; "
               f"fewer leave room for the step's buffers)" if 0 < fitting < source.layers
               else "time a slice of its matrices with --shapes")
    raise ValueError(f"{source.name}: its matrices need {need / 1e9:.1f} GB in fp32 with their gradients and "
                     f"momentum, and {device} has {free / 1e9:.1f} GB free; {instead}, or price the whole model "
                     "with `dion3 plan`")


def config_matrices(path: str) -> Preset:
    """The matrices of a Hugging Face config's model as the bench allocates them: an expert
    stack [E, rows, cols] as E matrices of its shape (the same work on one device)."""
    described = config_model(path)
    if described.note:
        print(f"note: {described.note}", file=sys.stderr)
    experts = described.experts or {}
    matrices = tuple(dataclasses.replace(m, count=m.count * experts.get(m.name, 1)) for m in described.preset.matrices)
    return dataclasses.replace(described.preset, matrices=matrices)
