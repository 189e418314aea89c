"""Parameter shapes for the step-time benchmark: Llama-shaped presets and custom shape lists.

A preset lists the weight matrices of every transformer layer (q, o, k, v, gate, up, down)
times the layer count (DESIGN §8), which is what the orthogonal optimizers work on. It also
lists the non-matrix parameters of the same model (token embedding, LM head, RMSNorm weights);
those belong in an AdamW group and are only benchmarked with `dion3 bench --scalars`, because
the reference figures of DESIGN §8 cover the matrix parameters alone.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from ...ortho.cost import MatrixShape  # noqa: F401 (the presets' matrices; re-exported)


@dataclass(frozen=True)
class ScalarShape:
    """`count` non-matrix parameters (AdamW group) of the given shape."""

    name: str
    shape: tuple[int, ...]
    count: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape) * self.count


@dataclass(frozen=True)
class Preset:
    name: str
    matrices: tuple[MatrixShape, ...]
    scalars: tuple[ScalarShape, ...] = field(default=())
    description: str = ""
    layers: int = 0  # transformer layers in `matrices` (0: not a layer stack); per-layer times use it

    @property
    def matrix_numel(self) -> int:
        return sum(m.numel for m in self.matrices)

    @property
    def scalar_numel(self) -> int:
        return sum(s.numel for s in self.scalars)


def llama(name: str, layers: int, dim: int, kv_dim: int, hidden: int, vocab: int, tied: bool,
          of_layers: int = 0) -> Preset:
    """Matrices of a Llama decoder (weights stored out_features × in_features, as nn.Linear).
    of_layers > layers: a slice of `layers` layers of an `of_layers`-layer model (one too large
    for one GPU's memory), timed as a whole and reported per layer."""
    matrices = (
        MatrixShape("q,o", dim, dim, 2 * layers),
        MatrixShape("k,v", kv_dim, dim, 2 * layers),
        MatrixShape("gate,up", hidden, dim, 2 * layers),
        MatrixShape("down", dim, hidden, layers),
    )
    scalars = (
        ScalarShape("embedding" if tied else "embedding,lm_head", (vocab, dim), 1 if tied else 2),
        ScalarShape("rmsnorm", (dim,), 2 * layers + 1),  # two per layer plus the final norm
    )
    count = f"{layers} of its {of_layers} layers" if of_layers > layers else f"{layers} layers"
    description = f"{count}, d={dim}, kv={kv_dim}, ffn={hidden}, vocab={vocab}" + (", tied embeddings" if tied else "")
    return Preset(name, matrices, scalars, description, layers)


PRESETS = {
    # Llama 3.2 1B: 16 layers, 0.97 B matrix parameters.
    "llama-1b": llama("llama-1b", layers=16, dim=2048, kv_dim=512, hidden=8192, vocab=128256, tied=True),
    # Llama 3.1 8B: 32 layers, 6.98 B matrix parameters.
    "llama-8b": llama("llama-8b", layers=32, dim=4096, kv_dim=1024, hidden=14336, vocab=128256, tied=False),
    # Llama 3.1 70B: 80 layers of 0.86 B matrix parameters each; 8 of them (6.85 B) fit one H200
    # with fp32 parameters, gradients, momentum and Muon's workspace.
    "llama-70b": llama("llama-70b", layers=8, dim=8192, kv_dim=1024, hidden=28672, vocab=128256, tied=False,
                       of_layers=80),
    # The quality study's models (dion3.tools.study.MODELS, byte vocabulary): small matrices whose
    # eager steps the host's launches set, so `dion3 bench` also reports launches per step.
    "llama-384": llama("llama-384", layers=12, dim=384, kv_dim=128, hidden=1024, vocab=256, tied=False),
    "llama-hf-110m": llama("llama-hf-110m", layers=16, dim=768, kv_dim=256, hidden=2304, vocab=256, tied=False),
    "llama-hf-350m": llama("llama-hf-350m", layers=24, dim=1024, kv_dim=512, hidden=3584, vocab=256, tied=False),
    # benchmarks/cpu_step.py's default shapes: the CPU step's target (4 layers of d = 256)
    "cpu-small": llama("cpu-small", layers=4, dim=256, kv_dim=64, hidden=1024, vocab=256, tied=False),
}

# Whole models for `dion3 plan` (planned on meta tensors, never allocated): every layer.
MODELS = {
    "llama-1b": PRESETS["llama-1b"],
    "llama-8b": PRESETS["llama-8b"],
    "llama-70b": llama("llama-70b", layers=80, dim=8192, kv_dim=1024, hidden=28672, vocab=128256, tied=False),
    # Llama 3.1 405B: 126 layers, d=16384, 128 heads / 8 kv heads (k, v 1024×16384), ffn 53248.
    "llama-405b": llama("llama-405b", layers=126, dim=16384, kv_dim=1024, hidden=53248, vocab=128256, tied=False),
    "llama-70b-slice": PRESETS["llama-70b"],  # the 8 layers of the one-GPU benchmark
    # The published anchors' model sizes, as common shapes of those sizes (an assumption: the
    # exact shapes are not published with the step times): Llama-2-7B (MHA, ffn 11008) and
    # Qwen2.5-14B (48 layers, d=5120, 8 kv heads of 128, ffn 13824).
    "7b": llama("7b", layers=32, dim=4096, kv_dim=4096, hidden=11008, vocab=32000, tied=False),
    "14b": llama("14b", layers=48, dim=5120, kv_dim=1024, hidden=13824, vocab=152064, tied=False),
}

_SHAPE = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*(?::\s*(\d+))?\s*$")


def parse_shapes(text: str) -> Preset:
    """Custom shapes such as "4096x4096:32,1024x4096:64" (ROWSxCOLS[:COUNT], count 1 if omitted)."""
    matrices = []
    for item in text.split(","):
        match = _SHAPE.match(item)
        if not match:
            raise ValueError(f"--shapes: cannot parse {item.strip()!r}; expected ROWSxCOLS[:COUNT], e.g. 4096x4096:32")
        rows, cols, count = int(match[1]), int(match[2]), int(match[3] or 1)
        if min(rows, cols, count) < 1:
            raise ValueError(f"--shapes: {item.strip()!r} needs rows, cols and count ≥ 1")
        matrices.append(MatrixShape(f"{rows}x{cols}", rows, cols, count))
    return Preset("custom", tuple(matrices), (), f"custom shapes {text}")


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"--preset: unknown preset {name!r}; expected one of {sorted(PRESETS)}") from None
