"""`dion3 plan`: the distributed step at any scale, planned on a CPU by the real planner and
priced by a cost model (pricing.py) of compute, memory passes, collectives and memory per rank."""
