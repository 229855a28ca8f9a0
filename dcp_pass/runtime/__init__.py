"""Runtime pieces of DCP, in two halves.

``decode/``: the decode path the rewritten graph calls (layout math and allocators, merge,
collectives, the backend tables, the attention operands, op and kernels).
``compose/``: compositions built on the striped cache (KV transfer, host tier, extend,
speculative verification); they import the decode half, never the other way round.

Nothing in here knows about FX graphs: the rewrites emit calls into these modules.
"""
