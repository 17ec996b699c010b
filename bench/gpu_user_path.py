"""The user's path on one GPU: what a PyTorch user calls, beside the same program run through the graph
API, torch eager and torch.compile, in one run on one machine.

Workloads (bfloat16 parameters and activations, CUDA tensors in and out):

* ``block``: a hand-written LLaMA-style block (RMSNorm, GQA attention with rotary positions through SDPA,
  SwiGLU), at several shapes;
* ``llama``: transformers' ``LlamaForCausalLM`` (several layers, on the GPU), with and without a padded
  ``attention_mask`` (the last quarter of every other row is padding).

For each, forward and training (AdamW: ``torch.optim.AdamW`` on the bfloat16 parameters, moments in
bfloat16; ours is handed the same torch optimizer, as a user hands it, and runs the same math; with
``--master float32`` ours keeps float32 master weights and moments instead, which moves about twice
the optimizer's bytes):

* ``eager`` and ``torch.compile``: the module (training: forward, backward and ``torch.optim.AdamW``);
* ``graph``: ours, the compiled program's ``execute`` alone, its inputs already on the devices (the
  engine's time, what the user path is held to);
* ``parallelize`` / ``train_step``: ours through ``rt.parallelize`` (``pm(x)``) and ``rt.train_step``
  (``step(x, target)``), CUDA tensors in and out;
* ``backend``: ``torch.compile(model, backend="relational_tensors")``, training with torch's AdamW.

2 warm-ups and 10 timed rounds each, CUDA events, medians.  The result file records the command,
commit, date and machine.

    python bench/gpu_user_path.py [--workloads block,llama] [--modes eager,compile,graph,user,backend]
                                  [--no-train] [--no-forward] [--master float32]
                                  [--out bench/results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import relational_tensors as rt

BLOCK_SHAPES = {"block 1x4K": (1, 4096), "block 4x2K": (4, 2048)}
LLAMA_SHAPES = {"llama 4x1K": (4, 1024), "llama 4x1K padded": (4, 1024)}


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + self.eps).to(x.dtype) * self.weight


class Block(nn.Module):
    """A LLaMA-3-8B-shaped block, written as a user would."""

    def __init__(self, d: int = 4096, heads: int = 32, kv_heads: int = 8, ff: int = 14336, seq: int = 4096) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dh = heads, kv_heads, d // heads
        self.attn_norm, self.ffn_norm = RMSNorm(d), RMSNorm(d)
        self.wq, self.wk = nn.Linear(d, d, bias=False), nn.Linear(d, kv_heads * self.dh, bias=False)
        self.wv, self.wo = nn.Linear(d, kv_heads * self.dh, bias=False), nn.Linear(d, d, bias=False)
        self.w1, self.w3 = nn.Linear(d, ff, bias=False), nn.Linear(d, ff, bias=False)
        self.w2 = nn.Linear(ff, d, bias=False)
        freq = 500000.0 ** (-torch.arange(0, self.dh, 2, dtype=torch.float64) / self.dh)
        angle = torch.arange(seq, dtype=torch.float64)[:, None] * freq[None, :]
        self.register_buffer("cos", torch.cat((angle, angle), -1).cos().float(), persistent=False)
        self.register_buffer("sin", torch.cat((angle, angle), -1).sin().float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(b, s, self.heads, self.dh).transpose(1, 2)
        k = self.wk(h).view(b, s, self.kv_heads, self.dh).transpose(1, 2)
        v = self.wv(h).view(b, s, self.kv_heads, self.dh).transpose(1, 2)
        cos, sin = self.cos[:s].to(x.dtype), self.sin[:s].to(x.dtype)
        rot = lambda t: torch.cat((-t[..., self.dh // 2:], t[..., : self.dh // 2]), -1)  # noqa: E731
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, s, d))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def mse(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x).float(), target.float())


def lm_loss(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None, labels: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=mask).logits if mask is not None else model(input_ids=ids).logits
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def time_ms(fn: Callable[[], Any]) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def engine_ms(compiled: Any) -> float:
    """The compiled program's ``execute`` alone, its inputs already loaded: torch's stream waits for the
    engine's launch stream after each run, so the CUDA events bracket the engine's own work."""
    launch = torch.cuda.ExternalStream(compiled.executor.launch_stream.ptr)

    def run() -> None:
        compiled.execute()
        torch.cuda.current_stream().wait_stream(launch)
    return time_ms(run)


def workload(name: str, seed: int = 0) -> tuple[Callable[[], nn.Module], tuple, Callable, tuple]:
    """A factory of the module (same weights every call), its forward inputs, its loss and the loss's batch."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    if name.startswith("block"):
        b, s = BLOCK_SHAPES[name]

        def make() -> nn.Module:
            torch.manual_seed(seed)
            return Block(seq=s).to("cuda", torch.bfloat16)
        x = torch.randn(b, s, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
        return make, (x,), mse, (x, torch.randn_like(x))
    from transformers import LlamaConfig, LlamaForCausalLM

    b, s = LLAMA_SHAPES[name]
    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=s,
                         attn_implementation="sdpa")

    def make_llama() -> nn.Module:
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).to("cuda", torch.bfloat16)
    ids = torch.randint(0, 32000, (b, s), device="cuda", generator=g)
    mask = None
    if name.endswith("padded"):
        mask = torch.ones(b, s, dtype=torch.long, device="cuda")
        mask[::2, s - s // 4:] = 0
    labels = torch.randint(0, 32000, (b, s), device="cuda", generator=g)
    if mask is None:  # the loss takes only the tensors there are, as a user would write it
        return make_llama, (ids, mask), lambda m, i, y: lm_loss(m, i, None, y), (ids, labels)
    return make_llama, (ids, mask), lm_loss, (ids, mask, labels)


def forward_rows(name: str, modes: list[str]) -> dict[str, float | str]:
    make, inputs, _, _ = workload(name)
    model = make().eval()
    args = tuple(x for x in inputs if x is not None)
    call = (lambda m: m(*args)) if name.startswith("block") else \
        (lambda m: m(input_ids=inputs[0], attention_mask=inputs[1]))
    out: dict[str, float | str] = {}
    with torch.no_grad():
        for mode in modes:
            try:
                if mode == "eager":
                    out[mode] = time_ms(lambda: call(model))
                elif mode == "compile":
                    compiled = torch.compile(model)
                    out[mode] = time_ms(lambda c=compiled: call(c))
                elif mode in ("graph", "user"):
                    example = args if name.startswith("block") else \
                        {"input_ids": inputs[0], **({"attention_mask": inputs[1]} if inputs[1] is not None else {})}
                    pm = rt.parallelize(model, example, device="cuda:0")
                    if mode == "user":
                        out["parallelize"] = time_ms(lambda p=pm: call(p))
                    else:
                        call(pm)  # inputs and weights loaded
                        out[mode] = engine_ms(pm.compiled)
                elif mode == "backend":
                    torch._dynamo.reset()
                    compiled = torch.compile(model, backend=rt.dynamo_backend, options={"device": "cuda:0"},
                                             dynamic=False)
                    out[mode] = time_ms(lambda c=compiled: call(c))
            except Exception as e:  # recorded, not hidden: the table shows what failed
                out[mode] = f"{type(e).__name__}: {str(e)[:200]}"
                traceback.print_exc()
    return out


MASTER: str | None = None  # --master: ours with master weights and moments in this dtype


def optimizer(model: nn.Module) -> Any:
    """Ours: the user's own ``torch.optim.AdamW`` on the module (read by ``rt.train_step``: the same math as
    torch's side, moments in the parameters' dtype), or with ``--master`` ``rt.optim.AdamW`` keeping float32
    master weights and moments (more bytes per step than torch's side moves)."""
    if MASTER:
        return rt.optim.AdamW(lr=1e-5, master_dtype=MASTER)
    return torch.optim.AdamW(model.parameters(), lr=1e-5)


def train_rows(name: str, modes: list[str]) -> dict[str, float | str]:
    make, _, loss_fn, batch = workload(name)
    out: dict[str, float | str] = {}
    for mode in modes:
        try:
            model = make().train()
            if mode in ("eager", "compile", "backend"):
                opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
                if MASTER:  # torch keeps no float32 masters: the comparison's optimizer math differs
                    print("note: torch's AdamW updates the bfloat16 parameters in place; ours keeps float32 masters")
                if mode == "compile":
                    fn = torch.compile(loss_fn)
                elif mode == "backend":
                    torch._dynamo.reset()
                    fn = torch.compile(loss_fn, backend=rt.dynamo_backend, options={"device": "cuda:0"},
                                       dynamic=False)
                else:
                    fn = loss_fn

                def step(model: nn.Module = model, opt: Any = opt, fn: Any = fn) -> None:
                    opt.zero_grad(set_to_none=True)
                    fn(model, *batch).backward()
                    opt.step()
                out[mode] = time_ms(step)
            elif mode in ("graph", "user"):
                st = rt.train_step(model, loss_fn, batch, optimizer=optimizer(model), device="cuda:0")
                if mode == "user":
                    out["train_step"] = time_ms(lambda s=st: s(*batch))
                else:
                    st(*batch)  # batch and states loaded
                    out[mode] = engine_ms(st.compiled)
        except Exception as e:
            out[mode] = f"{type(e).__name__}: {str(e)[:200]}"
            traceback.print_exc()
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=",".join([*BLOCK_SHAPES, *LLAMA_SHAPES]))
    ap.add_argument("--modes", default="eager,compile,graph,user,backend")
    ap.add_argument("--no-forward", action="store_true")
    ap.add_argument("--no-train", action="store_true")
    ap.add_argument("--master", default=None, help="ours keeps master weights and moments in this dtype "
                    "(float32); by default ours runs the user's torch.optim.AdamW, as torch's side does")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    global MASTER
    MASTER = a.master
    modes = a.modes.split(",")
    rows: dict[str, dict[str, Any]] = {}
    for name in a.workloads.split(","):
        if not a.no_forward:
            rows[f"{name} forward"] = forward_rows(name, modes)
            print(name, "forward", rows[f"{name} forward"], flush=True)
            write(a, rows)
        if not a.no_train:
            rows[f"{name} training"] = train_rows(name, modes)
            print(name, "training", rows[f"{name} training"], flush=True)
            write(a, rows)
    print((Path(a.out) / "gpu_user_path.md").read_text())


def write(a: argparse.Namespace, rows: dict[str, dict[str, Any]]) -> None:
    """The result file and its table, rewritten after every row (a run cut short keeps what it measured)."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = {"command": "python bench/gpu_user_path.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if k != "out" and v not in (False, None)),
        "commit": commit or "unknown",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{torch.cuda.get_device_name(0)}, {platform.node()}", "ms": rows}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_user_path.json").write_text(json.dumps(record, indent=1) + "\n")
    columns = ["eager", "compile", "graph", "parallelize", "train_step", "backend"]
    lines = [f"# {record['command']}", "", f"{record['machine']}, commit {record['commit']}, {record['date']}", "",
             "| workload | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for key, r in rows.items():
        cells = [f"{r[c]:.2f}" if isinstance(r.get(c), float) else ("failed" if c in r else "") for c in columns]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    (out / "gpu_user_path.md").write_text("\n".join(lines) + "\n")

if __name__ == "__main__":
    main()
