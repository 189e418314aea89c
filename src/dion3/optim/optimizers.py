"""The public optimizers: thin constructors over OrthogonalOptimizer with their own defaults.

Every group may override any hyperparameter, including `algorithm`: one of "dion3" (alias
"nordion2"), "dion2" (Dion3 without the per-row normalization), "muon", "normuon" for
matrices, "adamw" or "lion" for everything else. `num_heads` / `split_sizes` orthogonalize
the row blocks of each matrix separately (dion3.blocks).

A 3-D parameter's shape does not say what it holds, so a matrix group must: `flatten=True` reads
every parameter as one [shape[0], -1] matrix (a convolution kernel (out, in, k) is one out × in·k
matrix), `stacked=True` reads a 3-D parameter as a stack [E, rows, cols] of E matrices, each
orthogonalized on its own (expert weights). With neither, a 3-D parameter is refused
(docs/training.md, "Convolutions and expert stacks").
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

from torch import Tensor

from .base import OrthogonalOptimizer

Coefficients = Union[str, Sequence[Sequence[float]]]


# Settings of other algorithms that Muon/NorMuon accept as defaults for groups that switch to them.
SHARED_KEYS = frozenset({"fraction", "muon_beta2", "selection_scope", "row_score", "unselected_decay"})


def _defaults(algorithm: str, **values) -> dict:
    # Keys every algorithm may read, so a group can switch algorithm and still find its settings.
    base = dict(fraction=0.25, muon_beta2=0.95, nesterov=False, selection_scope="local", row_score="l1",
                unselected_decay=1.0, num_heads=None, split_sizes=None, momentum_dtype=None)
    base.update(values)
    base["algorithm"] = algorithm
    return base


class Dion3(OrthogonalOptimizer):
    """Dion3: orthogonalize only the `fraction` of momentum rows with the largest L1 norm, with
    error feedback on the selected rows and NorMuon's per-row normalization (a group with
    algorithm="dion2" leaves that normalization out). row_score="l2" ranks the rows by their L2
    norm instead (an experiment of the frontier study; "l1" is the rule). unselected_decay=d < 1
    also decays the momentum rows a step does not select, M[~S] ← d·M[~S] (an experiment too;
    1, the rule, lets them accumulate)."""

    def __init__(
        self,
        params,
        distributed_mesh=None,
        lr: Union[float, Tensor] = 0.01,
        fraction: float = 0.25,
        mu: float = 0.95,
        muon_beta2: float = 0.95,
        betas: tuple[float, float] = (0.9, 0.95),
        weight_decay: float = 0.01,
        epsilon: float = 1e-8,
        adjust_lr: Optional[str] = "spectral_norm",
        flatten: bool = False,
        stacked: bool = False,
        orthogonalizer: str = "auto",
        ns_coefficients: Coefficients = "polar_express",
        selection_scope: str = "local",
        check_finite: bool = False,
        num_heads: Optional[int] = None,
        split_sizes: Optional[Sequence[int]] = None,
        momentum_dtype: Optional[str] = None,
        row_score: str = "l1",
        unselected_decay: float = 1.0,
    ):
        defaults = _defaults(
            "dion3", lr=lr, fraction=fraction, mu=mu, muon_beta2=muon_beta2, betas=betas,
            weight_decay=weight_decay, epsilon=epsilon, adjust_lr=adjust_lr, flatten=flatten, stacked=stacked,
            orthogonalizer=orthogonalizer, ns_coefficients=ns_coefficients, selection_scope=selection_scope,
            num_heads=num_heads, split_sizes=split_sizes, momentum_dtype=momentum_dtype, row_score=row_score,
            unselected_decay=unselected_decay,
        )
        super().__init__(params, defaults, distributed_mesh, check_finite)


class Muon(OrthogonalOptimizer):
    """Muon: orthogonalized momentum, M ← μM + G, X ← (1 − ηλ)X − η'·Orth(M)."""

    _algorithm = "muon"

    def __init__(
        self,
        params,
        distributed_mesh=None,
        lr: Union[float, Tensor] = 0.01,
        mu: float = 0.95,
        betas: tuple[float, float] = (0.9, 0.95),
        weight_decay: float = 0.01,
        epsilon: float = 1e-8,
        nesterov: bool = False,
        adjust_lr: Optional[str] = "spectral_norm",
        flatten: bool = False,
        stacked: bool = False,
        orthogonalizer: str = "auto",
        ns_coefficients: Coefficients = "polar_express",
        check_finite: bool = False,
        num_heads: Optional[int] = None,
        split_sizes: Optional[Sequence[int]] = None,
        momentum_dtype: Optional[str] = None,
        **extra,
    ):
        unknown = sorted(set(extra) - SHARED_KEYS)  # a misspelled setting must not be dropped silently
        if unknown:
            raise TypeError(f"{type(self).__name__}() got unexpected keyword arguments {unknown}")
        defaults = _defaults(
            self._algorithm, lr=lr, mu=mu, betas=betas, weight_decay=weight_decay, epsilon=epsilon,
            nesterov=nesterov, adjust_lr=adjust_lr, flatten=flatten, stacked=stacked, orthogonalizer=orthogonalizer,
            ns_coefficients=ns_coefficients, num_heads=num_heads, split_sizes=split_sizes,
            momentum_dtype=momentum_dtype, **extra,
        )
        super().__init__(params, defaults, distributed_mesh, check_finite)


class NorMuon(Muon):
    """NorMuon: Muon followed by per-row normalization with a second-moment estimate."""

    _algorithm = "normuon"

    def __init__(self, params, distributed_mesh=None, muon_beta2: float = 0.95, **kwargs):
        super().__init__(params, distributed_mesh, muon_beta2=muon_beta2, **kwargs)
