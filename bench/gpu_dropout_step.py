"""A train-mode transformer block with dropout, trained on one GPU: torch eager, torch.compile and
``rt.train_step``, side by side in one run (2 warm-ups and 10 timed rounds each, CUDA events).

The block is pre-norm attention (SDPA with ``dropout_p``) and an MLP with ``nn.Dropout`` after each
sublayer, float32, AdamW.  Ours is the user's path: the module, CUDA tensors in, ``rt.train_step``
with ``device="cuda:0"``.  Before timing, the masks agree with torch's only in distribution (the two
generators differ), so the check is that every parameter changes in both after a step.

    python bench/gpu_dropout_step.py [--batch 8] [--seq 512] [--d-model 512] [--heads 8] [--out bench/results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import relational_tensors as rt


class Block(nn.Module):
    def __init__(self, d: int, heads: int, p: float) -> None:
        super().__init__()
        self.heads, self.p = heads, p
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           dropout_p=self.p, is_causal=True)
        x = x + self.drop(self.out(a.transpose(1, 2).reshape(b, s, d)))
        return x + self.drop(self.down(F.gelu(self.up(self.norm2(x)))))


def loss_fn(m: nn.Module, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(m(x), t)


def time_ms(fn: Any, warmup: int = 2, rounds: int = 10) -> list[float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    torch.manual_seed(0)
    x = torch.randn(a.batch, a.seq, a.d_model, device="cuda")
    t = torch.randn_like(x)
    results: dict[str, Any] = {}

    def torch_step(model: nn.Module, step_fn: Any) -> Any:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def run() -> None:
            opt.zero_grad(set_to_none=True)
            step_fn(model, x, t).backward()
            opt.step()
        return run

    eager = Block(a.d_model, a.heads, a.p).cuda().train()
    results["torch eager"] = time_ms(torch_step(eager, loss_fn))
    compiled = Block(a.d_model, a.heads, a.p).cuda().train()
    results["torch.compile"] = time_ms(torch_step(compiled, torch.compile(loss_fn)))

    ours = Block(a.d_model, a.heads, a.p).train()
    before = {k: v.detach().clone() for k, v in ours.named_parameters()}
    step = rt.train_step(ours, loss_fn, (x.cpu(), t.cpu()), optimizer=rt.optim.AdamW(lr=1e-4), device="cuda:0")
    step(x, t)
    after = step.state_dict()["params"]
    unchanged = [k for k, v in before.items() if k not in after or torch.equal(torch.as_tensor(after[k]).cpu(), v)]
    results["rt.train_step"] = time_ms(lambda: step(x, t))

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = {"command": "python bench/gpu_dropout_step.py " + " ".join(f"--{k.replace('_', '-')} {v}"
                                                                        for k, v in vars(a).items() if k != "out"),
              "commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{torch.cuda.get_device_name(0)}, {platform.node()}",
              "shape": vars(a), "parameters_not_trained_by_ours": unchanged,
              "ms": {k: {"median": statistics.median(v), "rounds": v} for k, v in results.items()}}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, "gpu_dropout_step.json").write_text(json.dumps(record, indent=1))
    for k, v in results.items():
        print(f"{k:16s} {statistics.median(v):8.2f} ms")
    print("not trained:", unchanged)


if __name__ == "__main__":
    main()
