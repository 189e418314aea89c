"""The model names of the commands, one registry: each name's architecture, the shapes of its
parameters that follow from it, and which commands take the name.

    dion3 plan --preset, dion3 fractions --preset   every name (shapes only, on meta tensors)
    dion3 bench --preset                             every name whose matrices fit one GPU with their
                                                     gradients and optimizer state (llama-70b: 8 of
                                                     its 80 layers); not llama-405b or 14b
    dion3 compare --preset                           its demo presets cpu-tiny and gpu-small, which
                                                     carry a schedule and learning rates (train/compare.py)
    python -m dion3.tools.study --model              the models the study trains, each with its
                                                     context and batch (study/runs.py)

A command that does not take a name says which commands do (`refusal`). An architecture is a
Llama decoder as Hugging Face's LlamaForCausalLM lays it out (q, k, v, o; gate, up, down; GQA) or
dion3.tools.train.model.GPT (q, k, v, proj; fc, proj; QK-norm; no GQA, MLP 4 × d). A preset
lists the weight matrices of every layer times the layer count (DESIGN §8), which is what the
orthogonal optimizers work on, and the other parameters of the same model (token embedding, LM
head, RMSNorm weights), which belong in an AdamW group (`dion3 bench --scalars`).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from ..ortho.cost import MatrixShape


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


def decoder_scalars(layers: int, dim: int, vocab: int, tied: bool) -> tuple[ScalarShape, ...]:
    """A Llama-family decoder's parameters that go to AdamW: the token embedding (and the LM head
    unless tied) and the RMSNorm gains, two per layer plus the final norm."""
    return (ScalarShape("embedding" if tied else "embedding,lm_head", (vocab, dim), 1 if tied else 2),
            ScalarShape("rmsnorm", (dim,), 2 * layers + 1))


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
    scalars = decoder_scalars(layers, dim, vocab, tied)
    count = f"{layers} of its {of_layers} layers" if of_layers > layers else f"{layers} layers"
    description = f"{count}, d={dim}, kv={kv_dim}, ffn={hidden}, vocab={vocab}" + (", tied embeddings" if tied else "")
    return Preset(name, matrices, scalars, description, layers)


def gpt(name: str, layers: int, dim: int, heads: int, hidden: int, vocab: int) -> Preset:
    """Parameters of dion3.tools.train.model.GPT: per layer q, k, v and the attention's output
    projection (dim × dim), the MLP's fc (hidden × dim) and proj (dim × hidden); RMSNorm gains
    before attention and MLP, on q and k per head (QK-norm) and at the end; an untied LM head."""
    matrices = (
        MatrixShape("q,k,v,attn.proj", dim, dim, 4 * layers),
        MatrixShape("mlp.fc", hidden, dim, layers),
        MatrixShape("mlp.proj", dim, hidden, layers),
    )
    scalars = (
        ScalarShape("embedding,lm_head", (vocab, dim), 2),
        ScalarShape("rmsnorm", (dim,), 2 * layers + 1),
        ScalarShape("qk_norm", (dim // heads,), 2 * layers),
    )
    description = f"GPT, {layers} layers, d={dim}, {heads} heads, mlp={hidden}, vocab={vocab}"
    return Preset(name, matrices, scalars, description, layers)


# The commands that take model names, as a user types them.
COMMANDS = {
    "compare": "dion3 compare --preset",
    "bench": "dion3 bench --preset",
    "plan": "dion3 plan --preset",
    "fractions": "dion3 fractions --preset",
    "study": "python -m dion3.tools.study --model",
}


@dataclass(frozen=True)
class Model:
    """One model name: its architecture and the commands that take it (plan and fractions take
    every name)."""

    name: str
    family: str  # "llama" or "gpt"
    n_layer: int
    d_model: int
    n_head: int
    kv_heads: int  # key/value heads (GQA); a GPT's are its n_head
    mlp_width: int  # the MLP's hidden width (Llama: gate/up rows; GPT: 4 × d_model)
    vocab: int
    tied: bool = False  # the LM head is the embedding
    slice_layers: int = 0  # > 0: the name stands for this many of the n_layer layers
    bench_layers: int = 0  # > 0: `dion3 bench` times this many layers (all of them do not fit one GPU)
    bench: bool = True  # False: not even a slice is benchmarked on one GPU
    compare: bool = False  # a demo preset of `dion3 compare` (train/compare.py: schedule, learning rates)
    study: bool = False  # a model the study trains (study/runs.py: context and batch)

    @property
    def commands(self) -> tuple[str, ...]:
        """The keys of COMMANDS that take the name, in COMMANDS' order."""
        takes = dict(compare=self.compare, bench=self.bench, plan=True, fractions=True, study=self.study)
        return tuple(command for command in COMMANDS if takes[command])

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def preset(self, layers: int = 0) -> Preset:
        """The shapes of `layers` layers (default: the name's: every layer, or its slice)."""
        layers = layers or self.slice_layers or self.n_layer
        if self.family == "gpt":
            return gpt(self.name, layers, self.d_model, self.n_head, self.mlp_width, self.vocab)
        return llama(self.name, layers, self.d_model, self.kv_heads * self.head_dim, self.mlp_width, self.vocab,
                     self.tied, of_layers=self.n_layer)

    def bench_preset(self) -> Preset:
        """The shapes `dion3 bench` allocates and times on one device."""
        return self.preset(self.bench_layers)


def _llama(name: str, layers: int, dim: int, heads: int, kv_heads: int, hidden: int, vocab: int = 256,
           **rest) -> Model:
    return Model(name, "llama", layers, dim, heads, kv_heads, hidden, vocab, **rest)


def _gpt(name: str, layers: int, dim: int, heads: int, vocab: int = 256, **rest) -> Model:
    return Model(name, "gpt", layers, dim, heads, heads, 4 * dim, vocab, **rest)


REGISTRY: dict[str, Model] = {model.name: model for model in (
    # Llama 3.2 1B: 16 layers, 0.97 B matrix parameters.
    _llama("llama-1b", 16, 2048, heads=32, kv_heads=8, hidden=8192, vocab=128256, tied=True),
    # Llama 3.1 8B: 32 layers, 6.98 B matrix parameters.
    _llama("llama-8b", 32, 4096, heads=32, kv_heads=8, hidden=14336, vocab=128256),
    # Llama 3.1 70B: 80 layers of 0.86 B matrix parameters each; `dion3 bench` times 8 of them
    # (6.85 B), which fit one H200 with fp32 parameters, gradients, momentum and Muon's workspace.
    _llama("llama-70b", 80, 8192, heads=64, kv_heads=8, hidden=28672, vocab=128256, bench_layers=8),
    # the 8 layers of the one-GPU benchmark, under a name of their own for `dion3 plan`
    _llama("llama-70b-slice", 80, 8192, heads=64, kv_heads=8, hidden=28672, vocab=128256, slice_layers=8),
    # Llama 3.1 405B: 126 layers, d=16384, 128 heads / 8 kv heads (k, v 1024×16384), ffn 53248.
    _llama("llama-405b", 126, 16384, heads=128, kv_heads=8, hidden=53248, vocab=128256, bench=False),
    # The published anchors' model sizes, as common shapes of those sizes (an assumption: the
    # exact shapes are not published with the step times): Llama-2-7B (MHA, ffn 11008) and
    # Qwen2.5-14B (48 layers, d=5120, 40 heads, 8 kv heads of 128, ffn 13824; 13 B matrix
    # parameters, too many for one GPU with their gradients and state).
    _llama("7b", 32, 4096, heads=32, kv_heads=32, hidden=11008, vocab=32000),
    _llama("14b", 48, 5120, heads=40, kv_heads=8, hidden=13824, vocab=152064, bench=False),
    # The quality study's models (byte vocabulary): Hugging Face LlamaForCausalLM (GQA, head width
    # 64, SwiGLU) at 25 M (llama-hf), about 110 M and 340 M matrix parameters in the blocks, and
    # llama-384; small matrices whose eager steps the host's launches set, so `dion3 bench` also
    # reports launches per step.
    _llama("llama-hf", 8, 512, heads=8, kv_heads=4, hidden=1536, study=True),
    _llama("llama-384", 12, 384, heads=6, kv_heads=2, hidden=1024, study=True),
    _llama("llama-hf-110m", 16, 768, heads=12, kv_heads=4, hidden=2304, study=True),
    _llama("llama-hf-350m", 24, 1024, heads=16, kv_heads=8, hidden=3584, study=True),
    # the held-out shape of the step-efficiency study: llama-384's size (18.1 M in the blocks) at
    # half the depth, 4/3 the width and a 3× MLP (llama-384: 2.67×); no setting was tuned on it
    _llama("llama-512-6l", 6, 512, heads=8, kv_heads=2, hidden=1536, study=True),
    # ... and the study's GPTs (dion3.tools.train.model.GPT): gpt-tiny for --smoke, gpt-25m
    # (gpu-small's shapes) and gpt-120m (113 M parameters in the blocks).
    _gpt("gpt-tiny", 2, 64, heads=2, study=True),
    _gpt("gpt-25m", 8, 512, heads=8, study=True),
    _gpt("gpt-120m", 16, 768, heads=12, study=True),
    # `dion3 compare`'s demo presets (~1.7 M and ~25 M parameters). cpu-tiny's matrices are 256
    # wide: at 128 wide, f=¼ selects only 32 rows a step and Dion3 trailed NorMuon by 0.03
    # (benchmarks/results/compare-cpu-tiny-2026-12-04.md, "Earlier"); 2 layers keep its five runs
    # inside 10 minutes on 2 cores.
    _gpt("cpu-tiny", 2, 256, heads=4, compare=True),
    _gpt("gpu-small", 8, 512, heads=8, compare=True),
    # benchmarks/cpu_step.py's default shapes: the CPU step's target (4 layers of d = 256)
    _llama("cpu-small", 4, 256, heads=4, kv_heads=1, hidden=1024),
)}


def takes(command: str) -> list[str]:
    """The names `command` (a key of COMMANDS) takes, sorted."""
    return sorted(name for name, model in REGISTRY.items() if command in model.commands)


def _listing(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


# why a command does not take a name the registry knows
_WHY_NOT = {
    "compare": "is not one of dion3 compare's presets ({names}: each holds a training schedule and learning rates)",
    "bench": "does not fit one GPU, where dion3 bench allocates its matrices with their gradients and optimizer state",
    "study": "is not a model the study trains ({names}: each with its context and batch)",
}


def refusal(name: str, command: str) -> str:
    """Why `command` does not take `name`, and which commands do (or, for a name of no command,
    the names `command` takes)."""
    own = takes(command)
    model = REGISTRY.get(name)
    if model is None:
        return f"unknown model {name!r}; {COMMANDS[command]} takes {', '.join(own)}"
    why = _WHY_NOT[command].format(names=", ".join(own))
    return f"{name!r} {why}; {name!r} is taken by {_listing([COMMANDS[c] for c in model.commands])}"


def lookup(name: str, command: str) -> Model:
    """The model `command` runs as `name`; ValueError(refusal(...)) where it takes no such name."""
    model = REGISTRY.get(name)
    if model is None or command not in model.commands:
        raise ValueError(refusal(name, command))
    return model


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
