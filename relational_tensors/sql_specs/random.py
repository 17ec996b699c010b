"""Random operators: train-mode ``dropout`` and ``random`` (uniform or Bernoulli values), drawn by a
counter-based generator so that every split, device count and executor draws the same values.

The generator is Philox4x32-10 (Salmon et al., SC'11).  The value at flat row-major index ``i`` of a
tensor's *full* shape is one Philox block with

* key     = (seed & 0xffffffff, (seed >> 32) & 0xffffffff)
* counter = (i & 0xffffffff, i >> 32, stream, offset & 0xffffffff)

and u(i) = (first output word >> 8) · 2^-24, a uniform float in [0, 1) on a grid of 2^-24 (exact in
float32).  ``seed`` and ``offset`` come from an int64 tensor ``rng`` of shape [2] (a graph input, so a
training loop changes them without recompiling; the seed's 64 bits are read in two's complement, the
offset's low 32 bits are used); ``stream`` tells the random sites of one graph apart.  A block knows
where it sits in the whole tensor (its box), so a block computes exactly the values the whole tensor
has there: every index splits anywhere and nothing is aggregated.  The GPU kernels
(``kernels/triton_random.py``) compute the same bits.

* ``dropout(x, rng; p, stream)`` = ``(x · keep) · s`` in x's dtype (computed in x's compute dtype), with
  keep(i) = [u(i) >= p] and s = 1/(1 - p) rounded to the compute dtype.  Since u(i) = k·2^-24 for the
  integer k = word >> 8, u(i) >= p exactly when k >= ⌈p·2^24⌉, which is how the GPU kernel compares.
  Its gradient is the same dropout of the cotangent.
* ``random(rng; shape, dtype, stream, distribution, p)``: ``uniform`` gives u(i) truncated to the dtype's
  significand (``UNIFORM_BITS``: (word >> (32 - b)) · 2^-b, so every value lies in [0, 1) exactly, 16-bit
  dtypes included); ``bernoulli`` gives 1.0 where u(i) < p, else 0.0, so that P(1) = p and dropout with the
  same stream keeps exactly where ``bernoulli`` gives 0.

The generator, against Random123's first known-answer vector and on four indices:

>>> [hex(int(w[0])) for w in philox4x32([np.zeros(1, np.uint32)] * 4, (0, 0))]
['0x6627e8d5', '0xe169c58d', '0xbc57ac4c', '0x9b00dbd8']
>>> [round(float(u), 4) for u in philox_uniform(seed=42, offset=0, stream=0, flat_indices=np.arange(4))]
[0.613, 0.9877, 0.8259, 0.7296]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from relational_tensors.core.dtypes import FLOAT_DTYPES, numpy_dtype
from relational_tensors.core.spec import FunctionSpec
from relational_tensors.core.types import Box, TensorType
from relational_tensors.errors import GraphError
from relational_tensors.sql_specs.base import Builder, Grads, IndexedOp, register
from relational_tensors.sql_specs.common import finite_number
from relational_tensors.sql_specs.grad import build

__all__ = ["DropoutOp", "RandomOp", "philox4x32", "philox_bits", "philox_uniform", "flat_indices", "rng_words",
           "keep_threshold", "dropout_scale", "PHILOX_M", "PHILOX_W", "PHILOX_ROUNDS", "UNIFORM_BITS",
           "DISTRIBUTIONS"]

PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # the round multipliers
PHILOX_W = (0x9E3779B9, 0xBB67AE85)  # the Weyl increments of the key between rounds
PHILOX_ROUNDS = 10
_MASK32 = 0xFFFFFFFF

# significand bits of a uniform value per dtype: as many as the dtype holds exactly below 1 (at most 24,
# the bits u carries), so no value rounds up to 1.0
UNIFORM_BITS = {"float64": 24, "float32": 24, "float16": 11, "bfloat16": 8}
DISTRIBUTIONS = ("uniform", "bernoulli")
# integer operations per element (10 rounds of two 32x32->64 products, xors and key bumps), as FLOPs
PHILOX_OPS = 40.0


def philox4x32(counter: Sequence[np.ndarray], key: tuple[int, int],
               rounds: int = PHILOX_ROUNDS) -> tuple[np.ndarray, ...]:
    """Philox4x32 of the counter words ``counter`` (four uint32 arrays of one shape) under ``key`` (two
    32-bit integers): the four output words, as uint32 arrays.  Vectorized over the arrays."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint32) for c in counter)
    k0, k1 = key[0] & _MASK32, key[1] & _MASK32
    m0, m1 = np.uint64(PHILOX_M[0]), np.uint64(PHILOX_M[1])
    for r in range(rounds):
        if r:  # the key is bumped between rounds
            k0, k1 = (k0 + PHILOX_W[0]) & _MASK32, (k1 + PHILOX_W[1]) & _MASK32
        p0 = c0.astype(np.uint64) * m0  # 32x32 -> 64-bit products, split into high and low words
        p1 = c2.astype(np.uint64) * m1
        hi0, lo0 = (p0 >> np.uint64(32)).astype(np.uint32), p0.astype(np.uint32)
        hi1, lo1 = (p1 >> np.uint64(32)).astype(np.uint32), p1.astype(np.uint32)
        c0, c1, c2, c3 = hi1 ^ c1 ^ np.uint32(k0), lo1, hi0 ^ c3 ^ np.uint32(k1), lo0
    return c0, c1, c2, c3


def philox_bits(seed: int, offset: int, stream: int, flat_indices: np.ndarray) -> np.ndarray:
    """The first Philox output word (uint32) at each flat index, in the module's key and counter layout."""
    i = np.asarray(flat_indices, dtype=np.int64).astype(np.uint64)
    seed, offset = int(seed), int(offset)
    counter = (i.astype(np.uint32), (i >> np.uint64(32)).astype(np.uint32),
               np.full(i.shape, int(stream) & _MASK32, np.uint32), np.full(i.shape, offset & _MASK32, np.uint32))
    return philox4x32(counter, (seed & _MASK32, (seed >> 32) & _MASK32))[0]


def philox_uniform(seed: int, offset: int, stream: int, flat_indices: np.ndarray, bits: int = 24) -> np.ndarray:
    """u(i) = (word >> (32 - bits)) · 2^-bits in [0, 1) at each flat index, as float32 (exact); ``bits`` = 24
    is the module's u, fewer the uniform values of a narrower dtype."""
    word = philox_bits(seed, offset, stream, flat_indices)
    return ((word >> np.uint32(32 - bits)).astype(np.float32) * np.float32(2.0**-bits)).astype(np.float32)


def flat_indices(box: Box, shape: Sequence[int]) -> np.ndarray:
    """The flat row-major index in a tensor of ``shape`` of each element of ``box``, in the box's shape.

    >>> flat_indices(Box((1, 2), (3, 4)), (3, 5)).tolist()
    [[7, 8], [12, 13]]
    """
    out = np.zeros(box.shape, dtype=np.int64)
    stride = 1
    for d in reversed(range(len(shape))):
        along = np.arange(box.lower[d], box.upper[d], dtype=np.int64) * stride
        out += along.reshape((-1,) + (1,) * (len(shape) - 1 - d))
        stride *= int(shape[d])
    return out


def rng_words(rng: np.ndarray) -> tuple[int, int]:
    """(seed, offset) of a generator-state block."""
    a = np.asarray(rng).reshape(-1)
    return int(a[0]), int(a[1])


def keep_threshold(p: float) -> int:
    """⌈p·2^24⌉: u(i) >= p exactly when (word >> 8) >= this (and u(i) < p when it is below)."""
    return math.ceil(p * 2.0**24)  # p·2^24 is exact in float64: a power-of-two scaling


def dropout_scale(p: float) -> float:
    """1/(1 - p) in float64 (each executor rounds it once to the compute dtype)."""
    return 1.0 / (1.0 - p)


def _check_rng(kind: str, rng: TensorType) -> None:
    if rng.dtype != "int64" or rng.shape != (2,):
        raise GraphError(f"{kind} takes its generator state as an int64 tensor of shape [2] holding (seed, offset); "
                         f"got {rng.dtype} of shape {list(rng.shape)}. Declare it as g.input('rng', [2], 'int64') "
                         "and feed np.array([seed, offset]).")


def _check_stream(kind: str, stream: object) -> None:
    if isinstance(stream, bool) or not isinstance(stream, (int, np.integer)) or not 0 <= int(stream) < 2**32:
        raise GraphError(f"{kind} stream must be an integer in [0, 2**32) (it tells the random sites of a graph "
                         f"apart); got {stream!r}. Give each site its own small integer.")


def _rng_index(taken: Sequence[str]) -> str:
    """A name for the generator state's index that none of ``taken`` has."""
    name = "rng"
    while name in taken:
        name += "_"
    return name


@register
@dataclass(frozen=True, eq=True)
class DropoutOp(IndexedOp):
    """Train-mode dropout ``(x · keep) / (1 - p)``, keep(i) = [u(i) >= p] at x's flat index i.

    >>> from relational_tensors.core.types import TensorType as T
    >>> op = DropoutOp((T.zero((4, 6)), T.zero((2,), "int64")), 0.1, 3)
    >>> op.signature(), [s.name for s in op.shardable()]
    ('d0 d1, rng -> d0 d1', ['d0', 'd1'])
    """

    kind = "dropout"
    p: float = 0.5
    stream: int = 0

    def infer(self) -> TensorType:
        if len(self.input_types) != 2:
            raise GraphError(f"dropout takes x and rng; got {len(self.input_types)} tensors.")
        x, rng = self.input_types
        if x.dtype not in FLOAT_DTYPES:
            raise GraphError(f"dropout needs a floating x; got dtype {x.dtype} of shape {list(x.shape)}. Cast it "
                             "first (g.cast(x, 'float32')).")
        _check_rng(self.kind, rng)
        p = finite_number("dropout p", self.p)
        if not 0.0 <= p < 1.0:
            raise GraphError(f"dropout p must lie in [0, 1) (the share of elements zeroed); got p={self.p!r}. "
                             "Use a p below 1 (p = 1 would zero everything and divide by zero).")
        _check_stream(self.kind, self.stream)
        return x

    def dims_in(self) -> tuple[tuple[str | None, ...], ...]:
        names = self.input_types[0].names
        return (names, (_rng_index(names),))

    def dims_out(self) -> tuple[str | None, ...]:
        return self.input_types[0].names

    def unshardable(self) -> frozenset[str]:
        return frozenset({_rng_index(self.input_types[0].names)})  # the state is read whole by every block

    def params(self) -> dict[str, object]:
        return {"p": self.p, "stream": self.stream}

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        return (PHILOX_OPS + 2.0) * output.volume

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        x, rng = blocks
        seed, offset = rng_words(rng)
        u = philox_uniform(seed, offset, self.stream, flat_indices(f.output, self.output_type.shape))
        xc = self._compute(x)
        keep = (u.astype(np.float64) >= float(self.p)).astype(xc.dtype)
        with np.errstate(invalid="ignore", over="ignore"):  # inf · 0 is NaN and a huge x · s is inf, as in torch
            return self._result((xc * keep) * xc.dtype.type(dropout_scale(float(self.p))))

    def vjp(self, b: Builder, inputs: tuple[Any, ...], output: Any, cotangent: Any,
            wanted: tuple[bool, ...]) -> Grads:
        _, rng = inputs
        return (build(b, "dropout", (cotangent, rng), p=self.p, stream=self.stream), None)


@register
@dataclass(frozen=True, eq=True)
class RandomOp(IndexedOp):
    """A tensor of ``shape`` of uniform [0, 1) values or Bernoulli(p) 1.0/0.0 values, drawn per flat index.

    >>> from relational_tensors.core.types import TensorType as T
    >>> op = RandomOp((T.zero((2,), "int64"),), (5, 3), "bfloat16", 1, "bernoulli", 0.25)
    >>> op.signature(), str(op.output_type.dtype)
    ('rng -> d0 d1', 'bfloat16')
    """

    kind = "random"
    gradient = "its values depend on no floating input"
    shape: tuple[int, ...] = ()
    dtype: str = "float32"
    stream: int = 0
    distribution: str = "uniform"
    p: float = 0.5

    def infer(self) -> TensorType:
        if len(self.input_types) != 1:
            raise GraphError(f"random takes one tensor, rng; got {len(self.input_types)} tensors.")
        _check_rng(self.kind, self.input_types[0])
        if self.dtype not in FLOAT_DTYPES:
            raise GraphError(f"random makes floating tensors; got dtype={self.dtype!r}. Use one of "
                             f"{sorted(FLOAT_DTYPES)} (cast the result for another dtype).")
        if self.distribution not in DISTRIBUTIONS:
            raise GraphError(f"random distribution must be one of {list(DISTRIBUTIONS)}; got "
                             f"{self.distribution!r}.")
        p = finite_number("random p", self.p)
        if not 0.0 <= p <= 1.0:
            raise GraphError(f"random p (bernoulli's probability of 1) must lie in [0, 1]; got p={self.p!r}.")
        _check_stream(self.kind, self.stream)
        if not isinstance(self.shape, tuple):
            raise GraphError(f"random shape is a sequence of positive integers; got {self.shape!r}.")
        return TensorType.zero(self.shape, self.dtype)

    def dims_in(self) -> tuple[tuple[str | None, ...], ...]:
        return ((_rng_index(self.output_type.names),),)

    def dims_out(self) -> tuple[str | None, ...]:
        return self.output_type.names

    def unshardable(self) -> frozenset[str]:
        return frozenset({_rng_index(self.output_type.names)})

    def params(self) -> dict[str, object]:
        return {"shape": self.shape, "dtype": self.dtype, "stream": self.stream, "distribution": self.distribution,
                "p": self.p}

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        return (PHILOX_OPS + 1.0) * output.volume

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        seed, offset = rng_words(blocks[0])
        where = flat_indices(f.output, self.output_type.shape)
        dtype = numpy_dtype(self.output_type.dtype)
        if self.distribution == "uniform":
            u = philox_uniform(seed, offset, self.stream, where, UNIFORM_BITS[self.output_type.dtype])
            return u.astype(dtype)  # exact: the values have no more bits than the dtype holds
        u = philox_uniform(seed, offset, self.stream, where)
        return (u.astype(np.float64) < float(self.p)).astype(dtype)

