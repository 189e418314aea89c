"""Adapters for training frameworks. Each lives in its own module and imports its framework
only when that module is imported (`import dion3` never does): `dion3.integrations.torchtitan`
needs the optional extra `dion3[torchtitan]`."""
