"""The `dcp` torch.compile backend: options -> topology -> graph pass -> inner compiler.

    torch.compile(model, backend="dcp", options={"dcp_size": 2})

Found through the `torch_dynamo_backends` entry point (pyproject.toml), so no import
is needed. `DcpBackend` is the same thing as an object, for users and tests that
want the report and the rewritten graphs.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.fx as fx
from torch.utils.weak import WeakIdKeyDictionary

from dcp_pass import dynamo_frames, tracing
from dcp_pass.agreement import check_options_agree
from dcp_pass.options import DcpOptionError, DcpOptions
from dcp_pass.report import DcpReport, GraphReport, cache_layers, log
from dcp_pass.rewrites import fx_util
from dcp_pass.rewrites.apply import GRAPH_BREAK_AFTER_WRITES, PassConfig, apply_dcp
from dcp_pass.rewrites.attention import AttentionPlan
from dcp_pass.state import guards
from dcp_pass.state.feeder import CallFeeder, has_striped, plain_inputs
from dcp_pass.topology import DcpTopology, check_explicit_group, dcp_process_group, topology_from_world

tracing.install()  # before the first trace of a model compiled with this backend

_ENTER_INFERENCE = torch.autograd.grad_mode._enter_inference_mode
_EXIT_INFERENCE = torch.autograd.grad_mode._exit_inference_mode


def inference_mode_block(gm: fx.GraphModule) -> Optional[tuple[fx.Node, fx.Node]]:
    """(enter, exit) when the graph's work is one `torch.inference_mode()` block.

    A forward decorated with `@torch.inference_mode()` that Dynamo captures as one graph
    holds `_enter_inference_mode(True)` and its `_exit_inference_mode`, and no other
    inference-mode node. Work outside the pair is allowed when none of it is a graph
    output (e.g. the device step position's arithmetic, rewrites/positions.py, placed
    ahead of the block): its values are used only inside the block, so running it in
    inference mode too changes nothing the caller sees.
    """
    marks = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (_ENTER_INFERENCE, _EXIT_INFERENCE)]
    if len(marks) != 2:
        return None
    enter, leave = marks
    if not (
        enter.target is _ENTER_INFERENCE
        and enter.args[:1] == (True,)
        and leave.target is _EXIT_INFERENCE
        and leave.args[:1] == (enter,)
    ):
        return None
    outside, inside = set(), False
    for node in gm.graph.nodes:
        if node is enter or node is leave:
            inside = node is enter
        elif not inside and node.op in ("call_function", "call_method", "call_module"):
            outside.add(node)
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    if any(n in outside for n in output.all_input_nodes):
        return None
    return enter, leave


def compile_inner(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    opts: DcpOptions,
    mode: Optional[str],
    host_counts: bool = False,
    allocates: bool = False,
) -> Callable:
    """Hand the (rewritten) graph to the compiler named by `opts.inner`.

    A graph that is one inference-mode block (pytorch#180823: AOT autograd fails on it
    with "Cannot set version_counter for inference tensor", plain inductor too) is
    compiled without its enter/exit nodes under `torch.no_grad()` and called inside
    `torch.inference_mode()`: the same semantics (no autograd, inference-tensor
    outputs), as pytorch#181106 proposes (functionalize outside inference mode).
    Handing AOT the enter node would also leave the thread broken when its trace
    fails: the inference-mode guard the node enters under AOT's Python dispatcher is
    never exited, and when it is freed it restores the dispatch keys it saved, the
    Python dispatcher's among them, so every later op fails with "Hit PythonDispatcher
    dispatch key but PythonDispatcherTLS was not set".
    """
    block = inference_mode_block(gm) if opts.inner != "eager" else None
    if block is None:
        return _compile_inner(gm, example_inputs, opts, mode, host_counts, allocates)
    body = fx_util.copy_dynamo_graph_module(gm)  # keeps what marks params/buffers static
    for node in reversed([n for n in body.graph.nodes if n.target in (_ENTER_INFERENCE, _EXIT_INFERENCE)]):
        body.graph.erase_node(node)  # the exit first: it uses the enter
    body.recompile()
    with torch.no_grad():
        compiled = _compile_inner(body, example_inputs, opts, mode, host_counts, allocates)

    def run(*args):
        with torch.inference_mode():
            return compiled(*args)

    if getattr(compiled, "_boxed_call", False):
        run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _compile_inner(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    opts: DcpOptions,
    mode: Optional[str],
    host_counts: bool = False,
    allocates: bool = False,
) -> Callable:
    """`allocates`: the backend makes cache shards for every call of the graph (the graph
    allocated them: rewrites/allocation.py), new addresses each time."""
    patches = inner_config_patches(opts, _device_of(example_inputs), mode, host_counts)
    if patches.get("triton.cudagraphs") and opts.cudagraphs == "auto" and "triton.cudagraphs" not in opts.inner_options:
        # Both kinds of graph run once per generation. CUDA graphs allocate a graph's outputs
        # in their private pool and reuse that memory at the next replay; state the model
        # keeps (a lazily allocated cache, as a Hugging Face StaticCache is in the prefill,
        # and its step counter) would be overwritten there.
        state = fx_util.state_built_in_graph(gm.graph)
        if allocates or state:
            log.info(
                "dcp_pass: a graph %s: compiled without CUDA graphs",
                "allocates cache stripes" if allocates else f"builds state it returns ({', '.join(state[:4])})",
            )
            patches["triton.cudagraphs"] = False
            compiled = _compile_with(gm, example_inputs, opts, patches)
            # the state it returns is marked as the model marks it when made eagerly, or the
            # decode graphs that update it (a step counter) run without their CUDA graphs
            return _marking_static(compiled, _output_indices(gm, state)) if state else compiled
    return _compile_with(gm, example_inputs, opts, patches)


def _output_indices(gm: fx.GraphModule, names: list[str]) -> list[int]:
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    flat = output.args[0] if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    return [i for i, node in enumerate(flat) if isinstance(node, fx.Node) and node.name in names]


def _marking_static(compiled: Callable, indices: list[int]) -> Callable:
    """`compiled`, marking the state it returns as a static address, as the model marks it when
    it allocates that state eagerly (a StaticCache does): the later graphs that update it
    then keep their CUDA graphs. Unguarded: a new generation's state is a new tensor, and
    the CUDA graphs re-record for its address instead of Dynamo recompiling."""

    def run(*args):
        out = compiled(*args)
        for i in indices:
            if isinstance(out[i], torch.Tensor):
                torch._dynamo.mark_static_address(out[i], guard=False)
        return out

    if getattr(compiled, "_boxed_call", False):
        run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _compile_with(
    gm: fx.GraphModule, example_inputs: Sequence[Any], opts: DcpOptions, patches: dict[str, Any]
) -> Callable:
    if opts.inner == "eager":
        return gm.forward
    if opts.inner == "aot_eager":
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, list(example_inputs))
    from torch._inductor.compile_fx import compile_fx

    compiled = compile_fx(gm, example_inputs, config_patches=patches or None)
    assert callable(compiled)  # a Dynamo graph compiles to its forward (the other results are for AOT export)
    return compiled


def inner_config_patches(
    opts: DcpOptions, device: torch.device, mode: Optional[str], host_counts: bool = False
) -> dict[str, Any]:
    """Inductor config patches of the inner compile: `mode`'s options (when a DcpBackend is
    given a mode), then option 'cudagraphs', then 'inner_options' (which win).

    cudagraphs "auto": `mode` decides when given, else on for CUDA tensors under inductor
    (as mode="reduce-overhead" would set it: torch.compile refuses mode= with options=);
    True / False force it; True needs CUDA tensors (raises DcpOptionError otherwise). An
    attention backend that cannot run inside graph capture (the table's ``capturable``)
    turns "auto" off and refuses True; one that plans on the host (FlashInfer) runs inside
    capture in a graph whose key count the backend holds (`host_counts`: an int-position
    decode graph, runtime/decode/step_count.py).
    """
    from dcp_pass.runtime.decode.backends import ATTENTION_BACKENDS

    if opts.cudagraphs is True and torch.device(device).type != "cuda":
        raise DcpOptionError(
            f"option 'cudagraphs'=True needs CUDA tensors, the model is on {torch.device(device).type}; "
            f"use 'auto' (off there) or False"
        )
    entry = ATTENTION_BACKENDS.get(opts.attn_backend)
    capturable = entry is None or entry.capturable or (entry.plans_on_host and host_counts)
    if opts.cudagraphs is True and not capturable:
        raise DcpOptionError(
            f"option 'cudagraphs'=True: attention backend {opts.attn_backend!r} cannot run inside CUDA-graph "
            f"capture here (it plans on the host, and this graph's key counts are device data: only an "
            f"int-position decode graph gives them to it); use 'auto' (off with it) or False, or another "
            f"'attn_backend'"
        )
    if opts.inner != "inductor":
        return {}
    given_mode = bool(mode) and mode != "default"
    patches = dict(torch._inductor.list_mode_options(mode)) if given_mode else {}
    if isinstance(opts.cudagraphs, bool):
        patches["triton.cudagraphs"] = opts.cudagraphs
    elif not given_mode and torch.device(device).type == "cuda":
        patches["triton.cudagraphs"] = capturable
    elif patches.get("triton.cudagraphs") and not capturable:  # the mode's choice
        patches["triton.cudagraphs"] = False
    patches.update(opts.inner_options)
    return patches


def _device_of(example_inputs: Sequence[Any]) -> torch.device:
    for value in example_inputs:
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def check_attn_backend(requested: str, device: torch.device) -> str:
    """An explicitly requested attention backend must be able to run here."""
    from dcp_pass.runtime.decode.backends import ATTENTION_BACKENDS, AUTO

    if requested == AUTO:
        return requested
    if requested not in ATTENTION_BACKENDS:
        names = ", ".join(map(repr, [AUTO, *ATTENTION_BACKENDS]))
        raise DcpOptionError(f"option 'attn_backend' must be one of {names}; got {requested!r}")
    reason = ATTENTION_BACKENDS[requested].available(torch.device(device), None)
    if reason is not None:
        here = [AUTO] + [
            n
            for n, b in ATTENTION_BACKENDS.items()
            if n != requested and b.available(torch.device(device), None) is None
        ]
        choices = ", ".join(map(repr, here[:-1])) + f" or {here[-1]!r}"
        raise DcpOptionError(f"option 'attn_backend'={requested!r} {reason}; use {choices}")
    return requested


def check_inference_only(gm: fx.GraphModule, example_inputs: Sequence[Any], graph_report: GraphReport) -> None:
    """A graph the pass rewrote cannot be differentiated: refuse it when the call needs gradients.

    The exchange of partial results (functional collectives) has no backward, so a
    backward through a rewritten graph would silently drop the other ranks' share of
    every attention gradient. Decode runs without gradients; say how to get there.
    """
    attention_ops = (torch.ops.dcp.mla_local_attention.default, torch.ops.dcp.local_attention.default)
    if not graph_report.rewritten or not any(_grad_enabled_at(gm, op) for op in attention_ops):
        return
    needing = [i for i, x in enumerate(example_inputs) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not needing:
        return
    from dcp_pass.rewrites.apply import DcpRewriteError
    from dcp_pass.rewrites.match import buffer_source, module_path

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]

    def name(i: int) -> str:
        node = placeholders[i] if i < len(placeholders) else None
        return module_path(buffer_source(node)) if node is not None else f"input {i}"

    shown = ", ".join(name(i) for i in needing[:3]) + (f" and {len(needing) - 3} more" if len(needing) > 3 else "")
    raise DcpRewriteError(
        f"graph {graph_report.graph_index}: DCP rewrote {graph_report.rewritten} MLA layer(s), but this call needs "
        f"gradients (grad mode is on and {shown} require grad). DCP is for decode: the exchange of partial "
        f"attention results has no backward. Call the compiled model under torch.no_grad() or "
        f"torch.inference_mode(), or freeze the weights with model.requires_grad_(False)."
    )


def _grad_enabled_at(gm: fx.GraphModule, target: Any) -> bool:
    """Whether grad mode is on at some call of `target`, following the grad-mode nodes
    Dynamo records (`torch.no_grad()` / `torch.inference_mode()` blocks or decorators
    inside the captured frame) from the mode the graph is compiled in."""
    enabled, saved = torch.is_grad_enabled(), []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is torch._C._set_grad_enabled:
            enabled = bool(node.args[0])
        elif node.target is _ENTER_INFERENCE:
            saved.append(enabled)
            enabled = enabled and not node.args[0]
        elif node.target is _EXIT_INFERENCE:
            enabled = saved.pop() if saved else enabled
        elif node.target is target and enabled:
            return True
    return False


def resolve_plan(opts: DcpOptions, topo: DcpTopology, example_inputs: Sequence[Any]) -> AttentionPlan:
    """Group, comm backend, LSE base and attention backend for this compile."""
    from dcp_pass.runtime.decode import comm
    from dcp_pass.runtime.decode.backends import attention_lse_base

    group = opts.group
    if group is not None:
        check_explicit_group(topo, group)
    else:
        group = dcp_process_group(topo)
    device = _device_of(example_inputs)
    comm_backend = comm.select_comm_backend(opts.comm_backend, device, group)
    attn_backend = check_attn_backend(opts.attn_backend, device)
    lse_base = opts.lse_base or attention_lse_base(attn_backend)
    return AttentionPlan(
        topo.dcp_size,
        topo.dcp_rank,
        group.group_name,
        comm_backend,
        topo.head_sharded,
        lse_base,
        attn_backend,
        opts.absorb_kv_b_proj,
    )


def single_rank_plan(opts: DcpOptions, example_inputs: Sequence[Any]) -> AttentionPlan:
    """The plan of option 'fast_path' at dcp_size=1: the pass's attention kernel, no group, no exchange."""
    from dcp_pass.runtime.decode.backends import attention_lse_base

    attn_backend = check_attn_backend(opts.attn_backend, _device_of(example_inputs))
    return AttentionPlan(
        1, 0, "", "none", False, opts.lse_base or attention_lse_base(attn_backend), attn_backend, opts.absorb_kv_b_proj
    )


def pass_config(opts: DcpOptions, plan: AttentionPlan, example_inputs: Sequence[Any]) -> PassConfig:
    """The pass pipeline's settings, the options' "auto" values resolved for this graph."""
    complex_as_real = opts.complex_as_real if opts.complex_as_real is not None else opts.inner == "inductor"
    # every graph of a DCP model, with MLA or not: one symbolic graph would keep the step
    # from replaying as CUDA graphs
    static_positions = (
        opts.static_positions if opts.static_positions is not None else _device_of(example_inputs).type == "cuda"
    )
    return PassConfig(
        plan,
        opts.replicate_q_proj,
        opts.strict,
        complex_as_real,
        static_positions,
        opts.project_before_merge,
        opts.kv_cache_dtype,
    )


def graph_diff(before: fx.GraphModule, after: fx.GraphModule, index: int) -> str:
    """Unified diff of a graph's code before and after the pass (what a reviewer reads)."""
    import difflib

    def lines(gm):
        return [line.split(";  ")[0].rstrip() for line in gm.code.splitlines() if line.strip()]

    return "\n".join(
        difflib.unified_diff(
            lines(before), lines(after), f"graph {index} (captured)", f"graph {index} (dcp)", lineterm="", n=0
        )
    )


def compile_with_feeder(
    gm,
    example_inputs,
    caches,
    weights,
    opts: DcpOptions,
    mode,
    report: DcpReport,
    position=None,
    layers: Optional[Sequence[Optional[str]]] = None,
    checks=(),
    allocations=(),
    allocation_layers: Optional[Sequence[Optional[str]]] = None,
    attention_layers: Sequence[str] = (),
) -> CallFeeder:
    """Compile `gm`, which takes the local shards, the graph's allocated caches, replicated
    weights and (with `position`) the device step position as trailing inputs, and return
    the feeder that resolves them per call (state/feeder.py says what each argument is)."""
    # static-shape fakes: Dynamo never saw the shards, inner fakification would give them
    # symbolic sizes that Dynamo cannot turn into guards
    made = [a.make() for a in allocations]  # examples of each call's: their fakes are compiled for
    held = (
        [shell for shell, _ in made]
        + [entry.local for _, entry in caches]
        + [entry.local for _, entry in made]
        + [w.example for w in weights]
    )
    trailing = [fx_util.static_fake(t) for t in held + ([position.buffer] if position is not None else [])]
    del made
    examples = list(example_inputs) if position is None else position.example_inputs(example_inputs)
    host_counts = position is not None and position.holds_count
    compiled = compile_inner(gm, plain_inputs(examples) + trailing, opts, mode, host_counts, bool(allocations))
    return CallFeeder(
        compiled,
        report,
        caches,
        weights,
        checks,
        allocations,
        position,
        host_counts,
        layers,
        allocation_layers,
        attention_layers,
    )


class DcpBackend:
    """A `dcp` backend instance; keeps a report and the rewritten graphs of every compile."""

    def __init__(self, options: Optional[Mapping[str, Any]] = None, **kwargs: Any):
        merged = dict(options or {})
        merged.update(kwargs)
        self.options = DcpOptions.from_mapping(merged)
        self.topology: Optional[DcpTopology] = None
        self.report = DcpReport(dcp_size=self.options.dcp_size)
        self.graphs: list[fx.GraphModule] = []  # what was handed to the inner compiler
        # called with (pass name, graph module) after each pass of the pipeline (testing.graph_stages)
        self.observer: Optional[Callable[[str, fx.GraphModule], None]] = None
        self.diffs: list[str] = []  # unified diff of the code of every graph the pass rewrote
        self._warned_unchanged = False

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], mode: Optional[str] = None, **_: Any):
        opts = self.options
        if self.topology is None:
            check_options_agree(opts)  # before anything rank-specific can diverge
            self.topology = topology_from_world(opts.dcp_size, opts.tp_size, opts.attn_dp_size)
            self.report.rank = self.topology.rank
        graph_report = GraphReport(len(self.report.graphs))
        self.report.graphs.append(graph_report)
        position, layers, new_caches, checks, allocations, allocation_layers = None, None, [], [], [], []
        if not self.topology.enabled and not opts.fast_path:
            graph_report.unchanged_reason = "dcp_size=1"
            out, caches, weights = gm, [], []
        else:
            plan = (
                resolve_plan(opts, self.topology, example_inputs)
                if self.topology.enabled
                else single_rank_plan(opts, example_inputs)
            )
            result = apply_dcp(
                gm, example_inputs, pass_config(opts, plan, example_inputs), graph_report, observer=self.observer
            )
            out, caches, weights, position = result.graph_module, result.caches, result.weights, result.position
            checks, allocations = result.checks, result.allocations
            check_inference_only(out, example_inputs, graph_report)
            named = cache_layers(graph_report, [entry.name for _, entry in caches] + [a.name for a in allocations])
            layers, allocation_layers = named[: len(caches)], named[len(caches) :]
            self.report.add_uncached_layers(graph_report, named)
            for (index, entry), layer in zip(caches, layers):
                key = self.report.add_cache(
                    example_inputs[index],
                    entry.name,
                    entry.full_nbytes,
                    entry.local_nbytes,
                    layer,
                    renewed=entry.kind.installed_at_first_call,
                    token_rows=entry.token_rows,
                )
                if key is not None:
                    new_caches.append(key)
            if caches or allocations:
                self.diffs.append(graph_diff(gm, out, graph_report.graph_index))
        self.graphs.append(out)
        log.info("%s", self.report.graph_log(graph_report, new_caches))
        self._warn_if_nothing_rewritten(graph_report)
        if caches or allocations or position is not None:
            return compile_with_feeder(
                out,
                example_inputs,
                caches,
                weights,
                opts,
                mode,
                self.report,
                position,
                layers,
                checks,
                allocations,
                allocation_layers,
                [layer.layer for layer in graph_report.layers if layer.rewritten],
            )
        if has_striped(example_inputs):  # a graph that takes a striped buffer without reading it
            compiled = compile_inner(out, plain_inputs(example_inputs), opts, mode)
            return lambda *args: compiled(*plain_inputs(args))
        return compile_inner(out, example_inputs, opts, mode)

    def _warn_if_nothing_rewritten(self, graph_report: GraphReport) -> None:
        """Rank 0 warns once when DCP is on, no graph so far has been rewritten and this one was
        left unchanged for attention it could not rewrite or kept, or for a graph break between a
        cache's writes and its attention: DCP would otherwise save nothing without a word (the
        reasons are in the report, which a user need not print)."""
        kept = [layer for layer in graph_report.layers if not layer.rewritten]
        cut = graph_report.unchanged_reason.startswith(GRAPH_BREAK_AFTER_WRITES)
        if (
            self._warned_unchanged
            or self.topology is None
            or not self.topology.enabled
            or self.topology.rank != 0
            or not (graph_report.near_misses or kept or cut)
            or any(g.rewritten for g in self.report.graphs)
        ):
            return
        self._warned_unchanged = True
        more = 0
        if cut:
            why = graph_report.unchanged_reason
        elif graph_report.near_misses:
            where, reason = graph_report.near_misses[0]
            why = f"the attention at {where} cannot be rewritten: {reason}"
            more = len(graph_report.near_misses) - 1
        else:  # attention was found, and its layers kept as they are
            why = f"{kept[0].layer} is {kept[0].detail}"
        text = (
            f"dcp_pass: dcp_size={self.options.dcp_size} but graph {graph_report.graph_index} was left unchanged "
            f"and no graph has been rewritten so far: {why}"
            + (f" ({more} more near miss(es) in the report)" if more else "")
            + "; strict=True raises this instead, and the backend's report lists every graph"
        )
        warnings.warn(text, UserWarning, stacklevel=2)
        log.warning("%s", text)


# One DcpBackend per torch.compile call, held weakly by the object Dynamo keeps for that
# call (the backend wrapper its compiled frames call on every recompile): the entry lives
# exactly as long as the compiled model does. (Keying by id(options) shared one backend
# between every compile without options, id(None), and never let an entry go.)
_BACKENDS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_LAST_REPORT: list[DcpReport] = []  # plain data (names, byte counts), no tensors
_LAST_BACKEND: list[weakref.ref] = []  # weak: must not keep a dead model's graphs alive


def _compile_call_owner() -> Optional[object]:
    """The object Dynamo holds for the torch.compile / torch._dynamo.optimize call whose
    frame is being compiled (the output graph's `compiler_fn`: one per call, reused by
    every recompile of that compiled model, freed with it); None outside Dynamo."""
    try:
        return dynamo_frames.tracing_compiler_fn()
    except Exception:  # noqa: BLE001 - not tracing, or Dynamo internals moved: one backend per call
        return None


def dcp_backend(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    options: Optional[Mapping[str, Any]] = None,
    mode: Optional[str] = None,
    **kwargs: Any,
):
    """Entry point of `backend="dcp"`; one DcpBackend per torch.compile call (shared by its
    recompiles, freed with the compiled model). Called outside Dynamo: a new one per call."""
    owner = _compile_call_owner()
    backend = None
    if owner is not None:
        try:
            backend = _BACKENDS.get(owner)
        except TypeError:  # not weak-referenceable
            owner = None
    if backend is None:
        backend = DcpBackend(options)
        if owner is not None:
            _BACKENDS[owner] = backend
    _LAST_REPORT[:] = [backend.report]
    _LAST_BACKEND[:] = [weakref.ref(backend)]
    return backend(gm, example_inputs, mode=mode)


def last_report() -> Optional[DcpReport]:
    """The report of the `dcp` backend that compiled most recently in this process
    (kept after its model is gone: it holds no tensors)."""
    return _LAST_REPORT[0] if _LAST_REPORT else None


def last_backend() -> Optional[DcpBackend]:
    """The `dcp` backend instance that compiled most recently (its graphs, diffs, report);
    None once its compiled model has been freed."""
    return _LAST_BACKEND[0]() if _LAST_BACKEND else None


guards.register_dcp_compilers(DcpBackend, dcp_backend)  # the cache guards' test for a DCP compile
