"""Max and average pooling over windows, and its gradient, on one function spec's blocks (PyTorch's
arithmetic, as ``sql_specs.pool`` states it): 1 to 3 spatial dimensions, each given here as three (the
missing ones of extent 1, kernel 1, stride 1, no padding).

* ``pool``: a program per run of output positions; each position visits its window's taps in the NumPy
  kernel's order (so an average sums in the same order), padding read as -inf (max) or 0 (average).
* ``pool_grad``: a program per run of input positions gathers the gradient of every window that covers
  it (no atomics: the same bits every run); for max, each such window's first largest input is found
  again from x and only the winner takes the window's dy.

Blocks may start anywhere in the whole tensor: the kernels take each block's absolute lower corner, and
padding is decided against the whole tensor's extent.  An average that counts the padding divides each
window by its part inside the padded input: the whole window, but for ``ceil_mode``'s last ones."""

from __future__ import annotations

import triton
import triton.language as tl

from relational_tensors.kernels.common import DevBuf, Ptr, acc_type
from relational_tensors.kernels.triton_copy import index4

__all__ = ["pool", "pool_grad"]

BLOCK = 256


@triton.jit
def _tap(x_bc, i0, i1, i2, xs0, xs1, xs2, xlo0, xlo1, xlo2, e0, e1, e2, live, ACC: tl.constexpr):
    """(inside, value) of the input at absolute position (i0, i1, i2) of a window: inside the whole
    tensor (not padding) and this block's value there (0 outside)."""
    ok = live & (i0 >= 0) & (i0 < e0) & (i1 >= 0) & (i1 < e1) & (i2 >= 0) & (i2 < e2)
    v = tl.load(x_bc + (i0 - xlo0) * xs0 + (i1 - xlo1) * xs1 + (i2 - xlo2) * xs2, mask=ok, other=0.0).to(ACC)
    return ok, v


@triton.jit
def _padded_count(w0, w1, w2, e0, e1, e2, K0: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, P0: tl.constexpr,
                  P1: tl.constexpr, P2: tl.constexpr):
    """How many positions of the windows starting at (w0, w1, w2) lie inside the padded input."""
    return (tl.minimum(w0 + K0, e0 + P0) - w0) * (tl.minimum(w1 + K1, e1 + P1) - w1) * \
        (tl.minimum(w2 + K2, e2 + P2) - w2)


@triton.jit
def _pool_kernel(x_ptr, out_ptr, n, channels,
                 m0, m1, m2, xs_b, xs_c, xs0, xs1, xs2, os_b, os_c, os0, os1, os2,
                 xlo0, xlo1, xlo2, olo0, olo1, olo2, e0, e1, e2,
                 K0: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr,
                 S2: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr,
                 MAX: tl.constexpr, INCLUDE_PAD: tl.constexpr, ACC: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    live = offs < n
    bc, o0, o1, o2 = index4(offs, m0, m1, m2)  # bc: batch·channels
    b = bc // channels
    c = bc % channels
    base0 = (olo0 + o0) * S0 - P0
    base1 = (olo1 + o1) * S1 - P1
    base2 = (olo2 + o2) * S2 - P2
    x_bc = x_ptr + b * xs_b + c * xs_c
    if MAX:
        acc = tl.full([BLOCK_SIZE], float("-inf"), dtype=ACC)
    else:
        acc = tl.zeros([BLOCK_SIZE], dtype=ACC)
    count = tl.zeros([BLOCK_SIZE], dtype=ACC)
    for k0 in tl.static_range(K0):
        for k1 in tl.static_range(K1):
            for k2 in tl.static_range(K2):
                ok, v = _tap(x_bc, base0 + k0, base1 + k1, base2 + k2, xs0, xs1, xs2, xlo0, xlo1, xlo2,
                             e0, e1, e2, live, ACC)
                if MAX:
                    acc = tl.maximum(acc, tl.where(ok, v, float("-inf")))
                else:
                    acc = acc + tl.where(ok, v, 0.0)
                    count = count + tl.where(ok, 1.0, 0.0)
    if not MAX:
        if INCLUDE_PAD:
            acc = acc / _padded_count(base0, base1, base2, e0, e1, e2, K0, K1, K2, P0, P1, P2).to(ACC)
        else:
            acc = acc / count
    tl.store(out_ptr + b * os_b + c * os_c + o0 * os0 + o1 * os1 + o2 * os2, acc.to(out_ptr.dtype.element_ty),
             mask=live)


def _three(values: tuple[int, ...], fill: int) -> tuple[int, int, int]:
    """A per-spatial-dimension tuple padded at the back to three dimensions."""
    out = tuple(values) + (fill,) * (3 - len(values))
    return out[0], out[1], out[2]


def _spatial(buf: DevBuf) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(shape, strides) of a block's spatial dimensions, padded to three (extent 1, stride 0)."""
    return _three(buf.shape[2:], 1), _three(buf.strides[2:], 0)


def pool(x: DevBuf, out: DevBuf, x_lower: tuple[int, ...], out_lower: tuple[int, ...], extent: tuple[int, ...],
         op: str, kernel_size: tuple[int, ...], stride: tuple[int, ...], padding: tuple[int, ...],
         count_include_pad: bool) -> None:
    """out [b, c, *o] = op over windows of x [b, c, *rows], ``x_lower``/``out_lower`` the blocks' absolute
    spatial corners and ``extent`` the whole input's spatial extent (``ceil_mode`` is in ``out``'s shape)."""
    n = out.size
    if not n:
        return
    (m0, m1, m2), os_ = _spatial(out)
    _, xs = _spatial(x)
    k, s, p = _three(kernel_size, 1), _three(stride, 1), _three(padding, 0)
    _pool_kernel[(triton.cdiv(n, BLOCK),)](
        Ptr(x), Ptr(out), n, out.shape[1], m0, m1, m2, x.strides[0], x.strides[1], *xs, out.strides[0],
        out.strides[1], *os_, *_three(x_lower, 0), *_three(out_lower, 0), *_three(extent, 1),
        K0=k[0], K1=k[1], K2=k[2], S0=s[0], S1=s[1], S2=s[2], P0=p[0], P1=p[1], P2=p[2], MAX=op == "max",
        INCLUDE_PAD=bool(count_include_pad), ACC=acc_type(out.dtype), BLOCK_SIZE=BLOCK)


@triton.jit
def _window_winner(x_bc, w0, w1, w2, xs0, xs1, xs2, xlo0, xlo1, xlo2, e0, e1, e2, live,
                   K0: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, ACC: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr):
    """The flat tap index of the first largest input of each window starting at (w0, w1, w2)."""
    best = tl.full([BLOCK_SIZE], float("-inf"), dtype=ACC)
    win = tl.zeros([BLOCK_SIZE], dtype=tl.int32)
    for k0 in tl.static_range(K0):
        for k1 in tl.static_range(K1):
            for k2 in tl.static_range(K2):
                ok, v = _tap(x_bc, w0 + k0, w1 + k1, w2 + k2, xs0, xs1, xs2, xlo0, xlo1, xlo2, e0, e1, e2, live,
                             ACC)
                v = tl.where(ok, v, float("-inf"))
                more = v > best
                if k0 == 0 and k1 == 0 and k2 == 0:  # the first tap wins ties and a window of -inf
                    more = live
                best = tl.where(more, v, best)
                win = tl.where(more, (k0 * K1 + k1) * K2 + k2, win)
    return win


@triton.jit
def _pool_grad_kernel(x_ptr, dy_ptr, out_ptr, n, channels,
                      m0, m1, m2, xs_b, xs_c, xs0, xs1, xs2, gs_b, gs_c, gs0, gs1, gs2,
                      os_b, os_c, os0, os1, os2,
                      xlo0, xlo1, xlo2, glo0, glo1, glo2, gn0, gn1, gn2, rlo0, rlo1, rlo2, e0, e1, e2,
                      K0: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr,
                      S2: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr,
                      MAX: tl.constexpr, INCLUDE_PAD: tl.constexpr, ACC: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    live = offs < n
    bc, r0, r1, r2 = index4(offs, m0, m1, m2)  # bc: batch·channels
    b = bc // channels
    c = bc % channels
    a0 = rlo0 + r0  # this input position, absolute
    a1 = rlo1 + r1
    a2 = rlo2 + r2
    x_bc = x_ptr + b * xs_b + c * xs_c
    dy_bc = dy_ptr + b * gs_b + c * gs_c
    acc = tl.zeros([BLOCK_SIZE], dtype=ACC)
    # the windows that cover position a: outputs o with o*S - P <= a < o*S - P + K, tap t = a - (o*S - P)
    for t0 in tl.static_range(K0):
        for t1 in tl.static_range(K1):
            for t2 in tl.static_range(K2):
                q0 = a0 + P0 - t0
                q1 = a1 + P1 - t1
                q2 = a2 + P2 - t2
                o0 = q0 // S0
                o1 = q1 // S1
                o2 = q2 // S2
                hit = live & (q0 >= 0) & (q1 >= 0) & (q2 >= 0) & (q0 % S0 == 0) & (q1 % S1 == 0) & (q2 % S2 == 0)
                hit = hit & (o0 >= glo0) & (o0 < glo0 + gn0) & (o1 >= glo1) & (o1 < glo1 + gn1) & \
                    (o2 >= glo2) & (o2 < glo2 + gn2)
                g = tl.load(dy_bc + (o0 - glo0) * gs0 + (o1 - glo1) * gs1 + (o2 - glo2) * gs2, mask=hit,
                            other=0.0).to(ACC)
                if MAX:
                    win = _window_winner(x_bc, o0 * S0 - P0, o1 * S1 - P1, o2 * S2 - P2, xs0, xs1, xs2,
                                         xlo0, xlo1, xlo2, e0, e1, e2, hit, K0, K1, K2, ACC, BLOCK_SIZE)
                    hit = hit & (win == (t0 * K1 + t1) * K2 + t2)
                    acc = acc + tl.where(hit, g, 0.0)
                elif INCLUDE_PAD:
                    whole = _padded_count(o0 * S0 - P0, o1 * S1 - P1, o2 * S2 - P2, e0, e1, e2, K0, K1, K2, P0, P1, P2)
                    acc = acc + tl.where(hit, g / tl.maximum(whole, 1).to(ACC), 0.0)
                else:
                    w0 = o0 * S0 - P0
                    w1 = o1 * S1 - P1
                    w2 = o2 * S2 - P2
                    inside = (tl.minimum(w0 + K0, e0) - tl.maximum(w0, 0)) * \
                        (tl.minimum(w1 + K1, e1) - tl.maximum(w1, 0)) * (tl.minimum(w2 + K2, e2) - tl.maximum(w2, 0))
                    acc = acc + tl.where(hit, g / tl.maximum(inside, 1).to(ACC), 0.0)
    tl.store(out_ptr + b * os_b + c * os_c + r0 * os0 + r1 * os1 + r2 * os2, acc.to(out_ptr.dtype.element_ty),
             mask=live)


def pool_grad(x: DevBuf, dy: DevBuf, out: DevBuf, x_lower: tuple[int, ...], dy_lower: tuple[int, ...],
              out_lower: tuple[int, ...], extent: tuple[int, ...], op: str, kernel_size: tuple[int, ...],
              stride: tuple[int, ...], padding: tuple[int, ...], count_include_pad: bool) -> None:
    """out [b, c, *rows] = dx of ``pool`` from x's block (its windows, for max) and dy's, each block's
    absolute spatial corner given, and ``extent`` the whole input's spatial extent."""
    n = out.size
    if not n:
        return
    (m0, m1, m2), os_ = _spatial(out)
    _, xs = _spatial(x)
    (g0, g1, g2), gs = _spatial(dy)
    k, s, p = _three(kernel_size, 1), _three(stride, 1), _three(padding, 0)
    _pool_grad_kernel[(triton.cdiv(n, BLOCK),)](
        Ptr(x), Ptr(dy), Ptr(out), n, out.shape[1], m0, m1, m2, x.strides[0], x.strides[1], *xs,
        dy.strides[0], dy.strides[1], *gs, out.strides[0], out.strides[1], *os_,
        *_three(x_lower, 0), *_three(dy_lower, 0), g0, g1, g2, *_three(out_lower, 0), *_three(extent, 1),
        K0=k[0], K1=k[1], K2=k[2], S0=s[0], S1=s[1], S2=s[2], P0=p[0], P1=p[1], P2=p[2], MAX=op == "max",
        INCLUDE_PAD=bool(count_include_pad), ACC=acc_type(out.dtype), BLOCK_SIZE=BLOCK)
