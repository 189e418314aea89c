"""dion3: Muon-quality orthogonalized updates at a fraction of Muon's cost."""
from .optim import (Dion3, FractionScheduler, FractionWarmup, Muon, NorMuon, PeriodicFull, convert_state_dict,
                    describe_fractions)
from .ortho import autotune_restarts, orthogonalize
from .optim.param_groups import param_groups

__version__ = "0.1.0"
__all__ = ["Dion3", "FractionScheduler", "FractionWarmup", "Muon", "NorMuon", "PeriodicFull", "param_groups",
           "convert_state_dict", "describe_fractions", "orthogonalize", "autotune_restarts", "__version__"]
