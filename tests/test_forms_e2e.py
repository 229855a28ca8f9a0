"""Every way of writing MLA in dcp_pass.models.mla_forms gets DCP, exact, on real gloo ranks.

Each rank compiles the unmodified model with backend "dcp" and runs, per form:
  * greedy decoding of ragged prompts (a first call shorter than c, so some ranks hold
    nothing yet, then 10 decode steps), against the same model uncompiled;
  * a chunked prefill (two multi-token calls at positions 0 and 5) and a static 3-token
    verification call after decode steps, fed the same tokens as the eager model;
and checks fp32 logits (1e-5 relative), greedy tokens, the report (every layer rewritten,
its value projection moved before the exchange, ~1/c of the KV bytes per rank) and that
the module's full-size caches were released.

One spawn per group size runs the forms back to back (spawning and compiling dominate on
two cores); see below for which forms CI runs where. The calls after decoding keep the
prompts' batch, so their decode steps reuse the decode graph greedy decoding compiled.
"""
from __future__ import annotations

import pytest
import torch

from dcp_pass import env
from dcp_pass.testing import run_ranks

PROMPTS = [[5, 7, 9, 11, 2, 3], [1], [3, 4], [8, 8, 1, 4]]  # ragged; the first call has one token
STEPS = 10
FULL = env.full_tests()


def _calls(model, tokens: torch.Tensor):
    """Chunked prefill, decode steps, then a 3-token verification call (logits of each)."""
    spans = [(0, 5), (5, 8)] + [(p, p + 1) for p in range(8, 12)] + [(12, 15), (15, 16)]
    return [model(tokens[:, a:b], a).float() for a, b in spans]


def _run_forms(rank: int, world: int, forms: list[str], inner: str):
    import torch._dynamo

    from dcp_pass.backend import DcpBackend
    from dcp_pass.models.generate import greedy_generate
    from dcp_pass.models.mla_forms import FormArgs, build_forms_model
    from dcp_pass.state import store

    torch.set_grad_enabled(False)
    out = {}
    for form in forms:
        torch._dynamo.reset()
        args = FormArgs(form=form, n_layers=1)
        eager = build_forms_model(args, seed=3)
        model = build_forms_model(args, seed=3)
        backend = DcpBackend(dcp_size=world, tp_size=1, inner=inner)
        compiled = torch.compile(model, backend=backend)
        want_tokens, want_logits = greedy_generate(eager, PROMPTS, STEPS)
        got_tokens, got_logits = greedy_generate(compiled, PROMPTS, STEPS)
        tokens = torch.randint(0, args.vocab_size, (len(PROMPTS), 16), generator=torch.Generator().manual_seed(7))
        want_calls, got_calls = _calls(eager, tokens), _calls(compiled, tokens)
        report = backend.report
        caches = [b for layer in model.layers for name, b in layer.attn.named_buffers() if name != "block_table"]
        out[form] = {
            "rel": max(((g - w).abs().amax() / w.abs().amax()).item()
                       for g, w in zip(got_logits + got_calls, want_logits + want_calls)),
            "tokens_equal": got_tokens == want_tokens,
            "call_tokens_equal": all(torch.equal(g.argmax(-1), w.argmax(-1)) for g, w in zip(got_calls, want_calls)),
            "layers": report.layers_rewritten,
            "kv_full": report.kv_bytes_full,
            "kv_local": report.kv_bytes_local,
            "released": all(store.is_released(b) for b in caches),
            "summary": report.summary(),
        }
    return out


def _check(results: dict, world: int):
    for form, r in results.items():
        assert r["layers"] >= 1, (form, r["summary"])
        assert r["rel"] < 1e-5, (form, r["rel"])
        assert r["tokens_equal"] and r["call_tokens_equal"], form
        assert r["kv_local"] * world <= r["kv_full"] * 1.15 and r["kv_local"] > 0, (form, r["summary"])
        assert r["released"], form
        # every form's value up-projection moves before the exchange (project_before_merge="auto"),
        # except where the model reads the attention's LSE from the same exchange
        if form == "flex_sink":
            assert "merged LSE to the model" in r["summary"], r["summary"]
            assert "v-projection after merge (the model reads the attention's LSE" in r["summary"], r["summary"]
        else:
            summary = r["summary"]
            assert "v-projection before merge" in summary and "after merge" not in summary, (form, summary)


def _forms():
    from dcp_pass.models.mla_forms import FORMS

    return list(FORMS)


# What CI runs (two cores, a budget of minutes; each form costs three to five compiles per
# rank): one form per recogniser family at c = 2 under aot_eager (softmax: the window, whose
# start has its own striping; SDPA: the unexpanded latent head with enable_gqa; flex), the
# paged pool (its pages have their own striping, its attention is the softmax recogniser's)
# at c = 4 under aot_eager and at c = 2 under inductor, and the sink (folded in after the
# merge, the exchange returning its LSE) and flex_sink (the model folds its sink in from the
# merged LSE flex_attention returns it) at c = 4 under aot_eager. The other forms' matches and
# rewritten graphs are pinned without ranks (test_match_forms, test_graph_diff_forms).
# DCP_TEST_FULL=1 runs every form at c = 2 and 4 under both inner compilers.
C2_FORMS = ["window", "sdpa_gqa", "flex"]
C4_FORMS = ["paged", "sink", "flex_sink"]
INDUCTOR_FORMS = ["paged"]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_every_form_exact_aot_eager(world):
    forms = _forms() if FULL else (C2_FORMS if world == 2 else C4_FORMS)
    results = run_ranks(_run_forms, world, forms, "aot_eager", timeout=1800)
    for r in results:
        _check(r, world)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4] if FULL else [2])
def test_every_form_exact_inductor(world):
    results = run_ranks(_run_forms, world, _forms() if FULL else INDUCTOR_FORMS, "inductor", timeout=1800)
    for r in results:
        _check(r, world)
