"""torch.optim front-ends."""
from .base import OrthogonalOptimizer
from .cost_fractions import describe_fractions
from .fraction_schedule import FractionScheduler, FractionWarmup
from .optimizers import Dion3, Muon, NorMuon

__all__ = ["Dion3", "FractionScheduler", "FractionWarmup", "Muon", "NorMuon", "OrthogonalOptimizer", "describe_fractions"]
