"""The report: `str(report)` reads as an overview that counts layers (not graphs), its
repr is short, unknown GraphReport fields still render, and DCP_LOGS=info logs each
graph's lines once, when that graph compiles."""
import dataclasses
import logging

import torch
from torch import nn

from dcp_pass.backend import DcpBackend
from dcp_pass.report import DcpReport, GraphReport, LayerReport, cache_layers
from kit.graphs import TinyMLA, tiny_inputs


def _run(model, calls, **options):
    be = DcpBackend(dcp_size=2, inner="eager", comm_backend="a2a", **options)
    compiled = torch.compile(model, backend=be)
    with torch.no_grad():
        for args in calls:
            compiled(*args)
    return be


def test_layers_sharing_one_graph_count_once_each(fake_world, caplog):
    # three MLA layers; the MoE blocks' data-dependent expert loop makes each Block its own
    # frame, so layers 1 and 2 run one compiled graph (layer 2 is known only at run time),
    # and prefill and decode compile that graph twice
    from dcp_pass.models.deepseek_mla import ModelArgs, build_model

    model = build_model(ModelArgs(tp_size=2, n_layers=3, n_dense_layers=1), rank=0)
    tokens = lambda s: torch.zeros(2, s, dtype=torch.long)  # noqa: E731
    with caplog.at_level(logging.INFO, logger="dcp_pass"):
        be = _run(model, [(tokens(3), 0), (tokens(1), 3), (tokens(1), 4)])
    report = be.report
    assert report.layers_rewritten == 3, str(report)
    assert report.graph_rewrites == 4, str(report)
    text = str(report)
    assert text.splitlines()[0] == (
        f"dcp_pass report (dcp_size=2, rank 0): 3 MLA layers rewritten, in 4 of {len(report.graphs)} graphs")
    assert "  layers: attn x3" in text.splitlines()
    # the graphs name each layer `attn`; the model's module paths tell them apart
    assert report.layer_paths(model) == ["layers.0.attn", "layers.1.attn", "layers.2.attn"]
    assert "graph(s)" not in text and "MLA layer(s)" not in text
    # identical graphs grouped: the unchanged ones, the two prefill and the two decode graphs
    assert [line.split(":")[0] for line in text.splitlines() if line.startswith("  graph")] == [
        "  graphs 0-1, 4-12, 15-20", "  graphs 2-3", "  graphs 13-14"]
    assert len(repr(report)) < 120 and repr(report).startswith("<DcpReport ")
    # each graph logged once, in order, as it compiled: not the whole report again
    logged = [r.getMessage() for r in caplog.records if r.name == "dcp_pass" and r.levelno == logging.INFO]
    assert [m.split(":")[0] for m in logged] == [f"rank 0 graph {i}" for i in range(len(report.graphs))]
    assert sum(len(m.splitlines()) for m in logged) < 3 * len(report.graphs)


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = TinyMLA(), TinyMLA()

    def forward(self, q_lat, q_pe, latent, k_pe, start_pos):
        return self.first(q_lat, q_pe, latent, k_pe, start_pos) + self.second(q_lat, q_pe, latent, k_pe, start_pos)


def test_layers_of_one_graph_and_recompiles(fake_world):
    be = _run(TwoLayers(), [tiny_inputs(3, 0), tiny_inputs(1, 3), tiny_inputs(1, 4)])
    report = be.report
    assert report.layers_rewritten == 2 and report.graph_rewrites == 2 * len(report.graphs), report.summary()
    assert "2 MLA layers rewritten" in str(report) and "layers: first, second" in str(report)


def test_one_layer_reads_singular_and_dcp1_reads_unchanged():
    one = DcpReport(dcp_size=2, graphs=[GraphReport(0, [LayerReport("attn", True, "decode")])])
    one.add_uncached_layers(one.graphs[0], [])
    assert str(one).splitlines()[0].endswith("1 MLA layer rewritten, in 1 of 1 graph")
    assert "graph 0: rewrote attn: decode" in str(one)
    off = DcpReport(graphs=[GraphReport(i, unchanged_reason="dcp_size=1") for i in range(3)])
    assert str(off).splitlines() == ["dcp_pass report (dcp_size=1, rank 0): 0 MLA layers rewritten, in 0 of 3 graphs",
                                     "  graphs 0-2: unchanged: dcp_size=1"]


def test_fields_added_to_graph_report_render():
    @dataclasses.dataclass
    class Record:
        name: str
        count: int
        notes: list = dataclasses.field(default_factory=list)

    Extended = dataclasses.make_dataclass(
        "Extended", [("steps", list, dataclasses.field(default_factory=list)), ("origin", str, "")],
        bases=(GraphReport,))
    report = DcpReport(dcp_size=2, graphs=[
        Extended(0, steps=[Record("cache_writes", 2), Record("rotary", 0, ["off"]), ("tuple", 1, [])], origin="x"),
        Extended(1)])
    text = str(report)
    assert "    steps: cache_writes 2, rotary 0 (off), tuple 1" in text.splitlines()
    assert "    origin: x" in text.splitlines()
    assert text.count("steps") == 1 and text.count("origin") == 1  # an empty field adds nothing
    assert "steps" not in report.summary()  # summary() shows the fields it names


def test_cache_layers_picks_one_cache_per_layer():
    graph = GraphReport(0, [LayerReport("layers.0.attn", True, ""), LayerReport("layers.1.attn", True, ""),
                            LayerReport("kv_cache", True, ""), LayerReport("kept", False, ""),
                            LayerReport("attn", True, ""), LayerReport("attn.inner", True, "")])
    names = ["layers.1.attn.pe_cache", "layers.0.attn.pe_cache", "layers.0.attn.kv_cache", "kv_cache",
             "layers.1.attn.kv_cache", "kept.kv_cache", "attn.inner.kv_cache", "attn.kv_cache"]
    assert cache_layers(graph, names) == [None, None, "layers.0.attn", "kv_cache", "layers.1.attn", None,
                                          "attn.inner", "attn"]


def test_bytes_per_token_per_layer():
    """Striped caches' bytes per token of context, averaged over their layers: two layers of a
    512 + 64 bf16 latent over 2 requests x 100 positions (1152 B per token per layer), each rank
    holding 51 of the 100 positions at c = 2; a cache of unknown token rows is not counted."""
    report = DcpReport(dcp_size=2)
    assert report.bytes_per_token_per_layer is None
    keep = []
    for layer in ("layers.0.attn", "layers.1.attn"):
        for width in (512, 64):
            buffer = torch.empty(1)
            keep.append(buffer)
            report.add_cache(buffer, f"{layer}.cache_{width}", 2 * 100 * width * 2, 2 * 51 * width * 2,
                             token_rows=2 * 100)
    keep.append(torch.empty(1))
    report.add_cache(keep[-1], "layers.1.attn.other", 10**6, 10**6)
    full, local = report.bytes_per_token_per_layer
    assert full == 1152 and abs(local - 1152 * 0.51) < 1e-9
    assert "striped cache bytes per token per layer: 1152 without DCP -> 587.5 on this rank" in str(report)
