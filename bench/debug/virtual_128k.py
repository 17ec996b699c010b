"""Debug: where do 4 virtual devices diverge from one device on the 128K block?"""
import sys
import numpy as np
import cupy
import relational_tensors as rt
from relational_tensors.frontend.graph import Tensor
from relational_tensors.models import LLAMA3_8B, llama_block, llama_feeds

seq = int(sys.argv[1]) if len(sys.argv) > 1 else 131072
g = llama_block(1, seq, dtype="float16", **LLAMA3_8B)
for name in ("q_rope", "k_rope", "attention", "o_proj", "attn_residual", "swiglu"):
    g.save(Tensor(g, g.node(name).id), name=name)
feeds = llama_feeds(g, seed=1)
outs = {}
for dev in ("cuda:0", "cuda:0,0,0,0"):
    cg = rt.compileGraph(g, device=dev)
    print(dev, "attention split", cg.plan.split("attention"), "arena GiB", {d: round(b / 2**30, 2) for d, b in cg._exec().arena_bytes.items()}, flush=True)
    cg.load(feeds)
    cg.execute()
    outs[dev] = {n: cg.offload(n, like="cupy").astype(cupy.float32) for n in g.outputs}
    cg.execute(); cg.execute()
    outs[dev + "/graph"] = {n: cg.offload(n, like="cupy").astype(cupy.float32) for n in g.outputs}
    del cg
    cupy.get_default_memory_pool().free_all_blocks()
base = outs["cuda:0"]
for key, o in outs.items():
    for n in g.outputs:
        d = cupy.abs(o[n] - base[n])
        m = float(d.max())
        msg = f"{key:22s} {n:14s} max diff {m:.4f}"
        if m > 0.05:
            bad = cupy.argwhere(d > 0.05)
            toks = bad[:, 1]
            msg += f"  bad={int(bad.shape[0])} tokens {int(toks.min())}..{int(toks.max())} last-dim {int(bad[:, -1].min())}..{int(bad[:, -1].max())}"
            if d.ndim == 4:
                msg += f" heads {int(bad[:, 2].min())}..{int(bad[:, 2].max())}"
        print(msg, flush=True)
