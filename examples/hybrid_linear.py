"""Moved to `dcp_pass.models.hybrid_linear`; this old import path stays for one release.

The module object is the new one (`sys.modules` entry replaced), so every name, private
ones included, imports from here as before.
"""
import sys
import warnings

from dcp_pass.models import hybrid_linear as _moved

warnings.warn("examples.hybrid_linear moved to dcp_pass.models.hybrid_linear; import it from there",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
