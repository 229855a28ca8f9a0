"""Typed, validated options of the `dcp` torch.compile backend.

`torch.compile(model, backend="dcp", options={...})` hands the dict to
`DcpOptions.from_mapping`. Every mistake is reported with the key that caused it,
before anything is compiled: a typo must never silently fall back to a default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from dcp_pass.runtime.decode import backends as _backends

# the names of the backend tables (dcp_pass/runtime/decode/backends.py), which every chooser reads
COMM_BACKENDS = tuple(_backends.COMM_BACKENDS)
ATTN_BACKENDS = _backends.attention_backend_names()
INNER_COMPILERS = ("inductor", "aot_eager", "eager")
LSE_BASES = ("e", "2")
# what option 'kv_cache_dtype' takes besides None / "auto" (the model's cache dtype)
KV_CACHE_DTYPES = ("fp8_e4m3",)
AUTO = "auto"
# options whose default (None) is decided at compile time; "auto" is accepted for it
AUTOMATIC = (
    "comm_backend",
    "replicate_q_proj",
    "lse_base",
    "static_positions",
    "complex_as_real",
    "project_before_merge",
    "kv_cache_dtype",
    "absorb_kv_b_proj",
)


class DcpOptionError(ValueError):
    """An option of the dcp backend is unknown, of the wrong type, or out of range."""


@dataclass(frozen=True)
class DcpOptions:
    dcp_size: int = 1
    tp_size: Optional[int] = None  # None: the world size (every rank is one TP rank)
    attn_dp_size: int = 1
    # The automatic options below take "auto" or None (the default), which mean the same
    # and are stored as None.
    comm_backend: Optional[str] = None  # auto: resolved from the platform (runtime/decode/comm.py)
    replicate_q_proj: Optional[bool] = None  # auto: replicate where the layer allows it
    lse_base: Optional[str] = None  # auto: the base of the attention kernel in use
    attn_backend: str = "auto"
    inner: str = "inductor"
    group: Any = None  # an explicit DCP ProcessGroup; None: built from the topology
    strict: bool = False  # True: a near-miss MLA pattern is an error instead of a fallback
    # int step positions as device data in rewritten graphs (static shapes, replayable CUDA
    # graphs); auto: on for CUDA models, off on CPU
    static_positions: Optional[bool] = None
    inner_options: Mapping[str, Any] = field(default_factory=dict)
    # rewritten graphs compute `view_as_real(view_as_complex(x) * freqs)` (the reference
    # rotary) in real arithmetic: inductor runs complex ops as unfused fallback ops, one host
    # call each. auto: with inner='inductor' only (the other inner compilers run the complex
    # ops as eager does, rounding included)
    complex_as_real: Optional[bool] = None
    # CUDA graphs for the inner compile (inductor's triton.cudagraphs, what mode="reduce-overhead"
    # sets; torch.compile refuses mode= together with options=). "auto": on for CUDA models
    # compiled by inductor, off otherwise; True needs both (checked at compile)
    cudagraphs: Any = "auto"
    # dcp_size=1 leaves every graph unchanged; True rewrites MLA attention onto the pass's
    # attention kernel anyway (no exchange), with device positions and CUDA graphs: the
    # single-GPU fast path for int-position (reference-style) models
    fast_path: bool = False
    # the value up-projection that follows an attention (w_vc, latent -> v_head_dim per head)
    # applied to each rank's partial output before the exchange, which then carries
    # v_head_dim columns instead of the latent width. auto: on for every layer where that
    # is exact (rewrites/project_merge.py); True: an error names a layer where it is not
    project_before_merge: Optional[bool] = None
    # the striped MLA latent cache's storage: None ("auto") keeps the model's cache dtype;
    # "fp8_e4m3": the latent columns as float8 e4m3 with one fp32 scale per 128 values, the
    # rotary columns in the model's dtype (runtime/decode/kv_format.py)
    kv_cache_dtype: Optional[str] = None
    # per-head attention over keys and values re-expanded from a latent cache by kv_b_proj
    # (Hugging Face DeepseekV3 / Kimi): fold the key half into the query and apply the
    # value half after the merge, so no step re-expands the context (absorbed MLA).
    # auto: per layer, as `absorb_kv_b_proj_auto` decides (decode on CUDA in 16-bit dtypes)
    absorb_kv_b_proj: Optional[bool] = None

    def __post_init__(self) -> None:
        for name in AUTOMATIC:  # "auto" is the default, None
            if getattr(self, name) == AUTO:
                object.__setattr__(self, name, None)

    @classmethod
    def from_mapping(cls, options: Optional[Mapping[str, Any]]) -> "DcpOptions":
        if options is None:
            return cls()
        if isinstance(options, DcpOptions):
            return options
        if not isinstance(options, Mapping):
            raise DcpOptionError(f"dcp backend options must be a dict, got {type(options).__name__}")
        canonical = _canonical_keys(options)
        opts = cls(**canonical)
        opts.validate()
        return opts

    def validate(self) -> None:
        _check_int("dcp_size", self.dcp_size, minimum=1)
        if self.tp_size is not None:
            _check_int("tp_size", self.tp_size, minimum=1)
        _check_int("attn_dp_size", self.attn_dp_size, minimum=1)
        _check_choice("comm_backend", self.comm_backend, COMM_BACKENDS, allow_none=True)
        _check_bool_or_auto("replicate_q_proj", self.replicate_q_proj)
        _check_choice("lse_base", self.lse_base, LSE_BASES, allow_none=True)
        _check_choice("attn_backend", self.attn_backend, ATTN_BACKENDS)
        _check_choice("inner", self.inner, INNER_COMPILERS)
        _check_bool_or_auto("static_positions", self.static_positions)
        if not isinstance(self.fast_path, bool):
            raise DcpOptionError(f"option 'fast_path' must be True or False, got {self.fast_path!r}")
        _check_bool_or_auto("absorb_kv_b_proj", self.absorb_kv_b_proj)
        if not isinstance(self.strict, bool):
            raise DcpOptionError(f"option 'strict' must be a bool, got {self.strict!r}")
        _check_bool_or_auto("complex_as_real", self.complex_as_real)
        _check_bool_or_auto("project_before_merge", self.project_before_merge)
        _check_kv_cache_dtype(self)
        if not isinstance(self.inner_options, Mapping):
            raise DcpOptionError("option 'inner_options' must be a dict of inner-compiler options")
        if not (isinstance(self.cudagraphs, bool) or self.cudagraphs == "auto"):
            raise DcpOptionError(f"option 'cudagraphs' must be 'auto', True or False, got {self.cudagraphs!r}")
        if self.cudagraphs is True and self.inner != "inductor":
            raise DcpOptionError(
                f"option 'cudagraphs'=True needs inner='inductor' (CUDA graphs are inductor's), "
                f"got inner={self.inner!r}"
            )
        given = self.inner_options.get("triton.cudagraphs")
        if isinstance(self.cudagraphs, bool) and given is not None and bool(given) != self.cudagraphs:
            raise DcpOptionError(
                f"options 'cudagraphs'={self.cudagraphs!r} and 'inner_options'['triton.cudagraphs']={given!r} "
                f"disagree; give one of them"
            )
        if self.group is not None and not _looks_like_process_group(self.group):
            raise DcpOptionError(
                f"option 'group' must be a torch.distributed ProcessGroup, got {type(self.group).__name__}"
            )


def _canonical_keys(options: Mapping[str, Any]) -> dict[str, Any]:
    known = {f.name for f in dataclasses.fields(DcpOptions)}
    out: dict[str, Any] = {}
    for key, value in options.items():
        if not isinstance(key, str):
            raise DcpOptionError(f"dcp option keys must be strings, got {key!r}")
        if key not in known:
            raise DcpOptionError(f"unknown dcp option {key!r}; valid options: {', '.join(sorted(known))}")
        out[key] = _normalize(key, value)
    return out


def _normalize(name: str, value: Any) -> Any:
    if name in AUTOMATIC and isinstance(value, str) and value == AUTO:
        return None
    # lse_base accepts the number 2 as well as "2", stored as "e" / "2".
    if name == "lse_base" and value is not None:
        spelled = {"e": "e", "2": "2", 2: "2"}
        if isinstance(value, bool) or value not in spelled:
            raise DcpOptionError(f"option 'lse_base' must be 'e', 2 or 'auto' (the attention kernel's), got {value!r}")
        return spelled[value]
    return value


ABSORB_DTYPES = ("bfloat16", "float16")


def absorb_kv_b_proj_auto(device_type: str, dtype: str, decode: bool) -> Optional[str]:
    """What option absorb_kv_b_proj "auto" decides for one layer: None to absorb its kv_b_proj,
    else why not (the report's words).

    A pure function of what every rank of the group has alike (the device type, the cache
    dtype's name, whether the call is a decode step), so every rank decides the same. The
    absorbed form pays where the step is bound by re-expanding the cached latent: decode on
    CUDA in a 16-bit dtype, where it is exact up to that dtype's rounding. On the CPU, in
    fp32 or fp64, and for a prefill (several queries per request, where the expansion is
    shared by the queries) the expanded form is kept.
    """
    if device_type != "cuda":
        return f"auto: on for CUDA decode, the model runs on {device_type}"
    if dtype not in ABSORB_DTYPES:
        return f"auto: on for bfloat16 / float16 caches, this one is {dtype}"
    if not decode:
        return "auto: on for decode steps, this call has several queries per request"
    return None


def _check_kv_cache_dtype(opts: "DcpOptions") -> None:
    """A quantised cache needs the pass to own the cache (a rewritten graph) and a kernel that reads it."""
    value = opts.kv_cache_dtype
    if value is None:
        return
    if value not in KV_CACHE_DTYPES:
        raise DcpOptionError(
            f"option 'kv_cache_dtype' must be one of {', '.join(map(repr, KV_CACHE_DTYPES))} or "
            f"{AUTO!r} (the model's cache dtype); got {value!r}"
        )
    if opts.dcp_size == 1 and not opts.fast_path:
        raise DcpOptionError(
            f"option 'kv_cache_dtype'={value!r} needs the pass to stripe the cache: dcp_size=1 "
            f"leaves every graph unchanged; pass dcp_size > 1, or fast_path=True for one rank"
        )
    readers = _backends.fp8_backends()
    if opts.attn_backend not in (None, AUTO) + readers:
        raise DcpOptionError(
            f"option 'kv_cache_dtype'={value!r}: attn_backend={opts.attn_backend!r} reads 16-bit "
            f"caches only; use attn_backend {', '.join(map(repr, (AUTO,) + readers))}"
        )


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise DcpOptionError(f"option {name!r} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise DcpOptionError(f"option {name!r} must be >= {minimum}, got {value}")


def _check_choice(name: str, value: Any, choices: tuple, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value not in choices:
        extra = f" or {AUTO!r} (automatic)" if allow_none else ""
        raise DcpOptionError(f"option {name!r} must be one of {', '.join(map(repr, choices))}{extra}; got {value!r}")


def _check_bool_or_auto(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise DcpOptionError(f"option {name!r} must be True, False or {AUTO!r} (automatic), got {value!r}")


def _looks_like_process_group(group: Any) -> bool:
    try:
        import torch.distributed as dist

        return isinstance(group, dist.ProcessGroup)
    except Exception:  # torch built without distributed
        return False
