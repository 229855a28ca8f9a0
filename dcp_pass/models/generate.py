"""Greedy decoding loops for the example models (plain PyTorch, no DCP knowledge).

`greedy_generate` is the reference-style ragged batch loop: all requests share one
position counter; a request whose prompt is still running keeps its prompt token instead
of the model's prediction, so every position is fed exactly once and in order.

`speculative_greedy_generate` is greedy speculative decoding with a draft model, one
request at a time (batch size 1); its output equals `greedy_generate(target, ...)`.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

__all__ = ["greedy_generate", "speculative_greedy_generate", "teacher_forced"]


def _unwrap(model) -> nn.Module:
    """The module itself, also when `model` is its torch.compile wrapper."""
    return getattr(model, "_orig_mod", model)


def _max_seq_len(model) -> Optional[int]:
    return getattr(_unwrap(model), "max_seq_len", None)


def _max_batch(model) -> Optional[int]:
    args = getattr(_unwrap(model), "args", None)
    return getattr(args, "max_batch_size", None)


def _device(model) -> torch.device:
    for p in _unwrap(model).parameters():
        return p.device
    return torch.device("cpu")


@torch.no_grad()
def greedy_generate(
    model: nn.Module, prompts: list[list[int]], max_new_tokens: int
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy ragged-batch decoding.

    Calls `model(tokens[:, prev_pos:cur_pos], prev_pos)` for cur_pos from the shortest
    prompt length to max_prompt_len + max_new_tokens - 1. Returns the `max_new_tokens`
    generated tokens of every request (prompt excluded) and the logits of every step
    ([B, vocab] float32 clones, one per model call, in call order).
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    bsz = len(prompts)
    max_batch = _max_batch(model)
    if max_batch is not None and bsz > max_batch:
        raise ValueError(f"{bsz} prompts exceed max_batch_size={max_batch}")
    lens = [len(p) for p in prompts]
    total_len = max(lens) + max_new_tokens
    max_seq = _max_seq_len(model)
    if max_seq is not None and total_len > max_seq:
        raise ValueError(f"longest prompt + max_new_tokens = {total_len} exceeds max_seq_len={max_seq}")

    device = _device(model)
    tokens = torch.full((bsz, total_len), -1, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p, dtype=torch.long, device=device)
    prompt_mask = tokens != -1

    step_logits: list[torch.Tensor] = []
    prev_pos = 0
    for cur_pos in range(min(lens), total_len):
        logits = model(tokens[:, prev_pos:cur_pos], prev_pos)
        step_logits.append(logits.detach().float().clone())
        next_token = logits.argmax(dim=-1)
        next_token = torch.where(prompt_mask[:, cur_pos], tokens[:, cur_pos], next_token)
        tokens[:, cur_pos] = next_token
        prev_pos = cur_pos

    out = [tokens[i, lens[i] : lens[i] + max_new_tokens].tolist() for i in range(bsz)]
    return out, step_logits


def _has_recurrent_state(model) -> bool:
    return bool(getattr(_unwrap(model), "has_recurrent_state", False))


@torch.no_grad()
def speculative_greedy_generate(
    target: nn.Module,
    draft: nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    k: int,
    stats: Optional[dict] = None,
) -> list[list[int]]:
    """Greedy speculative decoding; output equals `greedy_generate(target, ...)[0]`.

    Requests are decoded one at a time (batch size 1). Each round the draft proposes `k`
    tokens greedily, then the target scores the last committed token plus the `k`
    proposals in ONE call on a static shape of k + 1 tokens:
    `target(tokens[:, n-1 : n+k], n-1, all_logits=True)` (what `forward_all` does; it is
    called through `target(...)` so a `torch.compile`d target runs compiled). The longest
    prefix of proposals that matches the target's greedy choices is accepted, plus the
    target's own next token. Cache rows written for rejected tokens are simply overwritten
    later; the causal mask keeps positions beyond each query invisible.

    Both models must have position-addressed caches (a recurrent state cannot be rewound).
    If `stats` is a dict it receives counts: rounds, proposed, accepted, target_calls.
    """
    if k < 1:
        raise ValueError("k must be >= 1")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    for name, m in (("target", target), ("draft", draft)):
        if _has_recurrent_state(m):
            raise ValueError(f"speculative decoding needs rewindable caches; the {name} model has recurrent state")
    max_seq = min(s for s in (_max_seq_len(target), _max_seq_len(draft), 1 << 62) if s is not None)
    device = _device(target)
    counts = {"rounds": 0, "proposed": 0, "accepted": 0, "target_calls": 0}
    results: list[list[int]] = []

    for prompt in prompts:
        if not prompt:
            raise ValueError("every prompt needs at least one token")
        if len(prompt) + max_new_tokens + k > max_seq:
            raise ValueError(
                f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) + k ({k}) exceeds max_seq_len={max_seq}"
            )
        seq = list(prompt)
        goal = len(prompt) + max_new_tokens
        # target cache holds correct rows for positions [0, len(seq) - 1)
        if len(seq) > 1:
            target(torch.tensor([seq[:-1]], device=device), 0)
            counts["target_calls"] += 1
        draft_valid = 0  # draft cache holds correct rows for positions [0, draft_valid)

        while len(seq) < goal:
            n = len(seq)
            # draft: k greedy proposals; the first call catches up on unseen tokens
            proposals: list[int] = []
            logits = draft(torch.tensor([seq[draft_valid:]], device=device), draft_valid)
            proposals.append(int(logits[0].argmax()))
            for j in range(1, k):
                logits = draft(torch.tensor([[proposals[-1]]], device=device), n + j - 1)
                proposals.append(int(logits[0].argmax()))

            # target: one verification call on k + 1 tokens starting at position n - 1
            window = torch.tensor([[seq[-1]] + proposals], device=device)
            choice = target(window, n - 1, all_logits=True)[0].argmax(dim=-1).tolist()  # choice[i] -> pos n+i
            counts["target_calls"] += 1
            accepted = 0
            while accepted < k and proposals[accepted] == choice[accepted]:
                accepted += 1
            seq.extend(proposals[:accepted])
            seq.append(choice[accepted])
            counts["rounds"] += 1
            counts["proposed"] += k
            counts["accepted"] += accepted
            # draft rows n .. n+k-2 held proposals; those that were accepted stay valid
            draft_valid = min(n + accepted, n + k - 1)

        results.append(seq[len(prompt) : goal])

    if stats is not None:
        stats.update(counts)
    return results


@torch.no_grad()
def teacher_forced(model: nn.Module, prompts: list[list[int]], generated: list[list[int]],
                   max_new_tokens: int) -> list[torch.Tensor]:
    """The logits of `greedy_generate(model, prompts, max_new_tokens)`'s calls ([B, vocab] float32
    each), fed `generated` (e.g. another model's greedy tokens) instead of this model's own
    predictions, so that two models are compared on the same tokens at every step.

    The ragged loop runs every request to the longest prompt + `max_new_tokens`, so a request
    with a shorter prompt needs that many tokens in all: take `generated` from
    `greedy_generate(reference, prompts, max_new_tokens + longest - shortest prompt)` (its
    first calls' logits are those of the shorter run).
    """
    lens = [len(p) for p in prompts]
    total = max(lens) + max_new_tokens
    rows = [p + g for p, g in zip(prompts, generated)]
    short = [i for i, r in enumerate(rows) if len(r) < total - 1]
    if short:
        raise ValueError(f"request {short[0]} has {len(rows[short[0]])} tokens; the loop feeds {total - 1}")
    tokens = torch.tensor([r[:total] + [0] * (total - len(r[:total])) for r in rows], device=_device(model))
    logits, prev = [], 0
    for cur in range(min(lens), total):
        logits.append(model(tokens[:, prev:cur], prev).float().clone())
        prev = cur
    return logits
