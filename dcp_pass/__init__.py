"""dcp_pass: decode context parallelism for MLA attention as a torch.compile backend.

model = torch.compile(model, backend="dcp", options={"dcp_size": 2})
"""

from dcp_pass.options import DcpOptionError, DcpOptions
from dcp_pass.topology import DcpTopology, DcpTopologyError, plan_topology

__all__ = [
    "DcpOptions",
    "DcpOptionError",
    "DcpTopology",
    "DcpTopologyError",
    "plan_topology",
    "DcpBackend",
    "last_report",
    "deferred_caches",
    "materialize",
    "DcpCacheError",
    "refresh_weights",
    "DcpWeightsError",
]


def __getattr__(name):
    # The backend pulls in torch's compiler stack; import it only when asked for.
    if name in ("DcpBackend", "last_report", "dcp_backend"):
        from dcp_pass import backend

        return getattr(backend, name)
    if name in ("deferred_caches", "materialize"):  # construction without full-size KV caches
        from dcp_pass import deferred

        return getattr(deferred, name)
    if name == "DcpCacheError":
        from dcp_pass.state.store import DcpCacheError

        return DcpCacheError
    if name in ("refresh_weights", "DcpWeightsError"):  # weights updated after compile
        from dcp_pass.state import weights

        return getattr(weights, name)
    raise AttributeError(name)
