"""The algorithm names a parameter group may take, and which parts of the update rule each
uses: read by the optimizer front-ends (optim/) and the distributed step (distributed/) alike."""

MATRIX_ALGORITHMS = ("dion3", "dion2", "muon", "normuon")
SELECTING_ALGORITHMS = ("dion3", "dion2")  # row selection with error feedback
NORMALIZING_ALGORITHMS = ("dion3", "normuon")  # NorMuon's per-row normalization (a variance state)
SCALAR_ALGORITHMS = ("adamw", "lion")
ALIASES = {"nordion2": "dion3"}
