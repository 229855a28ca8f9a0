"""Hugging Face attention spelled in the other ways models spell it, and beam search.

* The GQA head broadcast in any spelling (HF's `repeat_kv` replaced by each): the decode
  graph's attention layers all match, no near miss.
* Plain MHA (as many KV heads as query heads: Llama, Phi3, GPT-NeoX), whose keys reach the
  attention as the cache tensor itself, is rewritten (it was reported as "written between
  its reads": the graph input sits before the writes in graph order, its reads come after).
* Beam search (`num_beams=2`) on striped static caches: transformers reorders the beams
  with `cache.keys.index_select(0, beam_idx)`, which each rank applies to its own rows;
  fp32 beams and scores equal the model without DCP.

End to end on 2 gloo ranks; the matcher tests need no process group.
"""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import hf_tiny  # noqa: E402
from kit import hf  # noqa: E402

from dcp_pass.testing import run_ranks  # noqa: E402


def _shape(x):
    return x.shape[0], x.shape[1], x.shape[2], x.shape[3]


def _unsqueeze_flatten(x, n):
    return x.unsqueeze(2).expand(-1, -1, n, -1, -1).flatten(1, 2)


def _none_expand_reshape(x, n):
    b, kvh, t, d = _shape(x)
    return x[:, :, None].expand(b, kvh, n, t, d).reshape(b, kvh * n, t, d)


def _ellipsis_expand_reshape(x, n):
    b, kvh, t, d = _shape(x)
    return x[:, :, None, ...].expand(b, kvh, n, t, d).reshape(b, kvh * n, t, d)


def _repeat_interleave(x, n):
    return x.repeat_interleave(n, dim=1)


SPELLINGS = {"none_expand_reshape": _none_expand_reshape, "ellipsis_expand_reshape": _ellipsis_expand_reshape,
             "unsqueeze_flatten": _unsqueeze_flatten, "repeat_interleave": _repeat_interleave}


def _spelled(monkeypatch_or_none, spelling):
    import transformers.models.llama.modeling_llama as llama

    if monkeypatch_or_none is not None:
        monkeypatch_or_none.setattr(llama, "repeat_kv", SPELLINGS[spelling])
    else:
        llama.repeat_kv = SPELLINGS[spelling]


def _decode_matches(model):
    from dcp_pass.rewrites.match import find_mla

    found = [find_mla(gm.graph) for gm, _ in hf.capture_graphs(model)]
    return [len(f.matches) for f in found], [m for f in found for m in f.near_misses]


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_gqa_head_broadcast_spellings_match(monkeypatch, spelling):
    _spelled(monkeypatch, spelling)
    counts, misses = _decode_matches(hf_tiny.tiny_model("llama_gqa", "eager"))
    assert counts == [0, hf_tiny.LAYERS] and not misses, (counts, misses)


@pytest.mark.parametrize("name, impl", [("llama_mha", "eager"), ("phi3", "sdpa")])  # (GPT-NeoX: end to end)
def test_mha_matches(name, impl):
    counts, misses = _decode_matches(hf_tiny.tiny_model(name, impl))
    assert counts == [0, hf_tiny.LAYERS] and not misses, (counts, misses)


# ----------------------------------------------------------------------------- on gloo ranks

# (CI's two cores: one MHA model greedy, one GQA spelling greedy, beams on a third family)
GREEDY = [("gpt_neox", "sdpa", None), ("llama_gqa", "eager", "repeat_interleave")]
BEAMS = [("phi3", "eager")]


def _beam_generate(model):
    return model.generate(hf.PROMPTS, num_beams=2, max_new_tokens=8, do_sample=False, cache_implementation="static",
                          return_dict_in_generate=True, output_scores=True)


def _rank(rank, world):
    import torch._dynamo
    from transformers.cache_utils import CacheLayerMixin

    from dcp_pass.backend import DcpBackend

    torch.set_grad_enabled(False)
    out = {}
    for name, impl, spelling in GREEDY:
        if spelling is not None:
            _spelled(None, spelling)
        torch._dynamo.reset()
        ref = hf.generate(hf_tiny.tiny_model(name, impl))
        model = hf_tiny.tiny_model(name, impl)
        backend = DcpBackend(dcp_size=world, tp_size=1, inner="aot_eager")
        model.compile(backend=backend)
        got = hf.generate(model)
        out[name] = (torch.equal(got.sequences, ref.sequences), hf.logits_error(got, ref),
                     [g.rewritten for g in backend.report.graphs])
    reordered = []  # whether a beam reorder moved rows (not the identity)
    original = CacheLayerMixin.reorder_cache

    def recording(self, beam_idx):
        reordered.append(not torch.equal(beam_idx.cpu(), torch.arange(beam_idx.numel())))
        return original(self, beam_idx)

    CacheLayerMixin.reorder_cache = recording
    for name, impl in BEAMS:
        torch._dynamo.reset()
        ref = _beam_generate(hf_tiny.tiny_model(name, impl))
        model = hf_tiny.tiny_model(name, impl)
        backend = DcpBackend(dcp_size=world, tp_size=1, inner="aot_eager")
        model.compile(backend=backend)
        reordered.clear()
        got = _beam_generate(model)
        err = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got.scores, ref.scores))
        out[f"beams {name}"] = (torch.equal(got.sequences, ref.sequences), err,
                                [g.rewritten for g in backend.report.graphs], any(reordered))
    return out


@pytest.mark.slow
def test_mha_spelled_gqa_and_beam_search_exact():
    for results in run_ranks(_rank, 2, timeout=900):
        for key, (equal, err, rewritten, *moved) in results.items():
            assert equal and err < 1e-5, (key, err, rewritten)
            assert rewritten[-1] == hf_tiny.LAYERS, (key, rewritten)  # the decode graph: every layer
            assert moved in ([], [True]), (key, "no beam reorder moved a row: the test would not see one")
