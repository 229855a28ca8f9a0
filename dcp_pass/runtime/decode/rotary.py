"""The complex product of a rotary embedding, on real views (what rewritten graphs call).

`rewrites/complex_product.py` puts this where a graph had
`view_as_real(view_as_complex(x) * f)`: inductor fuses these pointwise ops, where each
complex op would be a fallback call of its own.
"""

from __future__ import annotations

import torch


def complex_mul_real(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """`view_as_real(view_as_complex(x) * view_as_complex(f))` for real x, f of shape [..., 2]
    (broadcasting over the leading dims), computed as (xr fr - xi fi, xr fi + xi fr)."""
    xr, xi = x[..., 0], x[..., 1]
    fr, fi = f[..., 0], f[..., 1]
    return torch.stack((xr * fr - xi * fi, xr * fi + xi * fr), dim=-1)
