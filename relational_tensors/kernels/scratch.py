"""How much scratch the kernels that need some take, and the shape rules behind it, without Triton or
CuPy: the launchers give each such task its scratch from these, the GPU executor places it in the arena,
and the compiler counts it in a GPU plan's memory on any machine.

* chunked reductions (``triton_norms.row_reduce``): few long rows are reduced in chunks whose partials a
  second pass combines;
* a norm's weight gradient (``triton_norms_grad.norm_weight_grad``): per-row statistics, then one partial
  row per chunk of rows;
* the embedding gradient (``triton_embedding_grad``): the padded sort keys of the block's token ids;
* the experts' weight gradient (``triton_experts.grouped_weight_grad``): each expert's first and last row;
* attention's dk|dv pass on a small grid (``triton_attention_grad.attention_dkv``): float32 partials of
  each share of a group's query heads;
* the decode attention kernel (``triton_attention_decode``): each split of the keys' partial output and
  log-sum-exp.
"""

from __future__ import annotations

__all__ = ["reduce_chunks", "partial_dtype", "weight_grad_chunks", "weight_grad_scratch", "padded_tokens",
           "embedding_grad_scratch", "RUN_CHUNK", "grouped_weight_grad_scratch", "reduces_in_place", "MIDDLE_BLOCK",
           "dkv_splits", "dkv_scratch", "DECODE_ROWS", "DECODE_BLOCK_N", "decode_splits", "decode_scratch"]

SPLIT_ROWS = 264  # fewer output rows than this (two per SM of an H100/H200) leave the GPU mostly idle
SPLIT_LENGTH = 1 << 16  # rows at least this long are then reduced in chunks, partials combined after
CHUNK_MIN = 8192
PARTIAL_ROWS = 16   # rows per step of a norm weight gradient's chunk sum
MAX_CHUNKS = 128    # chunks of rows, so the partials stay small next to the block
# dk|dv programs (of 64 keys) that fill an H200 (132 SMs) twice over; fewer, and the query heads of a
# group are split among programs: a causal key tile's work falls with its index, so a grid of about one
# program per SM waits on its first tiles' programs while the rest of the GPU idles
FILL_PROGRAMS = 264


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


MIDDLE_BLOCK = 1024  # kept positions per program of a reduction over axes that are not last
MIDDLE_SHORT = 64  # a reduced extent up to this is walked in place whatever the grid


def reduces_in_place(outer: int, n: int, inner: int) -> bool:
    """Whether a reduction of contiguous ``[outer, n, inner]`` over ``n`` (``inner`` > 1: axes that are not
    last) reads the block where it lies, each program walking ``n`` for a block of ``inner`` positions,
    rather than a copy with the reduced axes moved last: where ``n`` is short, or the programs fill the GPU.

    >>> reduces_in_place(8192, 2, 4096), reduces_in_place(1, 8192, 4096), reduces_in_place(8, 100, 1)
    (True, False, False)
    """
    if inner <= 1 or not (outer and n):
        return False
    programs = outer * _cdiv(inner, min(MIDDLE_BLOCK, 1 << (inner - 1).bit_length()))
    return n <= MIDDLE_SHORT or programs >= SPLIT_ROWS


def reduce_chunks(rows: int, n: int) -> int:
    """How many chunks each row of a [rows, n] reduction is cut into (1: one program per row).  A full
    reduction of a large tensor (a loss's mean) in one program would read it at a single SM's bandwidth.

    >>> reduce_chunks(1, 1 << 20), reduce_chunks(4096, 1 << 20), reduce_chunks(1, 100)
    (128, 1, 1)
    """
    if rows >= SPLIT_ROWS or n < SPLIT_LENGTH:
        return 1
    return max(1, min(_cdiv(2 * SPLIT_ROWS, rows), n // CHUNK_MIN))


def partial_dtype(dtype: str) -> str:
    """The dtype of a chunked reduction's partials: float64 for float64, else float32."""
    return "float64" if dtype == "float64" else "float32"


def weight_grad_chunks(rows: int) -> int:
    """How many chunks of rows ``norm_weight_grad`` sums separately (a function of the block's shape only,
    so the order of the additions never changes)."""
    if rows <= 0:
        return 1
    per = _cdiv(_cdiv(rows, MAX_CHUNKS), PARTIAL_ROWS) * PARTIAL_ROWS
    return _cdiv(rows, per)


def weight_grad_scratch(rows: int, d: int) -> int:
    """Elements of compute-dtype scratch ``norm_weight_grad`` needs: (mean, r) per row and one partial row per
    chunk."""
    chunks = weight_grad_chunks(rows)
    return 2 * rows + (chunks * d if chunks > 1 else 0)


def padded_tokens(tokens: int) -> int:
    """The embedding gradient's sort length: the next power of two of the block's ids, at least 16."""
    n = max(tokens, 16)
    return 1 << (n - 1).bit_length()


RUN_CHUNK = 1024  # the embedding gradient sums a run of one id in pieces of at most this many sorted keys


def embedding_grad_scratch(tokens: int, width: int = 1) -> int:
    """8-byte elements of scratch ``embedding_grad`` needs for a block of ``tokens`` ids and ``width``
    columns: the padded keys, then two partial rows per ``RUN_CHUNK`` keys (a run's piece that starts at
    the chunk's first key, and one that starts inside the chunk and goes on past it)."""
    return padded_tokens(tokens) + 2 * -(-tokens // RUN_CHUNK) * width


def grouped_weight_grad_scratch(experts: int) -> int:
    """int64 elements of scratch ``grouped_weight_grad`` needs for a block of ``experts``: a span per expert."""
    return 2 * max(experts, 1)


def dkv_splits(nb: int, skv: int, hkv: int, group: int) -> int:
    """Among how many programs the dk|dv pass splits each group of ``group`` query heads: 1 where the
    (batch, kv head, 64-key tile) programs fill the GPU (``FILL_PROGRAMS``), else the fewest that do, a
    divisor of ``group`` (all of it at most).

    >>> dkv_splits(1, 8192, 8, 4), dkv_splits(1, 8192, 1, 4), dkv_splits(32, 1024, 1, 4), dkv_splits(1, 512, 1, 6)
    (1, 4, 1, 6)
    """
    programs = nb * hkv * _cdiv(skv, 64)
    if group <= 1 or programs >= FILL_PROGRAMS:
        return 1
    return next((n for n in range(2, group + 1) if group % n == 0 and programs * n >= FILL_PROGRAMS), group)


def dkv_scratch(nb: int, skv: int, hkv: int, group: int, width: int) -> int:
    """float32 elements of scratch the dk|dv pass of such blocks uses (0: it writes its output directly)."""
    splits = dkv_splits(nb, skv, hkv, group)
    return 0 if splits == 1 else splits * nb * skv * hkv * width


DECODE_ROWS = 64  # the most query rows (query heads of a kv group × query positions) one decode program holds
DECODE_PROGRAMS = 256  # programs a decode launch aims at: about two per streaming multiprocessor
DECODE_BLOCK_N = 64  # keys per split are a whole number of these
DECODE_MIN_KEYS = 256  # the fewest keys a split walks (fewer would make the merge cost more than it saves)


def decode_splits(nb: int, hkv: int, skv: int) -> tuple[int, int]:
    """(splits, keys per split) of the keys of a [nb, skv, hkv, d] block in the decode attention kernel:
    enough programs to fill the GPU, each split at least ``DECODE_MIN_KEYS`` keys, a whole number of tiles."""
    want = max(1, -(-DECODE_PROGRAMS // max(nb * hkv, 1)))
    splits = max(1, min(want, skv // DECODE_MIN_KEYS))
    per = -(-skv // splits)
    per = -(-per // DECODE_BLOCK_N) * DECODE_BLOCK_N
    return max(1, -(-skv // per)), per


def decode_scratch(nb: int, sq: int, hq: int, hkv: int, skv: int, dv: int) -> int:
    """float32 elements of scratch a decode attention launch needs: each split's partial output and
    log-sum-exp (none where one split writes the output itself)."""
    splits, _ = decode_splits(nb, hkv, skv)
    return 0 if splits == 1 else splits * nb * sq * hq * (dv + 1)
