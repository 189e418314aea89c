"""Command-line benchmarks: optimizer step time (`dion3 bench`) and kernels (`dion3 bench kernels`)."""
