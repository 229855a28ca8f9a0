"""Run-time state: what the rewritten graphs read at call time, kept per model and freed with it.

`store` (which cache tensors are striped or deferred, and their shards), `memory` (tensors
without memory behind them), `guards` (the class a striped cache tensor takes, and the
guards that refuse eager use of a tensor without full-size data), `shards` (making and
installing shards), `weights` (the other ranks' gathered weight shards, `refresh_weights`)
and `feeder` (the per-call feeder of a rewritten graph's added inputs). The rewrites
(compile time) hand their results here; nothing here imports the rewrites or the backend.
"""
