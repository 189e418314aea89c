"""torch.optim front-ends."""
from .base import OrthogonalOptimizer
from .optimizers import Dion3, Muon, NorMuon

__all__ = ["Dion3", "Muon", "NorMuon", "OrthogonalOptimizer"]
