"""Every operator on the GPU, as a user meets it: layers and whole models that step off the LLaMA block's
path, forward and training, against torch eager and torch.compile, in one run on one GPU.

Rows (bfloat16 on the GPU; float32 in ``--smoke``):

* **operators**: one module per operator family a model reaches (convolution, transposed convolution,
  max/avg/adaptive pooling, batch norm in training mode, group norm, layer norm, an embedding, attention
  with a boolean mask, with an additive bias, with a sliding window, softmax, cross-entropy, GELU,
  comparisons and ``where``, padding), at a realistic shape;
* **models**: transformers' ``LlamaForCausalLM`` on a padded batch, a T5 encoder layer (relative position
  bias), a Gemma 2 decoder layer (sliding window, logit softcapping), a ResNet-50 (bottleneck blocks,
  batch norm), a ViT-B/16 (transformers' ``ViTModel``) and a U-Net-style block (convolutions, group norm,
  a transposed convolution);
* **ResNet-50's convolutions**: each distinct conv layer shape of the network, forward, ours against
  ``F.conv2d`` (cuDNN) on the same input.

Each row: eager, ``torch.compile`` (static shapes, ``dynamic=False``) and ours (``rt.parallelize`` forward
under ``no_grad``; ``rt.train_step`` with the user's own ``torch.optim.AdamW`` for training, the loss
``mean(out²)``), in milliseconds (2 warm-ups and 10 timed rounds, CUDA events, medians), ours over
torch.compile, and whether our program ran as one CUDA graph (``captured``: its executor holds a graph and
no task left it). A row that fails records its error. The result file records the command, commit, date and
machine.
``--profile-slow R`` profiles ours (``gpu_user_profile.profile``: host time per call, GPU busy and idle
time, the kernel families that took it) wherever ours is over ``R`` times torch.compile, forward or
training, and keeps the profile in the JSON file (``profile`` / ``train profile``), so one run says
where a slow row's time goes.

    python bench/gpu_coverage.py [--rows operators,models,convs] [--only "PART;..."] [--no-train]
                                 [--profile-slow 1.5] [--out bench/results]
    python bench/gpu_coverage.py --smoke    # tiny shapes on cpu:2, wall clock: the script's check
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from gpu_moe import time_ms  # CUDA events on a GPU, wall clock on the host; 2 + 10 rounds
from torch import nn

import relational_tensors as rt

Factory = Callable[[bool], tuple[nn.Module, tuple[torch.Tensor, ...]]]  # smoke -> (module, inputs)


# --- operators ----------------------------------------------------------------------------------------------

class Attend(nn.Module):
    """SDPA with a mask form: ``bool`` (a random boolean mask), ``bias`` (an additive float bias) or
    ``window`` (causal with a sliding window, as a boolean mask)."""

    def __init__(self, form: str, heads: int, seq: int, dim: int) -> None:
        super().__init__()
        self.form, self.heads = form, heads
        self.proj = nn.Linear(dim, 3 * dim, bias=False)
        g = torch.Generator().manual_seed(0)
        if form == "bool":
            self.register_buffer("mask", torch.rand(seq, seq, generator=g) < 0.8)
        elif form == "bias":
            self.register_buffer("mask", torch.randn(heads, seq, seq, generator=g) * 0.1)
        else:
            i = torch.arange(seq)
            self.register_buffer("mask", (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < seq // 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.proj(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        mask = self.mask.to(q.dtype) if self.form == "bias" else self.mask
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, s, d)


class Lambda(nn.Module):
    """``fn(self, *inputs)`` with the floating first input scaled by a trained scalar, so that a training
    step of an operator without weights differentiates through it."""

    def __init__(self, fn: Callable[..., torch.Tensor], *modules: nn.Module) -> None:
        super().__init__()
        self.fn, self.inner = fn, nn.ModuleList(modules)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        if xs[0].is_floating_point():
            xs = (xs[0] * self.scale, *xs[1:])
        return self.fn(self, *xs)


def _image(smoke: bool, c: int = 64, hw: int = 56, b: int = 32) -> torch.Tensor:
    return torch.randn(2, 4, 8, 8) if smoke else torch.randn(b, c, hw, hw)


def operators() -> dict[str, Factory]:
    def conv(s: bool) -> Any:
        return nn.Conv2d(*((4, 8) if s else (64, 128)), 3, padding=1), (_image(s),)

    def conv_t(s: bool) -> Any:
        return nn.ConvTranspose2d(*((4, 8) if s else (64, 64)), 2, stride=2), (_image(s),)

    def pools(s: bool) -> Any:
        m = Lambda(lambda self, x: F.max_pool2d(x, 3, 2, 1) + F.avg_pool2d(x, 3, 2, 1)
                   + F.adaptive_avg_pool2d(x, (x.shape[-2] + 1) // 2))
        return m, (_image(s),)

    def batch_norm(s: bool) -> Any:
        return nn.BatchNorm2d(4 if s else 64), (_image(s),)

    def group_norm(s: bool) -> Any:
        return nn.GroupNorm(2 if s else 32, 4 if s else 64), (_image(s),)

    def layer_norm(s: bool) -> Any:
        return nn.LayerNorm(16 if s else 4096), (torch.randn(2, 8, 16) if s else torch.randn(4, 2048, 4096),)

    def embedding(s: bool) -> Any:
        m = Lambda(lambda self, ids: self.inner[0](ids).square(), nn.Embedding(50 if s else 128256, 16 if s else 4096))
        return m, (torch.randint(0, 50 if s else 128256, (2, 8) if s else (4, 2048)),)

    def attention(form: str) -> Factory:
        def make(s: bool) -> Any:
            heads, seq, dim = (2, 16, 16) if s else (16, 2048, 2048)
            return Attend(form, heads, seq, dim), (torch.randn(2 if s else 4, seq, dim),)
        return make

    def softmax_xent(s: bool) -> Any:
        m = Lambda(lambda self, x: F.cross_entropy(self.inner[0](x).float().flatten(0, 1),
                                                   torch.zeros(x.shape[0] * x.shape[1], dtype=torch.long,
                                                               device=x.device)) + self.inner[0](x).softmax(-1).sum(),
                   nn.Linear(16 if s else 2048, 40 if s else 32000, bias=False))
        return m, (torch.randn(2, 8, 16) if s else torch.randn(4, 1024, 2048),)

    def gelu_where_pad(s: bool) -> Any:
        m = Lambda(lambda self, x: F.pad(torch.where(x > 0, F.gelu(x), x * 0.1), (1, 1)))
        return m, (torch.randn(2, 8, 16) if s else torch.randn(4, 2048, 4096),)

    return {"conv 3x3": conv, "conv_transpose 2x2/2": conv_t, "max+avg+adaptive pool": pools,
            "batch norm (train)": batch_norm, "group norm": group_norm, "layer norm": layer_norm,
            "embedding": embedding, "attention, boolean mask": attention("bool"),
            "attention, additive bias": attention("bias"), "attention, sliding window": attention("window"),
            "softmax + cross-entropy": softmax_xent, "gelu, compare, where, pad": gelu_where_pad}


# --- models -------------------------------------------------------------------------------------------------

class Bottleneck(nn.Module):
    def __init__(self, cin: int, mid: int, stride: int) -> None:
        super().__init__()
        cout = 4 * mid
        self.body = nn.Sequential(nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(),
                                  nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(),
                                  nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)) \
            if stride != 1 or cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.skip(x))


def resnet50(width: int = 64, blocks: tuple[int, ...] = (3, 4, 6, 3), classes: int = 1000) -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                               nn.MaxPool2d(3, 2, 1)]
    cin = width
    for i, n in enumerate(blocks):
        mid = width * 2**i
        for j in range(n):
            layers.append(Bottleneck(cin, mid, 2 if j == 0 and i > 0 else 1))
            cin = 4 * mid
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


class UNetBlock(nn.Module):
    def __init__(self, c: int, groups: int) -> None:
        super().__init__()
        self.down = nn.Sequential(nn.Conv2d(c, 2 * c, 3, 2, 1), nn.GroupNorm(groups, 2 * c), nn.SiLU())
        self.mid = nn.Sequential(nn.Conv2d(2 * c, 2 * c, 3, 1, 1), nn.GroupNorm(groups, 2 * c), nn.SiLU())
        self.up = nn.ConvTranspose2d(2 * c, c, 2, 2)
        self.out = nn.Sequential(nn.GroupNorm(groups, c), nn.SiLU(), nn.Conv2d(c, c, 3, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.up(self.mid(self.down(x))) + x)


class HFLogits(nn.Module):
    """A transformers model called with keywords, returning its main tensor."""

    def __init__(self, model: nn.Module, key: str) -> None:
        super().__init__()
        self.model, self.key = model, key

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        out = self.model(**dict(zip(self.names, xs)))
        return out[self.key] if isinstance(out, dict) or hasattr(out, self.key) else out[0]


def models() -> dict[str, Factory]:
    import transformers as tf

    def llama(s: bool) -> Any:
        cfg = tf.LlamaConfig(vocab_size=64 if s else 32000, hidden_size=32 if s else 2048,
                             intermediate_size=64 if s else 5632, num_hidden_layers=2 if s else 4,
                             num_attention_heads=4 if s else 16, num_key_value_heads=2 if s else 4,
                             max_position_embeddings=1024, attn_implementation="sdpa", use_cache=False)
        b, n = (2, 16) if s else (4, 1024)
        ids = torch.randint(0, cfg.vocab_size, (b, n))
        mask = torch.ones(b, n, dtype=torch.long)
        mask[::2, n - n // 4:] = 0
        m = HFLogits(tf.LlamaForCausalLM(cfg), "logits")
        m.names = ("input_ids", "attention_mask")
        return m, (ids, mask)

    def t5(s: bool) -> Any:
        from transformers.models.t5.modeling_t5 import T5Block

        cfg = tf.T5Config(d_model=32 if s else 1024, d_kv=8 if s else 64, d_ff=64 if s else 4096,
                          num_heads=4 if s else 16, relative_attention_num_buckets=32, dropout_rate=0.0)
        block = T5Block(cfg, has_relative_attention_bias=True)
        m = Lambda(lambda self, x: self.inner[0](x)[0], block)
        return m, (torch.randn(2, 16, 32) if s else torch.randn(4, 1024, 1024),)

    def gemma2(s: bool) -> Any:
        cfg = tf.Gemma2Config(vocab_size=64 if s else 32000, hidden_size=32 if s else 2304,
                              intermediate_size=64 if s else 9216, num_hidden_layers=2,
                              num_attention_heads=4 if s else 8, num_key_value_heads=2 if s else 4,
                              head_dim=8 if s else 256, sliding_window=8 if s else 1024,
                              attn_implementation="eager", use_cache=False)
        b, n = (2, 16) if s else (2, 2048)
        m = HFLogits(tf.Gemma2ForCausalLM(cfg), "logits")
        m.names = ("input_ids",)
        return m, (torch.randint(0, cfg.vocab_size, (b, n)),)

    def resnet(s: bool) -> Any:
        m = resnet50(8, (1, 1, 1, 1), 10) if s else resnet50()
        return m, (torch.randn(2, 3, 32, 32) if s else torch.randn(64, 3, 224, 224),)

    def vit(s: bool) -> Any:
        cfg = tf.ViTConfig(hidden_size=32 if s else 768, num_hidden_layers=2 if s else 12,
                           num_attention_heads=4 if s else 12, intermediate_size=64 if s else 3072,
                           image_size=32 if s else 224, patch_size=16, attn_implementation="sdpa")
        m = HFLogits(tf.ViTModel(cfg, add_pooling_layer=False), "last_hidden_state")
        m.names = ("pixel_values",)
        return m, (torch.randn(2, 3, 32, 32) if s else torch.randn(64, 3, 224, 224),)

    def unet(s: bool) -> Any:
        return UNetBlock(8 if s else 128, 4 if s else 32), (torch.randn(2, 8, 16, 16) if s else
                                                            torch.randn(16, 128, 64, 64),)

    return {"transformers Llama, padded 4x1K": llama, "T5 encoder layer (relative bias)": t5,
            "Gemma 2 (window, softcapping)": gemma2, "ResNet-50": resnet, "ViT-B/16": vit, "U-Net block": unet}


def resnet_convs(smoke: bool) -> dict[str, Factory]:
    """Each distinct conv shape of ResNet-50 (forward, bfloat16, batch 64 at 224x224)."""
    net = resnet50(8, (1, 1, 1, 1), 10) if smoke else resnet50()
    shapes: dict[str, tuple[nn.Conv2d, tuple[int, ...]]] = {}
    def seen(m: nn.Conv2d, i: tuple[torch.Tensor, ...], o: torch.Tensor) -> None:
        name = f"{m.in_channels}->{m.out_channels} k{m.kernel_size[0]} s{m.stride[0]} @{i[0].shape[-1]}"
        shapes.setdefault(name, (m, tuple(i[0].shape)))
    hooks = [m.register_forward_hook(seen) for m in net.modules() if isinstance(m, nn.Conv2d)]
    with torch.no_grad():  # in eval mode: batch norm of one image at 1x1 has no batch statistics
        net.eval()(torch.randn(1, 3, 32 if smoke else 224, 32 if smoke else 224))
    for h in hooks:
        h.remove()
    batch = 2 if smoke else 64
    return {name: (lambda s, m=m, shape=shape: (m, (torch.randn(batch, *shape[1:]),)))
            for name, (m, shape) in shapes.items()}


# --- timing -------------------------------------------------------------------------------------------------

def captured(program: Any) -> bool | None:
    """Whether ``program`` (a CompiledGraph) ran as one CUDA graph (None on CPU devices)."""
    ex = getattr(program, "executor", None)
    if ex is None or not hasattr(ex, "graph_exec"):
        return None
    return bool(ex.graph_exec is not None)


def program_alone(compiled: Any) -> None:
    """Run the planned program on the inputs already in place; on a GPU, torch's current stream then waits
    for the executor's launch stream, so CUDA events on torch's stream time the program's kernels."""
    compiled.execute()
    ex = getattr(compiled, "executor", None)
    if ex is not None and hasattr(ex, "launch_stream"):
        from relational_tensors.api.device_io import launch_stream

        torch.cuda.current_stream().wait_stream(launch_stream(compiled))


PROFILE_SLOW: float | None = None  # --profile-slow


def _profile_if_slow(out: dict[str, Any], ours: str, theirs: str, fn: Callable[[], Any], key: str) -> None:
    """Where ours is over PROFILE_SLOW times torch.compile (or cuDNN), where its time goes (``key``)."""
    a, b = out.get(ours), out.get(theirs)
    if PROFILE_SLOW is None or not isinstance(a, float) or not isinstance(b, float) or a <= PROFILE_SLOW * b:
        return
    from gpu_user_profile import profile

    try:
        out[key] = profile(fn)
    except Exception as e:  # recorded, not hidden
        out[key] = f"{type(e).__name__}: {str(e)[:200]}"


def row(make: Factory, smoke: bool, train: bool, cudnn_only: bool = False) -> dict[str, Any]:
    cuda = not smoke
    device, dtype = ("cpu:2", torch.float32) if smoke else ("cuda:0", torch.bfloat16)
    where = "cpu" if smoke else "cuda"
    out: dict[str, Any] = {}
    module, inputs = make(smoke)
    module = module.to(where, dtype if not smoke else torch.float32)
    inputs = tuple(x.to(where, dtype) if x.is_floating_point() else x.to(where) for x in inputs)
    with torch.no_grad():
        module.eval()
        out["eager"] = time_ms(lambda: module(*inputs), cuda)
        if cudnn_only:  # a single convolution: eager is cuDNN's
            pm = rt.parallelize(module, inputs, device=device)
            out["ours"] = time_ms(lambda: pm(*inputs), cuda)
            out["captured"] = captured(pm.compiled)
            # the planned program alone, inputs in place: the kernels' time without the call's own cost
            out["program"] = time_ms(lambda: program_alone(pm.compiled), cuda)
            if cuda:
                _profile_if_slow(out, "ours", "eager", lambda: pm(*inputs), "profile")
            return out
        # static shapes: a network whose blocks see several sizes (ResNet-50) otherwise recompiles them with
        # symbolic shapes, still compiling after 4 minutes on an H100 host
        compiled = torch.compile(module, dynamic=False)
        out["compile"] = time_ms(lambda: compiled(*inputs), cuda)
        pm = rt.parallelize(module, inputs, device=device)
        out["ours"] = time_ms(lambda: pm(*inputs), cuda)
        out["captured"] = captured(pm.compiled)
        if cuda:
            _profile_if_slow(out, "ours", "compile", lambda: pm(*inputs), "profile")
    if train:
        module.train()
        floats = [p for p in module.parameters() if p.requires_grad]

        def loss_fn(m: nn.Module, *xs: torch.Tensor) -> torch.Tensor:
            return m(*xs).float().square().mean()
        opt = torch.optim.AdamW(floats, lr=1e-5)
        compiled_loss = torch.compile(loss_fn, dynamic=False)

        def torch_step(fn: Callable[..., torch.Tensor]) -> Callable[[], None]:
            def step() -> None:
                opt.zero_grad(set_to_none=True)
                fn(module, *inputs).backward()
                opt.step()
            return step
        out["train eager"] = time_ms(torch_step(loss_fn), cuda)
        out["train compile"] = time_ms(torch_step(compiled_loss), cuda)
        st = rt.train_step(module, loss_fn, inputs, optimizer=torch.optim.AdamW(floats, lr=1e-5), device=device)
        out["train ours"] = time_ms(lambda: st(*inputs), cuda)
        out["train captured"] = captured(st.compiled)
        if cuda:
            _profile_if_slow(out, "train ours", "train compile", lambda: st(*inputs), "train profile")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="operators,models,convs")
    ap.add_argument("--only", default="", help="';'-separated parts of row names to run (default: all)")
    ap.add_argument("--no-train", action="store_true")
    ap.add_argument("--profile-slow", type=float, default=None,
                    help="profile ours where it is over this many times torch.compile (or cuDNN)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    global PROFILE_SLOW
    PROFILE_SLOW = a.profile_slow
    only = [n.strip() for n in a.only.split(";") if n.strip()]
    makers = {"operators": operators, "models": models, "convs": lambda: resnet_convs(a.smoke)}
    results: dict[str, dict[str, Any]] = {}
    for group in a.rows.split(","):
        for name, make in makers[group]().items():
            if only and not any(part in name for part in only):
                continue
            key = f"{group}: {name}"
            torch.manual_seed(0)
            try:
                results[key] = row(make, a.smoke, train=not a.no_train and group != "convs",
                                   cudnn_only=group == "convs")
            except Exception as e:  # recorded, not hidden: the table shows what failed
                results[key] = {"failed": f"{type(e).__name__}: {str(e)[:300]}"}
                traceback.print_exc()
            print(key, results[key], flush=True)
            write(a, results)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def write(a: argparse.Namespace, results: dict[str, dict[str, Any]]) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    machine = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not a.smoke else "cpu (smoke)"
    record = {"command": "python bench/gpu_coverage.py " + " ".join(
        f"--{k.replace('_', '-')} {v!r}" for k, v in vars(a).items() if k != "out" and v not in (False, None, "")),
        "commit": commit or "unknown",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{machine}, {platform.node()}", "ms": results}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "gpu_coverage_smoke" if a.smoke else "gpu_coverage"
    (out / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")

    def cell(r: dict[str, Any], k: str) -> str:
        v = r.get(k)
        return f"{v:.2f}" if isinstance(v, float) else ("" if v is None else str(v))

    def ratio(r: dict[str, Any], a_: str, b: str) -> str:
        x, y = r.get(a_), r.get(b)
        return f"{x / y:.2f}" if isinstance(x, float) and isinstance(y, float) and y > 0 else ""
    cols = ["eager", "compile", "ours", "captured", "train eager", "train compile", "train ours", "train captured",
            "program"]
    lines = [f"# {record['command']}", "", f"{record['machine']}, commit {record['commit']}, {record['date']}", "",
             "ms per call (medians of 10 after 2 warm-ups); convs: eager is cuDNN's `F.conv2d`, program the "
             "planned program alone (its CUDA graph, inputs in place)", "",
             "| row | " + " | ".join(cols) + " | ours / compile | train ours / compile | ours / cuDNN "
             "| program / cuDNN |",
             "|---" * (len(cols) + 5) + "|"]
    for key, r in results.items():
        if "failed" in r:
            lines.append(f"| {key} | failed: {r['failed'][:120]} |" + " |" * (len(cols) + 3))
            continue
        conv = key.startswith("convs")
        lines.append(f"| {key} | " + " | ".join(cell(r, c) for c in cols) + f" | {ratio(r, 'ours', 'compile')} | "
                     f"{ratio(r, 'train ours', 'train compile')} | {ratio(r, 'ours', 'eager') if conv else ''} | "
                     f"{ratio(r, 'program', 'eager') if conv else ''} |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
