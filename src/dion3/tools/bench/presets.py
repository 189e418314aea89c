"""Parameter shapes for the step-time benchmark and `dion3 plan`, read from the registry of model
names (dion3.tools.models, where each name's architecture and the commands that take it are).

PRESETS: the shapes `dion3 bench` allocates on one device, for every name it takes (llama-70b: 8
of its 80 layers). MODELS: every name's whole model (its slice for llama-70b-slice), which `dion3
plan` and `dion3 fractions` read on meta tensors, never allocated.
"""
from __future__ import annotations

from ...ortho.cost import MatrixShape  # noqa: F401 (the presets' matrices; re-exported)
from ..models import REGISTRY, Preset, ScalarShape, llama, lookup, parse_shapes  # noqa: F401 (re-exported)

PRESETS = {name: model.bench_preset() for name, model in REGISTRY.items() if "bench" in model.commands}
MODELS = {name: model.preset() for name, model in REGISTRY.items()}


def get_preset(name: str) -> Preset:
    """The shapes `dion3 bench --preset NAME` times; a name it does not take is refused naming the
    commands that do."""
    try:
        return lookup(name, "bench").bench_preset()
    except ValueError as error:
        raise ValueError(f"--preset: {error}") from None
