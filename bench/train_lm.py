"""A real training run: a LLaMA-style language model trained on the Python standard library's own source
with ``rt.train_step``, and the same model, data and loop under ``torch.compile``, in one run.

The model is the user's own ``nn.Module`` (token embedding, pre-norm blocks of RMSNorm, causal
grouped-query attention with rotary positions through SDPA, and a SwiGLU MLP, a final RMSNorm and an
untied head), the tokenizer is byte-level (a token is a byte of UTF-8 text: 256 ids, nothing to train
or download), and the corpus is every ``.py`` file of the running Python's standard library, split into
a training and a held-out part.  Both runs start from the same weights and read the same batches (random
windows of ``seq + 1`` bytes, seeded); both use AdamW with the same hyperparameters.  Written out: the
loss of every step of both runs, tokens per second, step time (2 warm-up steps left out; CUDA events
on a GPU), peak device memory (torch's allocator peak, plus for ours the CuPy pool the program's memory
lives in), the held-out loss at the end, and a plot of the two loss curves (with
matplotlib installed: ``pip install 'relational_tensors[bench]'``).

    python bench/train_lm.py [--device cuda:0] [--steps 300] [--layers 4] [--d-model 256] [--heads 8]
                             [--kv-heads 2] [--seq 256] [--batch 16] [--out bench/results]
    python bench/train_lm.py --replot bench/results/train_lm.json   # the plot of a run, drawn again
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import subprocess
import sysconfig
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import relational_tensors as rt

VOCAB = 256  # bytes


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Block(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, ff: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dh = heads, kv_heads, d // heads
        self.attn_norm, self.ffn_norm = RMSNorm(d), RMSNorm(d)
        self.wq = nn.Linear(d, heads * self.dh, bias=False)
        self.wk = nn.Linear(d, kv_heads * self.dh, bias=False)
        self.wv = nn.Linear(d, kv_heads * self.dh, bias=False)
        self.wo = nn.Linear(heads * self.dh, d, bias=False)
        self.w1, self.w3 = nn.Linear(d, ff, bias=False), nn.Linear(d, ff, bias=False)
        self.w2 = nn.Linear(ff, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(b, s, self.heads, self.dh).transpose(1, 2)
        k = self.wk(h).view(b, s, self.kv_heads, self.dh).transpose(1, 2)
        v = self.wv(h).view(b, s, self.kv_heads, self.dh).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, s, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class LM(nn.Module):
    def __init__(self, layers: int, d: int, heads: int, kv_heads: int, seq: int, base: float = 10000.0) -> None:
        super().__init__()
        ff = 256 * math.ceil(8 * d / 3 / 256)
        self.embed = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(Block(d, heads, kv_heads, ff) for _ in range(layers))
        self.norm, self.head = RMSNorm(d), nn.Linear(d, VOCAB, bias=False)
        dh = d // heads
        freq = base ** (-torch.arange(0, dh, 2, dtype=torch.float64) / dh)
        angle = torch.arange(seq, dtype=torch.float64)[:, None] * freq[None, :]
        angle = torch.cat((angle, angle), dim=-1)
        self.register_buffer("cos", angle.cos().float(), persistent=False)
        self.register_buffer("sin", angle.sin().float(), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))


def lm_loss(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def corpus(limit_bytes: int | None = None) -> np.ndarray:
    """The standard library's Python source as bytes (sorted paths: the same corpus on every run)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if limit_bytes is not None and total >= limit_bytes:
            break
    return np.frombuffer(b"\n".join(chunks), dtype=np.uint8)


def batches(data: np.ndarray, batch: int, seq: int, steps: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        starts = rng.integers(0, len(data) - seq - 1, size=batch)
        windows = np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int64)
        out.append((windows[:, :-1], windows[:, 1:]))
    return out


def train(model: nn.Module, data: list[tuple[np.ndarray, np.ndarray]], device: str, ours: bool, lr: float,
          compile_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train ``model`` on ``data``: with ``rt.train_step`` on ``device`` (``ours``), else torch.compile on
    the device's torch device.  Returns the losses, step times (ms) and peak memory."""
    torch_device = "cuda" if device.startswith("cuda") else "cpu"
    on_gpu = torch_device == "cuda"
    to = lambda a: torch.from_numpy(a).to(torch_device)  # noqa: E731
    if ours:
        ids, targets = data[0]
        step = rt.train_step(model, lm_loss, (to(ids), to(targets)),
                             optimizer=rt.optim.AdamW(lr=lr, betas=(0.9, 0.95), weight_decay=0.1),
                             device=device, **(compile_options or {}))
        step.lr = lr

        def run(ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return step(ids, targets)
    else:
        model = model.to(torch_device)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
        loss_fn = torch.compile(lm_loss) if on_gpu else lm_loss

        def run(ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model, ids, targets)
            loss.backward()
            opt.step()
            return loss.detach()
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for ids, targets in data:
        x, y = to(ids), to(targets)
        if on_gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = run(x, y)
            end.record()
            losses.append(float(loss))  # reading the loss synchronizes
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            losses.append(float(run(x, y)))
            times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated() if on_gpu else None
    if on_gpu and ours:  # the program's arena and blocks live in CuPy's pool, which torch's counter does not see
        import cupy

        peak += cupy.get_default_memory_pool().total_bytes()
    return {"losses": losses, "ms": times, "peak_bytes": peak, "step": step if ours else None}


def plot(record: dict[str, Any], path: Path) -> None:
    """The two runs' loss curves of a result record, drawn to ``path`` (with matplotlib installed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'relational_tensors[bench]'); draw it later "
              f"with: python bench/train_lm.py --replot {path.with_suffix('.json')}")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in record["runs"].items():
        ax.plot(r["losses"], label=name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per byte)")
    ax.set_title(f"{record['machine'].split(',')[0]}, commit {record['commit']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--replot", metavar="JSON", help="draw the plot of a result file written earlier, and stop")
    a = ap.parse_args()
    if a.replot:
        plot(json.loads(Path(a.replot).read_text()), Path(a.replot).with_suffix(".png"))
        return
    text = corpus()
    cut = int(len(text) * 0.98)
    train_data = batches(text[:cut], a.batch, a.seq, a.steps, a.seed)
    held_out = batches(text[cut:], a.batch, a.seq, 8, a.seed + 1)
    torch.manual_seed(a.seed)
    ours_model = LM(a.layers, a.d_model, a.heads, a.kv_heads, a.seq)
    torch_model = LM(a.layers, a.d_model, a.heads, a.kv_heads, a.seq)
    torch_model.load_state_dict(ours_model.state_dict())
    runs = {"torch.compile": train(torch_model, train_data, a.device, ours=False, lr=a.lr),
            "rt.train_step": train(ours_model, train_data, a.device, ours=True, lr=a.lr)}
    runs["rt.train_step"].pop("step").load_into(ours_model)
    tokens = a.batch * a.seq
    rows = {}
    for name, run in runs.items():
        model = ours_model if name == "rt.train_step" else torch_model
        model = model.to("cuda" if a.device.startswith("cuda") else "cpu")
        with torch.no_grad():
            dev = next(model.parameters()).device
            held = float(np.mean([float(lm_loss(model, torch.from_numpy(i).to(dev), torch.from_numpy(t).to(dev)))
                                  for i, t in held_out]))
        timed = run["ms"][2:] or run["ms"]
        median = float(np.median(timed))
        rows[name] = {"step_ms_median": median, "tokens_per_s": tokens / median * 1e3, "peak_bytes": run["peak_bytes"],
                      "first_loss": run["losses"][0], "last_loss": run["losses"][-1], "held_out_loss": held,
                      "losses": run["losses"]}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    machine = torch.cuda.get_device_name(0) if a.device.startswith("cuda") else platform.processor() or "cpu"
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if k not in ("out", "replot"))
    record = {"command": "python bench/train_lm.py " + flags,
              "commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{machine}, {platform.node()}", "corpus_bytes": int(len(text)), "runs": rows}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_lm.json").write_text(json.dumps(record, indent=1) + "\n")
    table = ["| run | step (ms, median) | tokens/s | peak memory (GiB) | first loss | last loss | held-out loss |",
             "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        peak = f"{r['peak_bytes'] / 2**30:.2f}" if r["peak_bytes"] else "-"
        table.append(f"| {name} | {r['step_ms_median']:.2f} | {r['tokens_per_s']:,.0f} | {peak} | "
                     f"{r['first_loss']:.3f} | {r['last_loss']:.3f} | {r['held_out_loss']:.3f} |")
    (out / "train_lm.md").write_text(f"# {record['command']}\n\n{record['machine']}, commit {commit}, "
                                     f"{record['date']}\n\n" + "\n".join(table) + "\n")
    print("\n".join(table))
    plot(record, out / "train_lm.png")


if __name__ == "__main__":
    main()
