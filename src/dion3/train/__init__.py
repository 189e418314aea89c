"""Small-GPT training for `dion3 compare`: model, data, parameter groups and the training loop."""
from .groups import param_groups

__all__ = ["param_groups"]
