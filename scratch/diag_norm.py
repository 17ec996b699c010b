import numpy as np, cupy as cp, ml_dtypes
from relational_tensors.kernels.common import DevBuf
from relational_tensors.kernels import triton_norms_grad as tng
from relational_tensors.kernels.scratch import weight_grad_scratch, weight_grad_chunks

def buf(a, dtype):
    g = cp.asarray(a.view(np.uint8).reshape(-1)) if a.size else cp.zeros(8, cp.uint8)
    return g, DevBuf(int(g.data.ptr), a.shape, dtype, 0)

rng = np.random.default_rng(3)
for layer in (False, True):
  for rows in (38, 37, 16, 32, 75):
    d = 70
    x = (rng.standard_normal((rows, d)) * 2 + 1).astype(ml_dtypes.bfloat16)
    dy = rng.standard_normal((rows, d)).astype(ml_dtypes.bfloat16)
    xf, dyf = x.astype(np.float64), dy.astype(np.float64)
    mean = xf.mean(-1, keepdims=True) if layer else 0.0
    xc = xf - mean
    r = 1 / np.sqrt((xc * xc).mean(-1, keepdims=True) + 1e-5)
    want = (dyf * xc * r).sum(0)
    keep = []
    gx, bx = buf(x, "bfloat16"); gd, bd = buf(dy, "bfloat16")
    n = weight_grad_scratch(rows, d)
    gs, bs = buf(np.full(n, np.nan, np.float32), "float32")
    go, bo = buf(np.full(d, np.nan, np.float32), "float32")
    tng.norm_weight_grad(bx, bd, bo, bs, layer, 1e-5)
    cp.cuda.Device().synchronize()
    got = cp.asnumpy(go).view(np.float32)
    s = cp.asnumpy(gs).view(np.float32)
    st = s[: 2 * rows].reshape(rows, 2)
    ch = weight_grad_chunks(rows)
    print(f"layer={layer} rows={rows} chunks={ch} out err {np.abs(got - want).max() / np.abs(want).max():.2e}"
          f" mean err {np.abs(st[:,0] - np.ravel(mean if layer else 0)).max():.2e} r err {np.abs(st[:,1]-r.ravel()).max()/r.max():.2e}")
    if ch > 1:
        parts = s[2 * rows: 2 * rows + ch * d].reshape(ch, d)
        per = -(-rows // ch); per = -(-per // 32) * 32
        for c in range(ch):
            sl = slice(c * per, min(rows, (c + 1) * per))
            pw = (dyf[sl] * xc[sl] * r[sl]).sum(0)
            print(f"   chunk {c} rows {sl} err {np.abs(parts[c] - pw).max() / np.abs(pw).max():.2e}")
