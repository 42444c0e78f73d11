"""The Llama reference model, readable in one file.

Weights use the Hugging Face module names (``model.layers.N.self_attn.q_proj`` without the
``model.`` prefix) and HF's rotate-half RoPE convention, so a safetensors checkpoint loads
by name and a GGUF loads after undoing llama.cpp's Q/K row permutation.

K/V never live in the model: every attention layer goes through a
:class:`tieredkv.models.cache.KVCache`. Entry points:

* :func:`prefill` — run a prompt (in chunks) into a cache, return the last logits;
* :func:`decode_one_token` — one token per sequence for a batch of sequences;
* :meth:`Llama.forward` — the general step both are built from.
"""

from __future__ import annotations

import math

import torch
from torch import nn
import torch.nn.functional as F

from tieredkv.models.cache import KVCache, KVSpec
from tieredkv.models.cpu_linear import PackedLinears
from tieredkv.models.config import LlamaConfig


FUSED_NORM_ROWS = 256  # rows (tokens) up to which RMSNorm takes torch's one-op rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype is torch.float32 and self.weight.dtype is torch.float32 and x.numel() <= FUSED_NORM_ROWS * x.shape[-1]:
            # torch's rms_norm: the same float32 result bit for bit (tests/models/test_model_ops.py), one
            # op instead of six: faster up to a few hundred rows, slower at long prefill chunks
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim / 2] in float32, with llama3 / linear scaling."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = config.rope_scaling
    if rs is None:
        return inv_freq
    if rs.rope_type == "linear":
        return inv_freq / rs.factor
    # llama3: long wavelengths are divided by `factor`, short ones kept, smooth in between.
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, head_dim] for integer positions [B, T] (computed in float32)."""
    freqs = positions.float().unsqueeze(-1) * inv_freq.float()
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D]; cos/sin [B, T, D]. The reference form; the model runs
    :func:`apply_rope_heads_last` (equal bit for bit)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [B, T, D] -> the tables :func:`apply_rope_heads_last` takes, [B, T, 1, D]: sin with
    :func:`rotate_half`'s sign folded in (its first half negated), so that the rotation is a
    roll. ``(-a) * b`` and ``a * (-b)`` round alike, so the result is :func:`apply_rope`'s."""
    half = sin.shape[-1] // 2
    return cos.unsqueeze(2), torch.cat([-sin[..., :half], sin[..., half:]], dim=-1).unsqueeze(2)


def apply_rope_heads_last(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [B, T, heads, D] (every head of a projection's output, q and k together) with
    :func:`rope_tables`' tables: :func:`apply_rope`'s values in four ops instead of eight per call."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        h = config.hidden_size
        self.q_proj = nn.Linear(h, config.num_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(h, config.num_kv_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(h, config.num_kv_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, h, bias=False)
        self._qkv, self._o = PackedLinears(self.q_proj, self.k_proj, self.v_proj), PackedLinears(self.o_proj)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, step) -> torch.Tensor:
        """cos / sin: :func:`rope_tables`' [B, T, 1, D]."""
        b, t, _ = x.shape
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        y = self._qkv.joint(x)  # [B, T, (H + 2 KVH) D]: q, k, v
        qk = apply_rope_heads_last(y[..., : (h + kvh) * d].unflatten(-1, (h + kvh, d)), cos, sin)
        q, k = qk[:, :, :h].transpose(1, 2).contiguous(), qk[:, :, h:].transpose(1, 2).contiguous()  # [B, heads, T, D]
        v = y[..., (h + kvh) * d :].unflatten(-1, (kvh, d)).transpose(1, 2)
        out = cache.attend(step, self.layer_idx, q, k, v)
        return self._o(out.transpose(1, 2).reshape(b, t, -1))[0]


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self._gate_up, self._down = PackedLinears(self.gate_proj, self.up_proj), PackedLinears(self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self._gate_up(x)
        return self._down(F.silu(gate) * up)[0]


class Block(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, cache, step):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, step)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self._lm_head = PackedLinears(self.lm_head)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def kv_spec(self) -> KVSpec:
        c = self.config
        return KVSpec(c.num_layers, c.num_kv_heads, c.head_dim, self.dtype, device=str(self.device))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                seq_ids: list[int] | tuple[int, ...], *, last_only: bool = False) -> torch.Tensor:
        """tokens, positions: [B, T] int64 (one row per sequence in ``seq_ids``, each with T new
        tokens). Returns logits [B, T, vocab] (float32), or [B, 1, vocab] with ``last_only``."""
        step = cache.begin_step(seq_ids, tokens.shape[1])
        tokens, positions = tokens.to(self.device), positions.to(self.device)
        x = self.embed_tokens(tokens)
        cos, sin = rope_tables(*rope_cos_sin(self.inv_freq, positions, x.dtype))
        for layer in self.layers:
            x = layer(x, cos, sin, cache, step)
        cache.end_step(step)
        if last_only:
            x = x[:, -1:]
        return self._lm_head(self.norm(x))[0].float()


def init_random_weights(model: Llama, seed: int = 0, std: float = 0.02) -> Llama:
    """Deterministic random weights (normal(0, std), norms at 1) for tests and benchmarks."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


@torch.no_grad()
def prefill(model: Llama, cache: KVCache, seq_id: int, tokens: torch.Tensor, *, start_pos: int = 0,
            chunk_size: int = 512, all_logits: bool = False) -> torch.Tensor:
    """Feed ``tokens`` [T] of one sequence in chunks of ``chunk_size`` (or smaller, when
    the cache limits how many tokens one step may bring).

    Returns the logits of the last token [vocab], or of every token [T, vocab] with
    ``all_logits``. Positions continue from ``start_pos``.
    """
    outs = []
    n = tokens.shape[0]
    limit = cache.max_step_tokens(fixed=True)  # one chunk size for the whole prompt
    if limit is not None:
        chunk_size = min(chunk_size, limit)
    for lo in range(0, n, chunk_size):
        chunk = tokens[lo : lo + chunk_size].unsqueeze(0)
        pos = torch.arange(start_pos + lo, start_pos + lo + chunk.shape[1]).unsqueeze(0)
        logits = model(chunk, pos, cache, [seq_id], last_only=not all_logits)
        outs.append(logits[0])
    return torch.cat(outs, dim=0) if all_logits else outs[-1][-1]


@torch.no_grad()
def decode_one_token(model: Llama, cache: KVCache, seq_ids: list[int], tokens: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
    """One new token per sequence: tokens, positions [B]. Returns logits [B, vocab]."""
    return model(tokens.view(-1, 1), positions.view(-1, 1), cache, seq_ids)[:, 0]
