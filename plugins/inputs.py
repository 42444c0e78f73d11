"""Random, valid inputs of every op at any size — one builder per op, shared by the tests that
compare the implementations (reference, ONNX, CUDA) and by the kernel benchmark.

Each builder takes a ``torch.Generator`` (the tensors are made on its device) and returns
the op's arguments by name, in argument order, so ``op(**inputs)`` calls the reference.
Sizes are keyword arguments; the options switch on the awkward cases every implementation
must get right (padding columns, sequences that see nothing, queries before every key,
masked pages, edge distances, non-finite values).
"""

from __future__ import annotations

import torch

from tieredkv.plugins.select_pages import ATTEND_ALL
from tieredkv.plugins.tiered_attention import PAD_PAGE_INDEX


def _rand(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.rand(*shape, generator=gen, device=gen.device)


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=gen.device)


def _randint(gen: torch.Generator, low: int, high: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=gen, device=gen.device)


def _randperm(gen: torch.Generator, n: int) -> torch.Tensor:
    return torch.randperm(n, generator=gen, device=gen.device)


def tiered_attention_inputs(gen: torch.Generator, *, B: int, H: int, KVH: int, T: int, D: int, P: int, M: int,
                            C: int | None = None, pad: int = 0, keep: float = 0.8, empty_row: bool = False,
                            blind: bool = False, partial: bool = False, causal_cut: bool = True) -> dict:
    """TieredAttention inputs: B sequences listing M pages each (the last ``pad`` columns are
    padding, ``page_index = PAD_PAGE_INDEX``) of a pool of C pages (default B * M + 3), in
    shuffled logical order with gaps (pages of the sequence that are not listed); a listed
    page is kept with probability ``keep``; ``seq_len`` ends inside the last page and ``past``
    is a decode or prefill position, with ``causal_cut`` off by up to 2P tokens (causal cuts
    inside pages).

    ``empty_row``: sequence 0 has ``seq_len = 0``; ``blind``: every page of the last sequence is
    masked; ``partial``: sequence 0's first queries sit before every key (``past = -3``, its
    first listed page is logical page 0 and kept).
    """
    C = B * M + 3 if C is None else C
    real = M - pad
    dev = gen.device
    q = _randn(gen, B, H, T, D)
    k_pool = _randn(gen, C, KVH, P, D) * 2
    v_pool = _randn(gen, C, KVH, P, D)
    page_table = torch.stack([_randperm(gen, C)[:M] if C >= M else _randint(gen, 0, C, (M,)) for _ in range(B)])
    page_index = torch.full((B, M), PAD_PAGE_INDEX, dtype=torch.int64, device=dev)
    for b in range(B):
        page_index[b, :real] = _randperm(gen, real + 2)[:real]  # gaps: pages not listed
    page_mask = _rand(gen, B, M) < keep
    seq_len = _randint(gen, 1, (real + 2) * P + 1, (B,))
    past = seq_len - T
    if causal_cut:
        past = past - _randint(gen, 0, 2 * P, (B,))
    past = past.clamp(min=0)
    if partial:
        past[0] = -3
        page_mask[0, 0] = True
        page_index[0, 0] = 0
        seq_len[0] = max(int(seq_len[0]), P)
    if empty_row:
        seq_len[0] = 0
    if blind:
        page_mask[-1] = False
    return dict(q=q, k_pool=k_pool, v_pool=v_pool, page_table=page_table, page_mask=page_mask,
                page_index=page_index, seq_len=seq_len, past=past)


def warm_inputs(gen: torch.Generator, inputs: dict, codec: str, *, share: float = 0.5) -> dict:
    """``inputs`` (of :func:`tiered_attention_inputs`) with about ``share`` of the listed pages
    stored encoded with ``codec`` in a warm pool (rows shuffled, one unused row): their
    ``warm_row`` names the row, and their ``page_table`` entry points at another pool page, so
    that only decoding the bytes gives the right answer. Adds ``warm_pool``, ``warm_row`` and
    ``warm_codec`` (the reference's keyword arguments)."""
    from tieredkv.plugins.codec import CODECS, encode_pages

    table, k_pool, v_pool = inputs["page_table"], inputs["k_pool"], inputs["v_pool"]
    b, m = table.shape
    warm = _rand(gen, b, m) < share
    warm[0, 0] = True
    n = int(warm.sum())
    rows = _randperm(gen, n + 1)[:n]
    src = table[warm]
    enc = encode_pages(k_pool[src], v_pool[src], CODECS[codec])
    data = torch.zeros(n + 1, enc.shape[1], dtype=torch.uint8, device=enc.device)
    data[rows] = enc
    warm_row = torch.full((b, m), -1, dtype=torch.int64, device=table.device)
    warm_row[warm] = rows
    table = table.clone()
    table[warm] = (table[warm] + 1) % k_pool.shape[0]  # the wrong page: must not be read
    return {**inputs, "page_table": table, "warm_pool": data, "warm_row": warm_row, "warm_codec": codec}


#: distances at and around the bucket edges (powers of two times 16), far beyond the last
#: bucket, and negative (bucket 0)
EDGE_DISTANCES = ([0, 1, 15, 16, 17, 31, 32, 33] + [v for k in range(6, 21) for v in (2 ** k - 1, 2 ** k, 2 ** k + 1)]
                  + [10 ** 6, 10 ** 9, 2 ** 40, 2 ** 52, -3])


def importance_score_inputs(gen: torch.Generator, *, B: int, H: int, KVH: int, D: int, M: int, NB: int = 16,
                            P: int = 16, keep: float = 0.75, blind: bool = False,
                            weights: tuple[float, float, float] = (0.4, 0.3, 0.3)) -> dict:
    """ImportanceScore inputs: key summaries with kmin <= kmax, 0..P tokens per page, distances
    half from :data:`EDGE_DISTANCES` and half random up to 2^20, a position table with values
    outside [0, 1] at both ends (clipped), pages kept with probability ``keep`` (``blind``: the
    last sequence keeps none)."""
    dev = gen.device
    kmin = _randn(gen, B, M, KVH, D)
    kmax = kmin + _rand(gen, B, M, KVH, D) * 2
    edges = torch.tensor(EDGE_DISTANCES, device=dev)
    distance = torch.where(_rand(gen, B, M) < 0.5, edges[_randint(gen, 0, len(EDGE_DISTANCES), (B, M))],
                           _randint(gen, 0, 1 << 20, (B, M)))
    page_mask = _rand(gen, B, M) < keep
    if blind:
        page_mask[-1] = False
    return dict(q=_randn(gen, B, H, D), kmin=kmin, kmax=kmax, page_tokens=_randint(gen, 0, P + 1, (B, M)),
                distance=distance, saliency=_rand(gen, B, M), page_mask=page_mask,
                position_table=torch.linspace(-0.2, 1.2, NB, device=dev), weights=weights)


def select_pages_inputs(gen: torch.Generator, *, B: int, M: int, ties: bool = False, budget: str = "random") -> dict:
    """SelectPages inputs: padding columns at the end of each row (0..M/4 of them), about a fifth
    of the valid pages pinned, scores in [0, 1) (``ties``: drawn from 4 values, so equal scores
    abound). ``budget``: ``random`` (between 0 and M + 2 pages per sequence), ``all``
    (:data:`ATTEND_ALL`) or ``tight`` (at most the pinned count)."""
    dev = gen.device
    score = _randint(gen, 0, 4, (B, M)).float() / 4 if ties else _rand(gen, B, M)
    n_valid = M - _randint(gen, 0, M // 4 + 1, (B,))
    valid = torch.arange(M, device=dev).unsqueeze(0) < n_valid.unsqueeze(1)
    pinned = _rand(gen, B, M) < 0.2
    if budget == "all":
        attend = torch.full((B,), ATTEND_ALL, dtype=torch.int64, device=dev)
    elif budget == "tight":
        attend = (pinned & valid).sum(-1) - _randint(gen, 0, 2, (B,))
    else:
        attend = _randint(gen, 0, M + 3, (B,))
    return dict(score=score, valid=valid, pinned=pinned, attend_pages=attend)


def kv_append_inputs(gen: torch.Generator, *, C: int, KVH: int, P: int, D: int, N: int,
                     dtype: torch.dtype = torch.float32) -> dict:
    """KVAppend inputs: random pools and N new tokens written to distinct (slot, offset) places."""
    where = _randperm(gen, C * P)[:N]
    return dict(k_pool=_randn(gen, C, KVH, P, D).to(dtype), v_pool=_randn(gen, C, KVH, P, D).to(dtype),
                k_new=_randn(gen, N, KVH, D).to(dtype), v_new=_randn(gen, N, KVH, D).to(dtype),
                slot=where // P, offset=where % P)


#: kinds of page data :func:`codec_pages` makes
CODEC_DATA = ("random", "edge", "signed zeros")


def codec_pages(gen: torch.Generator, n: int, shape: tuple[int, int, int], kind: str = "random") -> torch.Tensor:
    """Pages [n, KVH, P, D] float32 for the page codecs (KVEncodePages).

    * ``random``: normal * 3;
    * ``edge``: each token row (n, h, t) one of: zeros, ~1e-6, ~±6e4, subnormals ~1e-40,
      normal * 3, normal * 1e5 (beyond float16: zero points and keyframes saturate) (row kind
      (n + t) % 6; with n > 1 page 0 is all zeros), then NaN and +Inf at a few positions
      anywhere and -Inf at a few positions of non-zero rows;
    * ``signed zeros``: ``edge`` plus -0.0 and -Inf inside zero rows: groups whose sanitized
      values are zeros of both signs (the asymmetric codecs store their minimum, +0 or -0 by
      torch's reduction order, as a zero point canonicalized to +0).
    """
    kvh, p, d = shape
    if kind == "random":
        return _randn(gen, n, kvh, p, d) * 3
    if kind not in CODEC_DATA:
        raise ValueError(f"unknown codec data kind {kind!r}; expected one of {CODEC_DATA}")
    dev = gen.device
    sign = torch.where(_rand(gen, n, kvh, p, d) < 0.5, -1.0, 1.0)
    normal = _randn(gen, n, kvh, p, d)
    by_kind = [torch.zeros(n, kvh, p, d, device=dev), normal * 1e-6, sign * 6e4 * (1 + 0.03 * normal),
               normal * 1e-40, normal * 3, normal * 1e5]
    row_kind = (torch.arange(n, device=dev).view(n, 1, 1, 1) + torch.arange(p, device=dev).view(1, 1, p, 1)) % 6
    if n > 1:
        row_kind = torch.where(torch.arange(n, device=dev).view(n, 1, 1, 1) == 0, 0, row_kind)
    row_kind = row_kind.expand(n, kvh, p, d)
    x = torch.zeros(n, kvh, p, d, device=dev)
    for i, values in enumerate(by_kind):
        x = torch.where(row_kind == i, values, x)
    flat, zero_row = x.view(-1), (row_kind == 0).reshape(-1)
    few = max(2, flat.numel() // 128)
    order = _randperm(gen, flat.numel())  # distinct positions for the special values
    anywhere = order[: 2 * few]
    flat[anywhere] = torch.tensor([float("nan"), float("inf")], device=dev)[torch.arange(2 * few, device=dev) % 2]
    rest = order[2 * few:]
    flat[rest[~zero_row[rest]][:few]] = float("-inf")
    if kind == "signed zeros":
        zero_pos = rest[zero_row[rest]][: 4 * few]
        flat[zero_pos] = torch.tensor([-0.0, float("-inf")], device=dev)[torch.arange(len(zero_pos), device=dev) % 2]
    return x
