"""Generation on one GPU, as a transformers user runs it: a LLaMA-3-8B-shaped ``LlamaForCausalLM`` (32
layers, 4096 wide, GQA 32/8 heads, 14,336 intermediate, 128,256 vocabulary) with random weights in
bfloat16, side by side in one run:

* **prefill** of one prompt of 2,048 and of 8,192 tokens: ``Decoder.prefill`` (ours, the next token's
  logits on the GPU) against the model's own forward with ``logits_to_keep=1`` (eager);
* **decode** tokens/s at batch 1, 8 and 64 after a prompt of ``--context`` tokens (the prompts joining
  8 at a time, as a server's chunked prefill does): one ``Decoder.decode`` step (ours) against
  transformers' ``generate`` with its static cache, which compiles the step with
  ``torch.compile(mode="reduce-overhead")`` (per token: the time of ``--steps`` more tokens over their
  number), and against the HBM-bandwidth ceiling: the bytes a step must read (every weight but the
  embedding table, plus each sequence's cache) over this GPU's measured copy bandwidth;
* the batch-1 step on 8 logical devices of the GPU (``cuda:0,0,0,0,0,0,0,0``).

2 warm-ups and 10 timed rounds, CUDA events, medians.  A decoder's programs read one copy of the weights in
place (the decoder's, beside the model's); the decoders are made one at a time and freed.

    python bench/gpu_decode.py [--layers 32] [--context 1024] [--profile] [--out bench/results]
    python bench/gpu_decode.py --smoke        # a 2-layer model of 64 wide on cpu:2, wall-clock: the script's check
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gpu_moe import time_ms  # bench/gpu_moe.py: CUDA events on a GPU, wall-clock on the host; 2 + 10 rounds

import relational_tensors as rt

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=16384, rope_theta=500000.0)
SMOKE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024)


def make_model(config: dict, layers: int, device: str) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**config, "num_hidden_layers": layers}, pad_token_id=0, eos_token_id=None,
                      bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16 if device != "cpu" else torch.float32).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return model


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        try:
            import cupy

            cupy.get_default_memory_pool().free_all_blocks()
        except ImportError:
            pass


def prompt(batch: int, length: int, vocab: int, device: str) -> torch.Tensor:
    return torch.randint(1, vocab, (batch, length), generator=torch.Generator().manual_seed(batch)).to(device)


def ceiling_ms(model: Any, batch: int, context: int, bandwidth: float) -> float:
    """The bytes one decode step must read (weights but the embedding table; each sequence's keys and
    values over its context) over ``bandwidth`` (bytes/s)."""
    cfg = model.config
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 2
    return 1e3 * (weights + batch * context * kv) / bandwidth


def copy_bandwidth() -> float:
    """Bytes per second of a 4 GiB device-to-device copy (each byte read once and written once)."""
    a = torch.empty(2**31, dtype=torch.int16, device="cuda")
    b = torch.empty_like(a)
    ms = time_ms(lambda: b.copy_(a), True)
    return 2 * 2**32 / (ms * 1e-3)


def ours_prefill(model: Any, length: int, device: str, cuda: bool) -> float:
    dec = rt.decoder(model, max_batch=1, max_len=length + 16, device=device)
    ids = prompt(1, length, model.config.vocab_size, "cuda" if cuda else "cpu")
    return time_ms(lambda: dec.prefill(ids), cuda)


def torch_prefill(model: Any, length: int, cuda: bool) -> float:
    ids = prompt(1, length, model.config.vocab_size, "cuda" if cuda else "cpu")
    with torch.no_grad():
        return time_ms(lambda: model(input_ids=ids, logits_to_keep=1), cuda)


def ours_decode(model: Any, batch: int, context: int, device: str, cuda: bool,
                block_size: int | None = None, join: int = 8) -> tuple[float, bool]:
    """One decode step's time over ``batch`` running sequences, and whether its first greedy tokens are
    transformers'.  The prompts join ``join`` at a time (a server's chunked prefill: the prefill program of
    64 prompts of 1K tokens at once would hold 64K tokens' activations beside the weights)."""
    dec = rt.decoder(model, max_batch=batch, max_len=context + 32, device=device, block_size=block_size)
    ids = prompt(batch, context, model.config.vocab_size, "cuda" if cuda else "cpu")
    token = torch.cat([dec.join(ids[i:i + join])[1] for i in range(0, batch, join)]).argmax(-1)
    # the first steps' greedy tokens against transformers' own (a wrong cache would show here)
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=3, do_sample=False)[:, context:]
    free()  # (transformers' prefill logits of every prompt position stay in torch's cache otherwise)
    got = [token]
    for _ in range(2):
        got.append(dec.decode(got[-1]).argmax(-1))
    same = bool(torch.equal(torch.stack(got, 1), want))
    return time_ms(lambda: dec.decode(token), cuda), same


def profile_decode(model: Any, context: int, device: str) -> dict[str, Any]:
    """Where a batch-1 decode step's time goes (``gpu_user_profile.profile``): host time per call, GPU busy
    and idle time, kernels per step and the heaviest kernel families."""
    from gpu_user_profile import profile

    dec = rt.decoder(model, max_batch=1, max_len=context + 128, device=device)
    token = dec.join(prompt(1, context, model.config.vocab_size, "cuda"))[1].argmax(-1)
    return profile(lambda: dec.decode(token), calls=5)


def hf_decode(model: Any, batch: int, context: int, steps: int, cuda: bool) -> float:
    """Per-token time of transformers' static-cache generate (compiled on GPUs): (steps + 8 tokens) minus
    8 tokens, over steps."""
    ids = prompt(batch, context, model.config.vocab_size, "cuda" if cuda else "cpu")

    def gen(n: int) -> Callable[[], Any]:
        return lambda: model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                      cache_implementation="static")
    with torch.no_grad():
        short, long = time_ms(gen(8), cuda), time_ms(gen(8 + steps), cuda)
    free()
    return (long - short) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prefills", default="2048,8192")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--skip", default="", help="comma-separated parts to leave out: prefill, ours, hf, logical")
    ap.add_argument("--append", action="store_true",
                    help="add this run's rows to the result file already in --out (another command of the same "
                         "lease: transformers' compiled baseline takes most of a command's time limit alone)")
    ap.add_argument("--block-size", type=int, default=None,
                    help="also time the decode step over a paged cache of blocks of this many positions")
    ap.add_argument("--profile", action="store_true",
                    help="also profile the batch-1 step: GPU busy and idle time, host time, kernels per step "
                         "(bench/gpu_user_profile.py), in the JSON file")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    cuda = not a.smoke
    device = "cuda:0" if cuda else "cpu:2"
    skip = set(filter(None, a.skip.split(",")))
    model = make_model(SMOKE if a.smoke else LLAMA3_8B, 2 if a.smoke else a.layers, "cuda" if cuda else "cpu")
    bandwidth = copy_bandwidth() if cuda else None
    rows: list[dict[str, Any]] = []
    earlier = Path(a.out) / ("gpu_decode_smoke.json" if a.smoke else "gpu_decode.json")
    if a.append and earlier.exists():
        rows = json.loads(earlier.read_text())["rows"]

    def record(**row: Any) -> None:
        rows.append(row)
        print(row, flush=True)
        write(a, rows, bandwidth)  # after every row: a run cut short keeps what it measured

    def attempt(what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as e:  # recorded, not hidden: the table shows what failed
            traceback.print_exc()
            record(part=what, error=f"{type(e).__name__}: {str(e)[:200]}")
            return None
        finally:  # each decoder's programs hold their own weights: freed before the next
            free()

    prefills = [int(n) for n in a.prefills.split(",")] if not a.smoke else [48]
    if "prefill" not in skip:
        for n in prefills:
            ours = attempt(f"prefill {n}", lambda n=n: ours_prefill(model, n, device, cuda))
            ref = attempt(f"prefill {n} torch", lambda n=n: torch_prefill(model, n, cuda))
            record(part="prefill", tokens=n, ours_ms=ours, torch_eager_ms=ref)
    context = 40 if a.smoke else a.context
    for b in [int(x) for x in a.batches.split(",")]:
        got = None if "ours" in skip else attempt(f"decode b={b}", lambda b=b: ours_decode(model, b, context,
                                                                                           device, cuda))
        hf = None if "hf" in skip else attempt(f"decode b={b} hf",
                                               lambda b=b: hf_decode(model, b, context, a.steps, cuda))
        ceiling = ceiling_ms(model, b, context, bandwidth) if bandwidth else None
        ms, same = got if got else (None, None)
        record(part="decode", batch=b, context=context, ours_ms=ms, greedy_equal=same, hf_static_compiled_ms=hf,
               ceiling_ms=ceiling, ours_tokens_s=b * 1e3 / ms if ms else None,
               hf_tokens_s=b * 1e3 / hf if hf else None, of_ceiling=ceiling / ms if ceiling and ms else None)
        if a.block_size and "ours" not in skip:
            paged = attempt(f"decode b={b} paged", lambda b=b: ours_decode(model, b, context, device, cuda,
                                                                           a.block_size))
            if paged:
                record(part="decode", batch=b, context=context, device=f"{device}, paged {a.block_size}",
                       ours_ms=paged[0], greedy_equal=paged[1], ours_tokens_s=b * 1e3 / paged[0],
                       ceiling_ms=ceiling, of_ceiling=ceiling / paged[0] if ceiling else None)
    if a.profile and cuda:
        prof = attempt("profile", lambda: profile_decode(model, context, device))
        if prof:
            record(part="profile", batch=1, context=context, **prof)
    if "logical" not in skip and "ours" not in skip:
        logical = "cuda:0,0,0,0,0,0,0,0" if cuda else "cpu:4"
        got = attempt("decode logical", lambda: ours_decode(model, 1, context, logical, cuda))
        if got:
            record(part="decode", batch=1, context=context, device=logical, ours_ms=got[0], greedy_equal=got[1],
                   ours_tokens_s=1e3 / got[0])
    print((Path(a.out) / ("gpu_decode_smoke.md" if a.smoke else "gpu_decode.md")).read_text())


def write(a: argparse.Namespace, rows: list[dict[str, Any]], bandwidth: float | None) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    machine = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not a.smoke else platform.processor()
    command = " ".join(["python", "bench/gpu_decode.py", *sys.argv[1:]])
    for r in rows:
        r.setdefault("command", command)  # (rows appended from another command keep theirs)
    record = {"command": command, "commit": commit or "unknown",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{machine}, {platform.node()}", "copy_bandwidth_bytes_s": bandwidth, "rows": rows}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "gpu_decode_smoke" if a.smoke else "gpu_decode"
    (out / f"{name}.json").write_text(json.dumps(record, indent=2))

    def f(x: Any, spec: str = ".2f") -> str:
        return format(x, spec) if isinstance(x, float) else "-" if x is None else str(x)
    commands = list(dict.fromkeys(r["command"] for r in rows)) or [command]
    lines = [" and ".join(f"`{c}`" for c in commands) + f" at {record['commit']}, {record['date']}, "
             f"{record['machine']}", "",
             f"copy bandwidth: {bandwidth / 1e12:.2f} TB/s" if bandwidth else "copy bandwidth: not measured (smoke)",
             "", "| part | shape | ours ms | baseline ms | ours tokens/s | baseline tokens/s | ceiling ms | of ceiling "
             "| greedy = transformers |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["part"] == "profile":
            continue  # below the table
        if "error" in r:
            lines.append(f"| {r['part']} | failed: {r['error']} | | | | | | | |")
        elif r["part"] == "prefill":
            lines.append(f"| prefill (eager forward) | 1 × {r['tokens']} | {f(r['ours_ms'])} | "
                         f"{f(r['torch_eager_ms'])} | | | | | |")
        else:
            shape = f"batch {r['batch']}, context {r['context']}" + (f", {r['device']}" if "device" in r else "")
            lines.append(f"| decode step (static-cache generate, compiled) | {shape} | {f(r['ours_ms'])} | "
                         f"{f(r.get('hf_static_compiled_ms'))} | {f(r.get('ours_tokens_s'), '.0f')} | "
                         f"{f(r.get('hf_tokens_s'), '.0f')} | {f(r.get('ceiling_ms'))} | {f(r.get('of_ceiling'))} | "
                         f"{r.get('greedy_equal')} |")
    for r in rows:
        if r["part"] == "profile" and "error" not in r:
            lines += ["", f"Profile of the batch-1 step (context {r['context']}): {r['wall_ms']:.2f} ms a step, "
                      f"the GPU busy {r['busy_ms']:.2f} and idle {r['idle_ms']:.2f}; {r['host_ms']:.2f} ms of host "
                      f"time a call; {r['kernels_per_call']:.0f} kernels a step.  Heaviest kernel families (ms a "
                      "step):", ""]
            lines += [f"- {fam['family'][:80]}: {fam['ms']:.3f} ({fam['count']:.0f})" for fam in r["families"][:10]]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
