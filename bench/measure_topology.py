"""Measure this machine's GPUs and write them as a topology file the compiler reads.

    python bench/measure_topology.py [--out bench/results/multigpu/topology.json] [--bytes 256M] [--name NAME]

For every ordered pair of visible GPUs it times ``cudaMemcpyPeerAsync`` of ``--bytes`` (CUDA events,
on the destination's stream, as the executor issues copies) and of a 4 KiB copy (the start latency);
for every GPU, all its outgoing copies at once and all its incoming copies at once (what its
endpoints carry when every peer is busy); and a device-to-device copy inside each GPU (HBM bandwidth,
counting the bytes read and written).  ``nvidia-smi topo -m`` is recorded and parsed when present.

The topology file is ``Topology.to_json()``: site i is GPU i; the ordered pair (i, j) has its own
resource ``p2p(i->j)`` at the measured bandwidth, and its route also crosses ``egress(i)`` and
``ingress(j)`` at the measured all-peers rates, so concurrent copies out of (or into) one GPU
contend.  Load it with ``Topology.from_json(path)`` and pass the object:
``rt.compileGraph(g, device=8, topology=Topology.from_json(path))``.  The raw measurements go beside
it, in ``<stem>.raw.json``.

The builders (:func:`topology_from_bandwidth`, :func:`parse_nvidia_smi_topo`) need no GPU.

>>> t = topology_from_bandwidth([[0, 100e9], [50e9, 0]], name="two", hbm_bandwidth=2e12,
...                             memory_bytes=80 << 30, peak_flops={"float16": 1e15})
>>> t.bandwidth(0, 1), t.bandwidth(1, 0), t.route(0, 1).resources
(100000000000.0, 50000000000.0, ('p2p(0->1)',))
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from relational_tensors.machine.kernel_model import DEFAULT_EFFICIENCY
from relational_tensors.machine.topology import LAUNCH_LATENCY, NVLINK_LATENCY, PCIE_LATENCY, Route, Topology

__all__ = ["topology_from_bandwidth", "parse_nvidia_smi_topo", "link_latencies", "peak_flops_for", "main"]

Matrix = Sequence[Sequence[float]]

# dense FP16/BF16/TF32/FP32 peaks of one GPU (data sheets, SXM parts), matched by name
PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H200", {"float16": 989e12, "bfloat16": 989e12, "tf32": 494.5e12, "float32": 67e12}),
    ("H100", {"float16": 989e12, "bfloat16": 989e12, "tf32": 494.5e12, "float32": 67e12}),
    ("A100", {"float16": 312e12, "bfloat16": 312e12, "tf32": 156e12, "float32": 19.5e12}),
    ("V100", {"float16": 125e12, "float32": 15.7e12}),
)


def _square(name: str, m: Matrix, n: int | None = None) -> list[list[float]]:
    rows = [[float(v) for v in row] for row in m]
    size = len(rows) if n is None else n
    if len(rows) != size or any(len(r) != size for r in rows):
        raise ValueError(f"{name} must be a {size}x{size} matrix (one row and column per GPU); got rows of "
                         f"lengths {[len(r) for r in rows]}.")
    return rows


def topology_from_bandwidth(bandwidth: Matrix, *, name: str, hbm_bandwidth: float, memory_bytes: int,
                            peak_flops: Mapping[str, float], latency: float | Matrix = NVLINK_LATENCY,
                            egress: Sequence[float] | None = None, ingress: Sequence[float] | None = None,
                            launch_latency: float = LAUNCH_LATENCY) -> Topology:
    """A topology of ``len(bandwidth)`` GPUs from measured rates (bytes/s; the diagonal is ignored).

    Each ordered pair (i, j) gets the resource ``p2p(i->j)`` of capacity ``bandwidth[i][j]``; with
    ``egress``/``ingress`` (one rate per GPU) its route also draws from ``egress(i)`` and ``ingress(j)``.
    ``latency`` is one start latency in seconds or a matrix of them.
    """
    bw = _square("bandwidth", bandwidth)
    n = len(bw)
    if n == 0:
        raise ValueError("a topology needs at least one GPU; got an empty bandwidth matrix.")
    bad = [(i, j, bw[i][j]) for i in range(n) for j in range(n) if i != j and not bw[i][j] > 0]
    if bad:
        raise ValueError(f"every pair of distinct GPUs needs a positive bandwidth in bytes/s; got {bad[:6]}"
                         f"{' ...' if len(bad) > 6 else ''}.")
    lat = (_square("latency", latency, n) if not isinstance(latency, (int, float))
           else [[float(latency)] * n for _ in range(n)])
    ends: dict[str, list[float]] = {}
    for kind, rates in (("egress", egress), ("ingress", ingress)):
        if rates is not None:
            if len(rates) != n or not all(r > 0 for r in rates):
                raise ValueError(f"{kind} needs one positive rate per GPU ({n}); got {list(rates)}.")
            ends[kind] = [float(r) for r in rates]
    resources: dict[str, float] = {}
    routes: dict[tuple[int, int], Route] = {}
    for i in range(n):
        for kind, rates in ends.items():
            resources[f"{kind}({i})"] = rates[i]
        for j in range(n):
            if i == j:
                continue
            resources[f"p2p({i}->{j})"] = bw[i][j]
            path = [f"p2p({i}->{j})"]
            path += [f"egress({i})"] if "egress" in ends else []
            path += [f"ingress({j})"] if "ingress" in ends else []
            routes[(i, j)] = Route(tuple(path), lat[i][j])
    return Topology(name, tuple(range(n)), float(hbm_bandwidth), int(memory_bytes), dict(peak_flops),
                    float(launch_latency), resources, routes)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def parse_nvidia_smi_topo(text: str) -> dict[str, Any]:
    """The GPU-to-GPU part of ``nvidia-smi topo -m``: ``links[i][j]`` is the connection type (``X`` on the
    diagonal, ``NV<k>`` for k NVLinks, ``PIX``/``PXB``/``PHB``/``NODE``/``SYS`` through PCIe and hosts), and
    ``nvlinks[i][j]`` the NVLink count (0 without).

    >>> text = "\\tGPU0\\tGPU1\\tCPU Affinity\\nGPU0\\t X \\tNV4\\t0-7\\nGPU1\\tNV4\\t X \\t0-7\\n"
    >>> parse_nvidia_smi_topo(text)["nvlinks"]
    [[0, 4], [4, 0]]
    """
    lines = [_ANSI.sub("", line).rstrip() for line in text.splitlines()]
    header = next((line for line in lines if re.match(r"^\s+GPU0\b", line)), None)
    if header is None:
        raise ValueError("no GPU matrix in this text: `nvidia-smi topo -m` prints a header row starting "
                         "with GPU0; got " + repr(text[:200]))
    names = [c for c in header.split() if re.fullmatch(r"GPU\d+", c)]
    n = len(names)
    links: list[list[str]] = []
    for name in names:
        row = next((line for line in lines if re.match(rf"^{name}\s", line)), None)
        if row is None:
            raise ValueError(f"`nvidia-smi topo -m` names {name} in its header but has no row for it.")
        cells = row.split()[1:1 + n]
        if len(cells) < n:
            raise ValueError(f"the row of {name} has {len(cells)} GPU columns, not {n}: {row!r}.")
        links.append(cells)
    nvlinks = [[int(c[2:]) if re.fullmatch(r"NV\d+", c) else 0 for c in row] for row in links]
    return {"gpus": n, "links": links, "nvlinks": nvlinks}


def link_latencies(links: Sequence[Sequence[str]]) -> list[list[float]]:
    """A default start latency per pair from the link types: NVLink or PCIe/host."""
    return [[0.0 if c == "X" else NVLINK_LATENCY if c.startswith("NV") else PCIE_LATENCY for c in row]
            for row in links]


def peak_flops_for(gpu_name: str, measured: Mapping[str, float] | None = None) -> tuple[dict[str, float], str]:
    """The data-sheet peaks of a known GPU; otherwise the measured matmul rates over the simulator's
    default matmul efficiency (so that the simulator predicts the measured rate)."""
    for key, peaks in PEAK_FLOPS:
        if key.lower() in gpu_name.lower():
            return dict(peaks), f"data sheet ({key})"
    if not measured:
        raise ValueError(f"no data-sheet peak for GPU {gpu_name!r} and no measured rate; known: "
                         f"{[k for k, _ in PEAK_FLOPS]}.")
    eff = DEFAULT_EFFICIENCY["matmul"]
    return {k: v / eff for k, v in measured.items()}, f"measured matmul rate / {eff}"


# --- measurement (CuPy) --------------------------------------------------------------------------------

def _enable_peers(cp: Any, n: int) -> list[list[bool]]:
    rt = cp.cuda.runtime
    peer = [[i == j or bool(rt.deviceCanAccessPeer(i, j)) for j in range(n)] for i in range(n)]
    for i in range(n):
        with cp.cuda.Device(i):
            for j in range(n):
                if i != j and peer[i][j]:
                    try:
                        rt.deviceEnablePeerAccess(j)
                    except rt.CUDARuntimeError as e:
                        if "already" not in str(e).lower():
                            raise
    return peer


def _timed_copies(cp: Any, dst: Any, src: Any, repeats: int) -> float:
    """Seconds per copy of ``src`` into ``dst`` (``cudaMemcpyPeerAsync`` between GPUs), issued on the
    destination's stream."""
    rt = cp.cuda.runtime
    nbytes, d, s = src.nbytes, dst.device.id, src.device.id
    with cp.cuda.Device(d):
        stream = cp.cuda.Stream(non_blocking=True)
        start, end = cp.cuda.Event(), cp.cuda.Event()

        def copy() -> None:
            if d == s:  # inside one GPU: a plain device-to-device copy
                rt.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, rt.memcpyDeviceToDevice, stream.ptr)
            else:
                rt.memcpyPeerAsync(dst.data.ptr, d, src.data.ptr, s, nbytes, stream.ptr)

        copy()  # warm-up
        start.record(stream)
        for _ in range(repeats):
            copy()
        end.record(stream)
        end.synchronize()
        return cp.cuda.get_elapsed_time(start, end) * 1e-3 / repeats


def measure(nbytes: int = 256 << 20, repeats: int = 5, endpoints: bool = True) -> dict[str, Any]:
    """Every measurement on the visible GPUs (CuPy); rates in bytes/s, latencies in seconds."""
    import cupy as cp

    rt = cp.cuda.runtime
    n = rt.getDeviceCount()
    if n < 1:
        raise RuntimeError("no CUDA GPU is visible.")
    peer = _enable_peers(cp, n)
    props = [rt.getDeviceProperties(i) for i in range(n)]
    big, small = {}, {}
    for i in range(n):
        with cp.cuda.Device(i):
            big[i] = cp.empty(nbytes, dtype=cp.uint8)
            big[i].fill(i + 1)
            small[i] = cp.empty(4096, dtype=cp.uint8)
    inbox = {}
    for i in range(n):
        with cp.cuda.Device(i):
            inbox[i] = {j: cp.empty(nbytes, dtype=cp.uint8) for j in range(n) if j != i} if endpoints else {}
    bw = [[0.0] * n for _ in range(n)]
    lat = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            with cp.cuda.Device(j):
                dst = inbox[j][i] if endpoints else cp.empty(nbytes, dtype=cp.uint8)
                dst_small = cp.empty(4096, dtype=cp.uint8)
            bw[i][j] = nbytes / _timed_copies(cp, dst, big[i], repeats)
            lat[i][j] = _timed_copies(cp, dst_small, small[i], 50)
            print(f"GPU {i} -> GPU {j}: {bw[i][j] / 1e9:.1f} GB/s, {lat[i][j] * 1e6:.1f} us"
                  + ("" if peer[i][j] else " (no peer access: staged through the host)"), flush=True)
    hbm = []
    for i in range(n):
        with cp.cuda.Device(i):
            dst = cp.empty(nbytes, dtype=cp.uint8)
        hbm.append(2 * nbytes / _timed_copies(cp, dst, big[i], repeats))  # each byte read once, written once
    out: dict[str, Any] = {"gpus": n, "names": [p["name"].decode() for p in props],
                           "memory_bytes": [int(p["totalGlobalMem"]) for p in props], "bytes": nbytes,
                           "repeats": repeats, "peer_access": peer, "bandwidth": bw, "latency": lat, "hbm": hbm}
    if endpoints and n > 1:
        out["egress"] = [_all_at_once(cp, [(i, j) for j in range(n) if j != i], big, inbox, repeats)
                         for i in range(n)]
        out["ingress"] = [_all_at_once(cp, [(j, i) for j in range(n) if j != i], big, inbox, repeats)
                          for i in range(n)]
    out["matmul_rate"] = _matmul_rates(cp)
    return out


def _all_at_once(cp: Any, pairs: Sequence[tuple[int, int]], big: Mapping[int, Any],
                 inbox: Mapping[int, Mapping[int, Any]], repeats: int) -> float:
    """Bytes/s of the copies ``pairs`` (src, dst) issued together, each on its destination's stream."""
    rt = cp.cuda.runtime
    streams = {}
    for _, d in pairs:
        with cp.cuda.Device(d):
            streams[d] = cp.cuda.Stream(non_blocking=True)
    times = []
    for r in range(repeats + 1):
        for d in streams:
            streams[d].synchronize()
        t0 = time.perf_counter()
        for s, d in pairs:
            dst, src = inbox[d][s], big[s]
            with cp.cuda.Device(d):
                rt.memcpyPeerAsync(dst.data.ptr, d, src.data.ptr, s, src.nbytes, streams[d].ptr)
        for d in streams:
            streams[d].synchronize()
        if r:  # the first round warms up
            times.append(time.perf_counter() - t0)
    return len(pairs) * big[pairs[0][0]].nbytes / statistics.median(times)


def _matmul_rates(cp: Any) -> dict[str, float]:
    rates = {}
    for dtype, size in (("float16", 8192), ("float32", 4096)):
        a = cp.random.standard_normal((size, size), dtype=cp.float32).astype(dtype)
        b = cp.random.standard_normal((size, size), dtype=cp.float32).astype(dtype)
        cp.matmul(a, b)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        for _ in range(5):
            cp.matmul(a, b)
        end.record()
        end.synchronize()
        rates[dtype] = 5 * 2 * size**3 / (cp.cuda.get_elapsed_time(start, end) * 1e-3)
    return rates


def nvidia_smi_topo() -> str | None:
    """The text of ``nvidia-smi topo -m``, or None without nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    res = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=60)
    return res.stdout if res.returncode == 0 else None


def build(raw: Mapping[str, Any], name: str | None = None) -> Topology:
    """The topology of a ``measure()`` result (and its parsed ``nvidia-smi topo -m``, if any)."""
    n = raw["gpus"]
    peaks, source = peak_flops_for(raw["names"][0], raw.get("matmul_rate"))
    default = f"measured-{re.sub(r'[^a-z0-9]+', '-', raw['names'][0].lower()).strip('-')}-x{n}"
    bandwidth = raw["bandwidth"] if n > 1 else [[0.0]]
    return topology_from_bandwidth(bandwidth, name=name or default, hbm_bandwidth=statistics.median(raw["hbm"]),
                                   memory_bytes=min(raw["memory_bytes"]), peak_flops=peaks,
                                   latency=raw["latency"], egress=raw.get("egress"), ingress=raw.get("ingress"))


def _bytes(text: str) -> int:
    m = re.fullmatch(r"(\d+)([KMG]?)", text.strip().upper())
    if m is None:
        raise argparse.ArgumentTypeError(f"a size such as 256M or 1G; got {text!r}")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results/multigpu/topology.json"))
    ap.add_argument("--bytes", type=_bytes, default=256 << 20, help="bytes per timed copy (default 256M)")
    ap.add_argument("--repeats", type=int, default=5, help="timed copies per pair (default 5)")
    ap.add_argument("--name", help="the topology's name (default measured-<gpu>-x<n>; naming it after a "
                                   "shipped calibration, e.g. hgx-h200, makes the simulator use that file)")
    ap.add_argument("--no-endpoints", action="store_true", help="skip the all-peers-at-once measurement")
    args = ap.parse_args(argv)
    raw = measure(args.bytes, args.repeats, endpoints=not args.no_endpoints)
    text = nvidia_smi_topo()
    raw["nvidia_smi_topo"] = text
    if text:
        try:
            raw["nvidia_smi_links"] = parse_nvidia_smi_topo(text)
        except ValueError as e:
            raw["nvidia_smi_links"] = {"error": str(e)}
    raw["date"] = _dt.datetime.now().isoformat(timespec="seconds")
    raw["peak_flops_source"] = peak_flops_for(raw["names"][0], raw.get("matmul_rate"))[1]
    topo = build(raw, args.name)
    assert Topology.from_json(topo.to_json()) == topo
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(topo.to_json() + "\n")
    args.out.with_suffix(".raw.json").write_text(json.dumps(raw, indent=1) + "\n")
    n = raw["gpus"]
    pairs = [raw["bandwidth"][i][j] for i in range(n) for j in range(n) if i != j]
    if pairs:
        print(f"peer bandwidth {min(pairs) / 1e9:.1f}-{max(pairs) / 1e9:.1f} GB/s over {len(pairs)} ordered pairs")
    print(f"HBM copy {statistics.median(raw['hbm']) / 1e9:.0f} GB/s (read + write); wrote {args.out} "
          f"({topo.name}) and {args.out.with_suffix('.raw.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
