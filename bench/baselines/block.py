"""The LLaMA block on one device, as ``bench/gpu_block.py``'s ``torch_block`` writes it, for any shape.

RMSNorm (computed in float32, cast back, times the weight), q/k/v projections, rotate-half RoPE with
tables computed in float64, SDPA with causal GQA (``enable_gqa``), output projection, residual,
RMSNorm, SwiGLU FFN, residual.  Weights are ``[in, out]`` matrices (``x @ w``), heads head-major in
the columns, as in ``relational_tensors.graph.models.llama_block``.

The strategies reuse :func:`block_forward` with hooks: ``reduce`` (tensor parallelism sums the
row-parallel products), ``gather_kv`` (sequence parallelism gathers keys and values) and ``pos0`` (the
global position of the first local token).

>>> tiny, cpu = BlockShape(64, 8, 4, 128), torch.device("cpu")
>>> x, p = make_input(1, 16, tiny, 0, cpu, torch.float32), block_params(tiny, 0, cpu, torch.float32)
>>> tuple(block_forward(x, p, tiny).shape)
(1, 16, 64)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from .common import BlockShape, Dist, Prepared, gather_dim, seeded, split_range, split_sizes

__all__ = ["PARAMS", "param_shapes", "block_params", "make_input", "block_forward", "causal_attention",
           "rms_norm", "rope_tables", "apply_rope", "reference_block", "prepare_sharded"]

PARAMS: tuple[str, ...] = ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w1", "w3", "w2")
_SEEDS_PER_BLOCK = 16  # seed s draws x from s*16 and parameter i from s*16 + 1 + i

Take = Callable[[str, torch.Tensor], torch.Tensor]


def param_shapes(shape: BlockShape) -> dict[str, tuple[int, ...]]:
    d, dh = shape.d_model, shape.head_dim
    hq, hkv, ff = shape.n_heads * dh, shape.n_kv_heads * dh, shape.d_ff
    return {"attn_norm": (d,), "wq": (d, hq), "wk": (d, hkv), "wv": (d, hkv), "wo": (hq, d),
            "ffn_norm": (d,), "w1": (d, ff), "w3": (d, ff), "w2": (ff, d)}


def block_params(shape: BlockShape, seed: int, device: torch.device, dtype: torch.dtype,
                 take: Take | None = None) -> dict[str, torch.Tensor]:
    """The block's weights for ``seed`` (norms near 1, matrices scaled by 1/sqrt(fan-in)), each drawn whole
    on ``device`` and cut by ``take(name, full)`` (this rank's slice; default: all of it)."""
    out = {}
    for i, (name, shp) in enumerate(param_shapes(shape).items()):
        seed_i = seed * _SEEDS_PER_BLOCK + 1 + i
        if name.endswith("norm"):
            full = seeded(shp, seed_i, device, dtype, scale=0.1, shift=1.0)
        else:
            full = seeded(shp, seed_i, device, dtype, scale=1.0 / math.sqrt(shp[0]))
        out[name] = full if take is None else take(name, full).contiguous()
        del full
    return out


def make_input(batch: int, seq: int, shape: BlockShape, seed: int, device: torch.device,
               dtype: torch.dtype) -> torch.Tensor:
    """x[batch, seq, d_model] for ``seed``, standard normal."""
    return seeded((batch, seq, shape.d_model), seed * _SEEDS_PER_BLOCK, device, dtype)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rope_tables(pos0: int, length: int, head_dim: int, base: float, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of positions ``pos0 .. pos0 + length - 1``, shaped [1, length, 1, head_dim // 2]."""
    pos = torch.arange(pos0, pos0 + length, device=device, dtype=torch.float64)
    inv = base ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim)
    ang = pos[:, None] * inv[None, :]
    return ang.cos().to(dtype)[None, :, None, :], ang.sin().to(dtype)[None, :, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention of q[b, L, hq, dh] over k, v[b, S, hkv, dh] (S >= L) where the queries are the
    *last* L of the S positions: query i sees keys 0 .. S - L + i.  Returns [b, L, hq, dh]."""
    L, S = q.shape[1], k.shape[1]
    if S < L:
        raise ValueError(f"a query block ends where its keys end, so it needs S >= L; got L={L}, S={S}.")
    gqa = q.shape[2] != k.shape[2]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if L == S:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=gqa)
    elif q.is_cuda:
        # is_causal aligns the mask top-left; a later query block needs it bottom-right.  The CausalBias
        # keeps SDPA on its fused kernels; whether they take unexpanded GQA heads is probed once.
        from torch.nn.attention.bias import causal_lower_right

        if gqa and not _lower_right_takes_gqa(q.device, q.dtype, q.shape[-1]):
            rep = q.shape[2] // k.shape[2]
            kt, vt, gqa = kt.repeat_interleave(rep, dim=1), vt.repeat_interleave(rep, dim=1), False
        extra = {"enable_gqa": True} if gqa else {}  # older CausalBias dispatchers lack the keyword
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=causal_lower_right(L, S), **extra)
    else:
        mask = torch.ones(L, S, dtype=torch.bool, device=q.device).tril(S - L)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=gqa)
    return out.transpose(1, 2)


@functools.cache
def _lower_right_takes_gqa(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether SDPA with a bottom-right CausalBias gives the masked result on unexpanded GQA heads here."""
    from torch.nn.attention.bias import causal_lower_right

    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    q = torch.randn(1, 4, 64, head_dim, generator=gen, device=device, dtype=torch.float32).to(dtype)
    k, v = (torch.randn(1, 2, 128, head_dim, generator=gen, device=device, dtype=torch.float32).to(dtype)
            for _ in range(2))
    mask = torch.ones(64, 128, dtype=torch.bool, device=device).tril(64)
    want = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(2, 1),
                                          v.float().repeat_interleave(2, 1), attn_mask=mask)
    try:
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(64, 128), enable_gqa=True)
    except Exception:  # noqa: BLE001 - any failure means: expand the heads instead
        return False
    return tuple(got.shape) == tuple(want.shape) and bool((got.float() - want).abs().max() < 2e-2)


def block_forward(x: torch.Tensor, p: Mapping[str, torch.Tensor], shape: BlockShape, *, pos0: int = 0,
                  reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  gather_kv: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
                  kv_index: torch.Tensor | None = None) -> torch.Tensor:
    """One block on x[b, s, d] whose first token sits at global position ``pos0``.  Head counts come from
    the weights given (a tensor-parallel rank holds some heads).  ``reduce`` sums the outputs of the
    row-parallel products across ranks; ``gather_kv`` returns the keys and values of positions
    0 .. pos0 + s - 1; ``kv_index`` picks, for each local query head, its key/value head."""
    b, s, d = x.shape
    dh = shape.head_dim
    hq, hkv = p["wq"].shape[1] // dh, p["wk"].shape[1] // dh
    cos, sin = rope_tables(pos0, s, dh, shape.rope_base, x.dtype, x.device)
    h = rms_norm(x, p["attn_norm"], shape.eps)
    q = apply_rope((h @ p["wq"]).view(b, s, hq, dh), cos, sin)
    k = apply_rope((h @ p["wk"]).view(b, s, hkv, dh), cos, sin)
    v = (h @ p["wv"]).view(b, s, hkv, dh)
    if gather_kv is not None:
        k, v = gather_kv(k, v)
    if kv_index is not None:
        k, v = k.index_select(2, kv_index), v.index_select(2, kv_index)
    a = causal_attention(q, k, v).reshape(b, s, hq * dh)
    o = a @ p["wo"]
    if reduce is not None:
        o = reduce(o)
    x2 = x + o
    h2 = rms_norm(x2, p["ffn_norm"], shape.eps)
    f = (F.silu(h2 @ p["w1"]) * (h2 @ p["w3"])) @ p["w2"]
    if reduce is not None:
        f = reduce(f)
    return x2 + f


def reference_block(batch: int, seq: int, shape: BlockShape, seed: int, device: torch.device,
                    dtype: torch.dtype) -> torch.Tensor:
    """The single-process block on the whole input and the whole weights of ``seed``."""
    with torch.no_grad():
        return block_forward(make_input(batch, seq, shape, seed, device, dtype),
                             block_params(shape, seed, device, dtype), shape)


def prepare_sharded(ctx: Dist, shape: BlockShape, batch: int, seq: int, seed: int, dim: int,
                    forward: Callable[[int, int, list[int]], dict] = lambda r0, r1, sizes: {}) -> Prepared:
    """This rank's share of the seeded input along ``dim`` (0: sequences, 1: tokens; contiguous and
    balanced) with the whole seeded weights, run by ``block_forward`` with the keyword arguments
    ``forward(r0, r1, sizes)`` gives for the rank's range [r0, r1); outputs are gathered along ``dim``."""
    n = (batch, seq)[dim]
    r0, r1 = split_range(n, ctx.world, ctx.rank)
    sizes = split_sizes(n, ctx.world)
    p = block_params(shape, seed, ctx.device, ctx.dtype)
    x = make_input(batch, seq, shape, seed, ctx.device, ctx.dtype).narrow(dim, r0, r1 - r0).contiguous()
    kwargs = forward(r0, r1, sizes)

    def step() -> torch.Tensor:
        with torch.no_grad():
            return block_forward(x, p, shape, **kwargs)

    return Prepared(step, lambda y: gather_dim(ctx, y, dim, sizes))
