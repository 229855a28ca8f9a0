"""Moved to `dcp_pass.models.deepseek_mla`; this old import path stays for one release.

The module object is the new one (`sys.modules` entry replaced), so every name, private
ones included, imports from here as before.
"""
import sys
import warnings

from dcp_pass.models import deepseek_mla as _moved

warnings.warn("examples.deepseek_mla moved to dcp_pass.models.deepseek_mla; import it from there",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
