"""The decode path: striped layout and allocators, LSE merge, collectives, backend
tables, the shard-local attention op and its kernels. Imports nothing from ``compose``."""
