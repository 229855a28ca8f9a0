"""The compile-time side of caches stored as packed fp8 rows (option kv_cache_dtype): which
layout a layer's cache takes, and its writes as the packed bytes the striped write stores.
The row format itself is runtime/decode/kv_format.py; the shards, state/shards.py.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from dcp_pass.rewrites import fx_util
from dcp_pass.rewrites.cache_reads import CacheAccess
from dcp_pass.runtime.decode import kv_format as fp8


def fp8_layout_of(match, values: dict) -> "fp8.Fp8Layout":
    """The packed fp8 layout of the cache buffer holding `match`'s values (latent), or
    :class:`Fp8Refused` saying why its cache cannot be stored as fp8.

    The latent is the value columns [0, L); rotary columns are packed into the row when
    the rotary keys are read from the same buffer at [L, width) (a fused cache), and the
    buffer must hold nothing else.
    """
    from dcp_pass.rewrites.attention import ordered_terms

    read = match.value_cache
    kind = read.kind
    if not kind.shards.takes_fp8_rows:
        raise Fp8Refused(f"its cache is {kind.words}; kv_cache_dtype fp8 takes caches with rows by position")
    buffer = values[read.buffer.name]
    width = buffer.shape[-1]
    if (read.feat or (0,))[0] != 0:
        raise Fp8Refused(f"its values start at column {read.feat[0]} of the cache, not 0")
    latent, rope = ordered_terms(match)
    if latent.cache.buffer is not read.buffer:
        raise Fp8Refused("its latent keys and values come from different caches")
    fused_term = rope is None and latent.cache.width == width and match.v_dim < width
    L = match.v_dim if fused_term else latent.cache.width
    if rope is not None and rope.cache.buffer is read.buffer:
        if (rope.cache.feat or (0, width)) != (L, width):
            raise Fp8Refused(f"its rotary keys are columns {rope.cache.feat} of the latent cache, not [{L}, {width})")
    elif not fused_term and L != width:
        raise Fp8Refused(f"its latent cache has {width} columns and the attention reads {L} of them")
    if match.v_dim > L or L % 4:
        raise Fp8Refused(
            f"{L} latent columns ({match.v_dim} values): fp8 needs values within the latent and a "
            f"multiple of 4 latent columns"
        )
    return fp8.Fp8Layout(L, width - L, buffer.dtype)


class Fp8Refused(Exception):
    """Why a layer's cache cannot be stored as fp8 (the message says so)."""


def fp8_packed_write(graph: fx.Graph, write: CacheAccess, kv_format: str, name: str) -> CacheAccess:
    """`write` as the striped write of an fp8 shard takes it: its value packed in the graph
    (kv_format.pack_columns, or the rotary columns' bytes), its columns the bytes of the row
    they fill. Fp8Refused for columns that are not the whole latent (a quantisation block
    needs every column of a row), the rotary columns, or both."""
    spec = fp8.Fp8Layout.parse(kv_format)
    width = fx_util.node_value(write.value).shape[-1]
    feat_start = write.feat[0] if write.feat else 0
    cols = (feat_start, feat_start + width)
    with graph.inserting_before(write.node):
        if cols in ((0, spec.latent), (0, spec.columns)):
            packed = fx_util.call(
                graph, fp8.pack_columns, write.value, spec.latent, spec.rope, spec.rope_dtype, name="fp8_rows"
            )
            offset = 0
        elif spec.rope and cols == (spec.latent, spec.columns):
            packed = fx_util.call(graph, fp8.rope_bytes_of, write.value, spec.rope_dtype, name="rope_bytes")
            offset = spec.rope_offset
        else:
            raise Fp8Refused(
                f"a write of columns [{cols[0]}, {cols[1]}) of {name}: an fp8 cache is written "
                f"whole latent rows (columns [0, {spec.latent})) or its rotary columns"
            )
    fx_util.set_example_value(packed)
    nbytes = fx_util.node_value(packed).shape[-1]
    return dataclasses.replace(write, value=packed, feat=(offset, offset + nbytes))
