"""Debug: why do 4 logical devices on one GPU differ from one device on the 128K block?

Modes (argv[1]):
  plain      the executor as shipped: diff after the eager first run and after graph replays
  onestream  every logical device issues on one stream (no concurrency): is it a race?
  noreuse    no arena reuse, then every buffer compared with the one-device buffer of the same
             tensor (first divergent tensor in graph order names the culprit)
  guard      no arena reuse, a 1 MiB guard band of 0xFF bytes after every buffer: any task that
             writes past its buffer shows as a changed guard (named with the buffer before it)

    python bench/debug/virtual_diverge.py MODE [seq] [p]
"""
import sys

import cupy

import relational_tensors as rt
from relational_tensors.gpu_exec import memory_plan
from relational_tensors.models import LLAMA3_8B, llama_block, llama_feeds

mode = sys.argv[1]
seq = int(sys.argv[2]) if len(sys.argv) > 2 else 131072
p = int(sys.argv[3]) if len(sys.argv) > 3 else 4

GAP = 1 << 20 if mode == "guard" else 0
if mode in ("noreuse", "guard"):
    def stacked(sizes, lifetimes):
        slots, off = {}, 0
        for b in sorted(sizes):
            size = memory_plan.align(max(sizes[b], 1))
            slots[b] = memory_plan.Slot(off, size)
            off += size + GAP
        return slots, off, {}
    memory_plan.plan_arena = stacked


def check_guards(cg, when):
    ex = cg._exec()
    bad = 0
    for b, slot in ex.plan.slots.items():
        arena = ex.arenas[cg.dag.buffers[b].device]
        gap = arena[slot.offset + slot.size: slot.offset + slot.size + GAP]
        hit = int((gap != 255).sum())
        if hit:
            bad += 1
            writers = [f"{t.id}:{t.label}:{t.kind}" for t in cg.dag.tasks if b in t.outputs]
            print(f"  {when}: {hit} guard bytes after buffer {b} ({cg.dag.buffers[b]}) changed; writers {writers}",
                  flush=True)
    print(f"  {when}: {bad} buffers wrote past their end", flush=True)

g = llama_block(1, seq, dtype="float16", **LLAMA3_8B)
feeds = llama_feeds(g, seed=1)
cgs = {}
for dev in ("cuda:0", "cuda:" + ",".join(["0"] * p)):
    cg = rt.compileGraph(g, device=dev)
    ex = cg._exec()
    if mode == "onestream":
        ex.streams = [ex.streams[0]] * len(ex.streams)
    if mode == "guard":
        for a in ex.arenas:
            a.fill(255)
    cg.load(feeds)
    cg.execute()
    if mode == "guard":
        cupy.cuda.Device(0).synchronize()
        check_guards(cg, dev + " eager")
        cg.execute()
        cg.execute()
        cupy.cuda.Device(0).synchronize()
        check_guards(cg, dev + " graph")
    cgs[dev] = cg
one, many = cgs.values()
y1 = one.offload("y", like="cupy").astype(cupy.float32)
yp = many.offload("y", like="cupy").astype(cupy.float32)
print(mode, seq, p, "eager first run: max |diff| of y", float(cupy.abs(yp - y1).max()), flush=True)

if mode in ("noreuse", "guard"):
    ex1, exp = one._exec(), many._exec()

    def arr(ex, b):
        v = ex.views[b]
        v = v[0] if isinstance(v, tuple) else v
        from relational_tensors.gpu_exec.cupy_backend import _cupy_of
        return _cupy_of(cupy, v).astype(cupy.float32)

    whole = {}
    for b, buf in one.dag.buffers.items():
        if buf.partial is None:
            whole.setdefault(buf.tensor, []).append(b)
    worst = {}
    for b, buf in many.dag.buffers.items():
        if buf.partial is not None or buf.tensor not in whole:
            continue
        for b1 in whole[buf.tensor]:
            box1 = one.dag.buffers[b1].box
            if all(l1 <= l and u <= u1 for l1, l, u, u1 in zip(box1.lower, buf.box.lower, buf.box.upper, box1.upper)):
                rel = tuple(slice(l - l1, u - l1) for l, l1, u in zip(buf.box.lower, box1.lower, buf.box.upper))
                d = float(cupy.abs(arr(exp, b) - arr(ex1, b1)[rel]).max())
                key = buf.tensor
                if d > worst.get(key, (-1,))[0]:
                    worst[key] = (d, b, buf.device, buf.box)
                break
    for node in g.nodes:
        if node.id in worst:
            d, b, dev, box = worst[node.id]
            print(f"{node.name:16s} max diff {d:9.4f}  (buffer {b}, device {dev}, box {box})", flush=True)
else:
    many.execute()
    many.execute()
    yp = many.offload("y", like="cupy").astype(cupy.float32)
    print(mode, seq, p, "after graph replays: max |diff| of y", float(cupy.abs(yp - y1).max()), flush=True)
