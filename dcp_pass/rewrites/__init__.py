"""FX code of the pass: finding attention and cache patterns in a Dynamo graph and rewriting them.

Importing the package installs the cache kinds' table (rewrites/cache_kinds/) in the tracer that
dispatches over it (cache_reads), whatever submodule is imported first.
"""

from dcp_pass.rewrites import cache_kinds  # noqa: F401
