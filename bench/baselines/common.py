"""What every baseline shares: the process group, seeded tensors, balanced splits, gathers, timing.

One process per device.  On CUDA the group is NCCL and tensors are float16 by default; on CPU it is
gloo and float32 (the tests).  Every tensor is drawn from its own seeded generator on the rank's
device, so all ranks hold identical full tensors and keep only their slice; a single-process run with
the same seed sees the same numbers.

>>> parse_workload("8x1K"), parse_workload("128K"), parse_workload("2x32"), parse_workload("C")
(('block', (8, 1024)), ('block', (1, 131072)), ('block', (2, 32)), ('chain', 'C'))
>>> [split_range(10, 4, r) for r in range(4)]
[(0, 2), (2, 5), (5, 7), (7, 10)]
"""

from __future__ import annotations

import datetime as _dt
import os
import re
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from relational_tensors.graph.models import LLAMA3_8B

__all__ = ["BlockShape", "SHAPES", "Dist", "Prepared", "NotApplicable", "parse_workload", "split_range",
           "free_port", "split_sizes", "seeded", "init_dist", "gather_dim", "time_rounds", "WORKLOADS", "CHAIN_NAMES"]

# the paper's five token workloads and five chains (bench/gpu_block.py and relational_tensors.graph.models)
WORKLOADS: tuple[str, ...] = ("1K", "8K", "8x1K", "128x1K", "128K")
CHAIN_NAMES: tuple[str, ...] = ("A", "B", "C", "D", "E")


@dataclass(frozen=True)
class BlockShape:
    """The block's sizes: model width, query and key/value heads, FFN width, norm epsilon, RoPE base."""

    d_model: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    eps: float = 1e-5
    rope_base: float = 500000.0

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads or self.n_heads % self.n_kv_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(f"a block needs d_model % n_heads == 0, n_heads % n_kv_heads == 0 and an even head "
                             f"dim; got d_model={self.d_model}, n_heads={self.n_heads}, "
                             f"n_kv_heads={self.n_kv_heads}.")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


SHAPES: dict[str, BlockShape] = {
    "llama3-8b": BlockShape(**LLAMA3_8B),  # the paper's block
    "tiny": BlockShape(64, 8, 4, 128),            # the tests' block
}


class NotApplicable(Exception):
    """A strategy cannot split this workload over this many ranks; the message says why."""


@dataclass
class Prepared:
    """A strategy set up for one workload on this rank: ``step()`` runs one forward pass and returns this
    rank's part of the output; ``gather(part)`` returns the whole output on every rank."""

    step: Callable[[], torch.Tensor]
    gather: Callable[[torch.Tensor], torch.Tensor]
    note: str = ""


@dataclass
class Dist:
    """This process's place in the group: rank, world size, device, dtype and backend."""

    rank: int
    world: int
    device: torch.device
    dtype: torch.dtype
    backend: str

    @property
    def events(self) -> bool:
        """Whether rounds are timed with CUDA events (on a GPU) rather than the wall clock."""
        return self.device.type == "cuda"

    def barrier(self) -> None:
        if self.world > 1:
            if self.backend == "nccl":
                dist.barrier(device_ids=[self.device.index or 0])
            else:
                dist.barrier()

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place (returns it)."""
        if self.world > 1:
            dist.all_reduce(t)
        return t


def free_port() -> int:
    """A TCP port on this host that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_dist(device: str = "auto", dtype: str | None = None, rank: int | None = None,
              world: int | None = None) -> Dist:
    """Join (or start) the process group.  Rank and world come from the arguments, else from the
    ``torchrun`` environment, else this is a group of one.  ``device``: ``cuda`` (NCCL, float16 by
    default), ``cpu`` (gloo, float32 by default) or ``auto`` (CUDA when present)."""
    if rank is None or world is None:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", rank))
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device.")
    if use_cuda:
        torch.cuda.set_device(local)
        dev, backend = torch.device("cuda", local), "nccl"
    else:
        dev, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            if world > 1:
                raise RuntimeError("several ranks need MASTER_ADDR and MASTER_PORT (torchrun sets them).")
            os.environ["MASTER_PORT"] = str(free_port())
        kwargs: dict[str, Any] = {"timeout": _dt.timedelta(minutes=10)}
        if use_cuda:
            kwargs["device_id"] = dev
        dist.init_process_group(backend, rank=rank, world_size=world, **kwargs)
    dt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[
        dtype or ("float16" if use_cuda else "float32")]
    return Dist(rank, world, dev, dt, backend)


# --- workloads and splits ------------------------------------------------------------------------------

_TOKENS = re.compile(r"(?:(\d+)x)?(\d+)([Kk]?)")


def parse_workload(name: str) -> tuple[str, Any]:
    """``"A"``-``"E"``: a chain; ``"[B x]S[K]"``: a block on B sequences of S (times 1024 with K) tokens."""
    if name.upper() in CHAIN_NAMES:
        return "chain", name.upper()
    m = _TOKENS.fullmatch(name)
    if m is None:
        raise ValueError(f"a workload is a chain A-E or [batch x]tokens[K] such as 8x1K; got {name!r}.")
    batch = int(m.group(1) or 1)
    seq = int(m.group(2)) * (1024 if m.group(3) else 1)
    return "block", (batch, seq)


def split_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """Part ``index`` of ``range(n)`` cut into ``parts`` contiguous pieces whose sizes differ by at most one."""
    return n * index // parts, n * (index + 1) // parts


def split_sizes(n: int, parts: int) -> list[int]:
    return [hi - lo for lo, hi in (split_range(n, parts, r) for r in range(parts))]


# --- tensors -------------------------------------------------------------------------------------------

def seeded(shape: Sequence[int], seed: int, device: torch.device, dtype: torch.dtype, scale: float = 1.0,
           shift: float = 0.0) -> torch.Tensor:
    """``shift + scale * N(0, 1)`` of ``shape``, drawn in float32 from a generator seeded with ``seed`` on
    ``device`` (the same numbers on every rank of one device type), then cast to ``dtype``."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    t = torch.randn(tuple(shape), generator=gen, device=device, dtype=torch.float32)
    if scale != 1.0:
        t.mul_(scale)
    if shift != 0.0:
        t.add_(shift)
    return t.to(dtype)


_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_dim(ctx: Dist, part: torch.Tensor, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    """Concatenate every rank's ``part`` along ``dim`` (rank r contributes ``sizes[r]`` entries there).
    Uneven parts are padded to the largest for the collective and trimmed after."""
    if ctx.world == 1:
        return part
    if part.shape[dim] != sizes[ctx.rank]:
        raise ValueError(f"rank {ctx.rank} gathers {part.shape[dim]} entries along dim {dim}, but the split "
                         f"says {sizes[ctx.rank]} (sizes {list(sizes)}).")
    most = max(sizes)
    front = part.movedim(dim, 0)
    if front.shape[0] < most:
        pad = front.new_zeros((most - front.shape[0], *front.shape[1:]))
        front = torch.cat((front, pad))
    front = front.contiguous()
    out = front.new_empty((ctx.world * most, *front.shape[1:]))
    _gather_single(out, front)
    if all(s == most for s in sizes):
        whole = out
    else:
        whole = torch.cat([out[r * most: r * most + s] for r, s in enumerate(sizes)])
    return whole.movedim(0, dim)


# --- timing --------------------------------------------------------------------------------------------

def time_rounds(step: Callable[[], Any], ctx: Dist, warmups: int = 2, rounds: int = 10) -> list[float]:
    """Milliseconds of each timed round, the slowest rank's.  Ranks start each round together (a
    barrier); CUDA events around the step on GPU, ``perf_counter`` on CPU."""
    for _ in range(warmups):
        step()
    ctx.synchronize()
    times = []
    for _ in range(rounds):
        ctx.barrier()
        ctx.synchronize()
        if ctx.events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    slowest = torch.tensor(times, dtype=torch.float64, device=ctx.device)
    if ctx.world > 1:
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return [float(v) for v in slowest.cpu()]


def summary(times: Sequence[float]) -> dict[str, float]:
    return {"ms": statistics.mean(times), "ms_min": min(times),
            "ms_stdev": statistics.stdev(times) if len(times) > 1 else 0.0}
