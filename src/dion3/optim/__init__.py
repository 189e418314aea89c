"""torch.optim front-ends."""
from .base import OrthogonalOptimizer
from .fraction_table import describe_fractions
from .fraction_schedule import FractionScheduler, FractionWarmup, PeriodicFull
from .optimizers import Dion3, Muon, NorMuon
from .state_dicts import convert_state_dict

__all__ = ["Dion3", "FractionScheduler", "FractionWarmup", "Muon", "NorMuon", "OrthogonalOptimizer", "PeriodicFull",
           "convert_state_dict", "describe_fractions"]
