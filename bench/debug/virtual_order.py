"""Debug: replay the benchmark's order (1, 2, then 4 devices) and check whether the reference copy
on the device survives, against a host copy taken at once."""
import numpy as np
import cupy
import relational_tensors as rt
from relational_tensors.models import LLAMA3_8B, llama_block, llama_feeds

g = llama_block(1, 131072, dtype="float16", **LLAMA3_8B)
feeds = llama_feeds(g, seed=1)
cg = rt.compileGraph(g, device="cuda:0")
cg.load(feeds)
for _ in range(4):
    cg.execute()
y = cg.offload("y", like="cupy")
y_host = cupy.asnumpy(y).astype(np.float32)
for p in (2, 4):
    cgv = rt.compileGraph(g, device="cuda:" + ",".join(["0"] * p))
    cgv.load(feeds)
    for _ in range(4):
        cgv.execute()
    yv = cgv.offload("y", like="cupy")
    dev = float(cupy.max(cupy.abs(yv.astype(cupy.float32) - y.astype(cupy.float32))))
    host = float(np.max(np.abs(cupy.asnumpy(yv).astype(np.float32) - y_host)))
    ydrift = float(np.max(np.abs(cupy.asnumpy(y).astype(np.float32) - y_host)))
    print(p, "vs device y", dev, "vs host y", host, "device y drifted by", ydrift, flush=True)
    del cgv, yv
