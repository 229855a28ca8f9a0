"""Runtime pieces of DCP: layout math, allocators, merge, collectives, kernels.

Nothing in here knows about FX graphs: the rewrites emit calls into these modules.
"""
