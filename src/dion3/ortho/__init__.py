"""Orthogonalization: coefficient schedules, Newton–Schulz, Gram Newton–Schulz, restarts, metrics."""
from .coefficients import JORDAN, POLAR_EXPRESS, POLAR_EXPRESS_3, POLAR_EXPRESS_4, SCHEDULES, YOU, Schedule, get_schedule
from .newton_schulz import InputScaling, choose_method, gram_newton_schulz, input_scaling, newton_schulz, orthogonalize
from .precision import cpu_compute_dtype, native_bf16_matmul, set_cpu_compute_dtype
from .restarts import autotune_restarts, default_restarts, worst_condition

__all__ = [
    "JORDAN", "POLAR_EXPRESS", "POLAR_EXPRESS_3", "POLAR_EXPRESS_4", "SCHEDULES", "YOU", "Schedule", "get_schedule",
    "InputScaling", "choose_method", "gram_newton_schulz", "input_scaling", "newton_schulz", "orthogonalize",
    "cpu_compute_dtype", "native_bf16_matmul", "set_cpu_compute_dtype",
    "autotune_restarts", "default_restarts", "worst_condition",
]
