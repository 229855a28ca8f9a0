"""Moved to `dcp_pass.models.generate`; this old import path stays for one release.

The module object is the new one (`sys.modules` entry replaced), so every name, private
ones included, imports from here as before.
"""
import sys
import warnings

from dcp_pass.models import generate as _moved

warnings.warn("examples.generate moved to dcp_pass.models.generate; import it from there",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
