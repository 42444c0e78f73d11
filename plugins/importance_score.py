"""ImportanceScore — reference semantics (float32, readable).

Per page of a sequence, a score in [0, 1] mixing three signals (weights default to the
design note's 0.4 / 0.3 / 0.3):

* **query relevance** — how much attention the *current* query can pay to the page.
  The design note's sketch projected Q alone, which cannot see the keys; here relevance
  is a Quest-style upper bound of q·k over the page from per-page element-wise min/max
  key summaries (kept on the device; 2·D values per kv head and page), turned into an
  estimated attention share with a softmax over pages (log page length added), max over
  query heads, then divided by the largest page's share so the best page scores 1;
* **position** — a learned value per log-spaced distance bucket (any context length),
  initialized with a cosine anneal from 1 (recent) to 0 (far);
* **saliency** — a learned per-page value in [0, 1] from a small MLP over the keys,
  computed once per token when the key is written (see runtime.tiered.scorer).
"""

from __future__ import annotations

import math

import torch

from tieredkv.plugins.tiered_attention import as_mask

#: ImportanceScore weights that make its score the relevance alone
RELEVANCE_ONLY = (1.0, 0.0, 0.0)
#: distances below this many tokens share bucket 0; bucket i >= 1 covers [2^(i-1), 2^i) * EXACT_TOKENS
EXACT_TOKENS = 16


def distance_bucket(distance: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Log-spaced bucket of a non-negative token distance: 0 for d < 16, then one bucket
    per doubling, the last bucket open-ended."""
    # exact for integer distances: the number of thresholds 16 * 2^(i-1), i = 1..NB-1, reached
    # (a float32 log2 rounds up just below large powers of two)
    thresholds = EXACT_TOKENS * 2.0 ** torch.arange(num_buckets - 1, dtype=torch.float64, device=distance.device)
    return (distance.double().unsqueeze(-1) >= thresholds).sum(-1)


def cosine_position_init(num_buckets: int) -> torch.Tensor:
    """Cosine anneal from 1 (bucket 0) to 0 (last bucket)."""
    i = torch.arange(num_buckets, dtype=torch.float32)
    return 0.5 * (1 + torch.cos(math.pi * i / max(1, num_buckets - 1)))


def position_value(distance: torch.Tensor, position_table: torch.Tensor) -> torch.Tensor:
    """The learned position signal in [0, 1] for token distances (any shape)."""
    return position_table[distance_bucket(distance, position_table.shape[0])].clamp(0.0, 1.0)


def quest_upper_bound(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Upper bound of q·k over the keys of each page.

    q [B, H, D]; kmin, kmax [B, M, KVH, D] (element-wise min / max of the page's keys).
    Returns [B, H, M]: sum_d max(q_d * kmin_d, q_d * kmax_d) for the page's kv head.
    """
    b, h, d = q.shape
    kvh = kmin.shape[2]
    # max(q*lo, q*hi) = relu(q)*hi - relu(-q)*lo element-wise: two batched matmuls
    qg = q.float().view(b, kvh, h // kvh, d)
    lo = kmin.float().permute(0, 2, 3, 1)  # [B, KVH, D, M]
    hi = kmax.float().permute(0, 2, 3, 1)
    return (torch.relu(qg) @ hi - torch.relu(-qg) @ lo).reshape(b, h, -1)


def bound_logits(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, page_tokens: torch.Tensor,
                 page_mask: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """Per head, the upper bound of each page's attention logit plus log(tokens in the page)
    (the bound of the page's log-sum-exp): [B, H, M], -inf where ``page_mask`` is False."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    page_mask = as_mask(page_mask)
    ub = quest_upper_bound(q, kmin, kmax) * scale + torch.log(page_tokens.float().clamp(min=1)).unsqueeze(1)
    return ub.masked_fill(~page_mask.unsqueeze(1), float("-inf"))


def _share_of_bounds(ub: torch.Tensor) -> torch.Tensor:
    """Each page's largest estimated attention share over the heads, from ``bound_logits``
    [B, H, M], normalized so the best page is 1; [B, M], 0 for masked pages."""
    share = torch.softmax(ub, dim=-1).nan_to_num(0.0).amax(dim=1)  # [B, M]
    return share / share.amax(dim=-1, keepdim=True).clamp(min=1e-30)


def _head_rank_of_bounds(ub: torch.Tensor, page_mask: torch.Tensor) -> torch.Tensor:
    """Each page's best per-head rank by ``bound_logits`` [B, H, M] (ties: lower page first) as
    1 - rank / M; [B, M], 0 for masked pages."""
    m = ub.shape[-1]
    order = torch.sort(ub, dim=-1, descending=True, stable=True).indices
    page_mask = as_mask(page_mask)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(m, device=order.device).expand_as(order))
    score = 1.0 - rank.amin(dim=1).float() / m
    return torch.where(page_mask, score, torch.zeros_like(score))


def _kv_head_share_of_bounds(ub: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Per kv head, each page's largest estimated attention share over the head's query group,
    from ``bound_logits`` [B, H, M], normalized so each kv head's best page is 1; [B, KVH, M],
    0 for masked pages."""
    b, h, m = ub.shape
    share = torch.softmax(ub, dim=-1).nan_to_num(0.0).view(b, kv_heads, h // kv_heads, m).amax(dim=2)
    return share / share.amax(dim=-1, keepdim=True).clamp(min=1e-30)


#: how ``relevance`` combines a layer's query heads: ``share`` (every implementation),
#: ``head-rank`` and ``kv-head`` (the PyTorch reference only, for now)
AGGREGATES = ("share", "head-rank", "kv-head")


def relevance(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, page_tokens: torch.Tensor,
              page_mask: torch.Tensor, *, scale: float | None = None, aggregate: str = "share") -> torch.Tensor:
    """The query-relevance signal [B, M] (0 where ``page_mask`` is False).

    ``aggregate = "share"``: the estimated attention share of each page for the current query
    (largest over the query heads), normalized so the best page is 1.
    ``aggregate = "head-rank"``: a ranking that gives every query head a place in the attention
    budget (Quest selects per head; here a layer's heads share its pages): each head ranks the
    pages by its bound (``bound_logits``; ties: lower page first), and a page scores
    1 - (its best rank over the heads) / M, in (0, 1]. The top k pages by this score are the
    union of every head's top j pages for the largest j that fits, ties by page index.
    ``aggregate = "kv-head"``: one ranking per kv head, [B, KVH, M] — the share of ``share``
    over the head's query group only, normalized per kv head — so each kv head selects its
    own pages (Quest's per-head selection at the granularity of the K/V a group shares).
    """
    ub = bound_logits(q, kmin, kmax, page_tokens, page_mask, scale=scale)
    if aggregate == "share":
        return _share_of_bounds(ub)
    if aggregate == "head-rank":
        return _head_rank_of_bounds(ub, page_mask)
    if aggregate == "kv-head":
        return _kv_head_share_of_bounds(ub, kmin.shape[2])
    raise ValueError(f"aggregate: expected one of {AGGREGATES}, got {aggregate!r}")


def mix(weights: tuple[float, float, float], relevance: torch.Tensor | None, position: torch.Tensor | None,
        saliency: torch.Tensor) -> torch.Tensor:
    """w_rel * relevance + w_pos * position + w_sal * saliency (the score's mix of its signals;
    the runtime mixes its observed relevance with the same function), summed in that order. A
    term whose weight is 0 is left out (its signal may be None): the same value, since every
    signal is finite and non-negative."""
    score = None
    for w, signal in zip(weights, (relevance, position, saliency)):
        if w:
            score = w * signal if score is None else score + w * signal
    return torch.zeros_like(saliency, dtype=torch.float32) if score is None else score


def importance_score(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, page_tokens: torch.Tensor,
                     distance: torch.Tensor, saliency: torch.Tensor, page_mask: torch.Tensor,
                     position_table: torch.Tensor, weights: tuple[float, float, float], *,
                     scale: float | None = None, aggregate: str = "share") -> torch.Tensor:
    """ImportanceScore: the mixed score [B, M] in [0, 1] (0 where ``page_mask`` is False);
    [B, KVH, M], one score per kv head, with ``aggregate = "kv-head"`` and a relevance weight.

    q [B, H, D] — the query the step attends with (the last new token's);
    kmin, kmax [B, M, KVH, D]; page_tokens [B, M] — tokens written in the page;
    distance [B, M] — query position minus the page's last token position;
    saliency [B, M] in [0, 1]; page_mask [B, M] bool or int32 (nonzero: the pages competing); position_table [NB];
    weights (relevance, position, saliency), non-negative, summing to 1;
    aggregate — how :func:`relevance` combines the query heads (the ONNX and CUDA forms
    implement ``share``).
    """
    w_rel, w_pos, _ = weights
    page_mask = as_mask(page_mask)
    rel = relevance(q, kmin, kmax, page_tokens, page_mask, scale=scale, aggregate=aggregate) if w_rel else None
    pos = position_value(distance, position_table) if w_pos else None
    saliency = saliency.float()
    if rel is not None and rel.dim() == 3:  # one ranking per kv head: the page signals broadcast over the heads
        pos, saliency, page_mask = (None if pos is None else pos.unsqueeze(1)), saliency.unsqueeze(1), page_mask.unsqueeze(1)
    score = mix(weights, rel, pos, saliency)
    return torch.where(page_mask, score, torch.zeros_like(score))


def relevance_and_ranking(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, page_tokens: torch.Tensor,
                          distance: torch.Tensor, saliency: torch.Tensor, page_mask: torch.Tensor,
                          position_table: torch.Tensor, weights: tuple[float, float, float], *,
                          aggregate: str = "share") -> tuple[torch.Tensor, torch.Tensor]:
    """What a step's selection reads, as the step graph computes it: the relevance
    (ImportanceScore with weights ``RELEVANCE_ONLY``) and the ranking SelectPages selects by
    (ImportanceScore with the selection ``weights`` and ``aggregate``; the relevance itself
    when those are relevance by share)."""
    args = (q, kmin, kmax, page_tokens, distance, saliency, page_mask, position_table)
    rel = importance_score(*args, RELEVANCE_ONLY)
    if tuple(weights) == RELEVANCE_ONLY and aggregate == "share":
        return rel, rel
    return rel, importance_score(*args, weights, aggregate=aggregate)
