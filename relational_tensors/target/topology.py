"""Hardware topologies as data: sites, shared resources and the route of every transfer.

A topology names its GPUs (sites), the interconnect *resources* that transfers
contend for (each with a capacity in bytes/s), and for every ordered pair of
distinct sites the route a transfer takes: the resources it draws from and a
start latency.  The simulators turn routes into flows of
:mod:`relational_tensors.target.flows`, so a new machine is a new table (or a
JSON file written by a measuring script), not new code.

Resource names follow one convention, which :func:`multi_node` relies on:
``kind(i)`` or ``kind(i->j)`` with site ids in the parentheses is a per-GPU (or
per-link) resource; any other name (``pcie-bridge``, ``node_out[0]``) belongs to
the server as a whole.  Each GPU also has an HBM resource ``hbm(i)`` at
``hbm_bandwidth``, added by :meth:`Topology.capacities`.

>>> t = get_topology("dgx-v100")
>>> t.route(0, 3), t.bandwidth(0, 3), t.bandwidth(0, 1), t.bandwidth(0, 5)
(Route(resources=('nvlink(0->3)',), latency=2e-06), 50000000000.0, 25000000000.0, 15750000000.0)
>>> get_topology("dgx-a100", gpus=4).sites
(0, 1, 2, 3)
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import pyarrow as pa

from relational_tensors.errors import ExchangeError

__all__ = ["Route", "Topology", "TOPOLOGIES", "get_topology", "multi_node", "nvswitch", "pcie_server", "dgx_v100"]

GB = 1e9
GIB = 1 << 30
NVLINK_LATENCY = 2e-6
PCIE_LATENCY = 5e-6
NETWORK_LATENCY = 10e-6
LAUNCH_LATENCY = 4e-6
_FORMAT = "relational_tensors.topology/1"


@dataclass(frozen=True, slots=True)
class Route:
    """What a transfer from one site to another draws from, and its start latency in seconds."""

    resources: tuple[str, ...]
    latency: float


@dataclass(frozen=True, slots=True)
class Topology:
    """One machine (or several joined by a network), described by data.

    ``hbm_bandwidth`` (bytes/s) and ``memory_bytes`` are per GPU; ``peak_flops``
    maps a dtype name (``float16``, ``bfloat16``, ``tf32``, ``float32``) to the
    dense FLOP/s of one GPU; ``launch_latency`` is the cost of one kernel launch;
    ``resources`` maps an interconnect resource to its capacity in bytes/s;
    ``routes`` maps every ordered pair of distinct sites to its :class:`Route`.
    """

    name: str
    sites: tuple[int, ...]
    hbm_bandwidth: float
    memory_bytes: int
    peak_flops: Mapping[str, float] = field(hash=False)
    launch_latency: float
    resources: Mapping[str, float] = field(hash=False)
    routes: Mapping[tuple[int, int], Route] = field(hash=False, repr=False)

    def __post_init__(self) -> None:
        sites = tuple(int(s) for s in self.sites)
        object.__setattr__(self, "sites", sites)
        object.__setattr__(self, "peak_flops", {str(k): float(v) for k, v in self.peak_flops.items()})
        object.__setattr__(self, "resources", {str(k): float(v) for k, v in self.resources.items()})
        object.__setattr__(self, "routes", {(int(s), int(d)): Route(tuple(r.resources), float(r.latency))
                                            for (s, d), r in self.routes.items()})
        where = f"topology {self.name!r}"
        if not sites or len(set(sites)) != len(sites):
            raise ExchangeError(f"{where} needs distinct site ids; got {sites}.")
        if not (self.hbm_bandwidth > 0 and self.memory_bytes > 0 and self.launch_latency >= 0):
            raise ExchangeError(f"{where} needs hbm_bandwidth > 0, memory_bytes > 0 and launch_latency >= 0; got "
                                f"{self.hbm_bandwidth}, {self.memory_bytes}, {self.launch_latency}.")
        bad = {r: c for r, c in self.resources.items() if not (c > 0)}
        if bad:
            raise ExchangeError(f"{where}: every resource needs a positive capacity in bytes/s; got {bad}.")
        missing = [(s, d) for s in sites for d in sites if s != d and (s, d) not in self.routes]
        if missing:
            raise ExchangeError(f"{where} has no route for the ordered pairs {missing[:8]}"
                                f"{' ...' if len(missing) > 8 else ''}; give every pair of distinct sites a route.")
        for (s, d), r in self.routes.items():
            if s not in sites or d not in sites or s == d:
                raise ExchangeError(f"{where} has a route {s}->{d} between sites it does not hold "
                                    f"(sites {sites}); routes join two distinct sites.")
            unknown = [x for x in r.resources if x not in self.resources]
            if unknown or r.latency < 0:
                raise ExchangeError(f"{where}: route {s}->{d} uses unknown resources {unknown} or a negative "
                                    f"latency {r.latency}; declare each resource with its capacity.")

    # ---------------------------------------------------------------- queries

    def route(self, src: int, dst: int) -> Route:
        """The route of a transfer ``src -> dst``; a site to itself uses no interconnect."""
        for s in (src, dst):
            if s not in self.sites:
                raise ExchangeError(f"site {s} is not in topology {self.name!r} (sites {self.sites}).")
        if src == dst:
            return Route((), 0.0)
        return self.routes[(src, dst)]

    def bandwidth(self, src: int, dst: int) -> float:
        """The bandwidth of a lone transfer ``src -> dst``: the least capacity on its route."""
        return min((self.resources[r] for r in self.route(src, dst).resources), default=math.inf)

    def hbm(self, site: int) -> str:
        """The name of the HBM resource of ``site``."""
        return f"hbm({site})"

    def capacities(self) -> dict[str, float]:
        """Every resource a simulator needs: the interconnect's, plus ``hbm(i)`` for each GPU."""
        caps = dict(self.resources)
        for s in self.sites:
            caps.setdefault(self.hbm(s), self.hbm_bandwidth)
        return caps

    def flops(self, dtype: str) -> float:
        """Peak dense FLOP/s of one GPU for ``dtype``."""
        if dtype not in self.peak_flops:
            raise ExchangeError(f"topology {self.name!r} has no peak rate for dtype {dtype!r}; "
                                f"known: {sorted(self.peak_flops)}.")
        return self.peak_flops[dtype]

    def table(self) -> pa.Table:
        """One row per ordered pair: src, dst, resources, bandwidth (bytes/s), latency (s)."""
        pairs = sorted(self.routes)
        return pa.table({
            "src": pa.array([s for s, _ in pairs], pa.int64()),
            "dst": pa.array([d for _, d in pairs], pa.int64()),
            "resources": pa.array([list(self.routes[p].resources) for p in pairs], pa.list_(pa.string())),
            "bandwidth": pa.array([self.bandwidth(*p) for p in pairs], pa.float64()),
            "latency": pa.array([self.routes[p].latency for p in pairs], pa.float64()),
        })

    def resource_table(self) -> pa.Table:
        """One row per resource (HBM included): name, kind (the name before its parentheses), capacity."""
        caps = self.capacities()
        names = sorted(caps)
        return pa.table({
            "name": pa.array(names, pa.string()),
            "kind": pa.array([re.split(r"[(\[]", n, maxsplit=1)[0] for n in names], pa.string()),
            "capacity": pa.array([caps[n] for n in names], pa.float64()),
        })

    @property
    def machine(self) -> str:
        """The machine's name without the ``[n]`` that :meth:`subset` appends: the GPUs, and so the
        calibration, are the machine's."""
        return self.name.split("[", 1)[0]

    def subset(self, sites: Iterable[int], name: str | None = None) -> Topology:
        """The same machine restricted to ``sites``; resources no kept route uses are dropped."""
        keep = tuple(sites)
        missing = [s for s in keep if s not in self.sites]
        if missing or not keep:
            raise ExchangeError(f"cannot restrict topology {self.name!r} to sites {keep}: it holds {self.sites}.")
        routes = {(s, d): self.routes[(s, d)] for s in keep for d in keep if s != d}
        used = {r for route in routes.values() for r in route.resources}
        return Topology(name or f"{self.name}[{len(keep)}]", keep, self.hbm_bandwidth, self.memory_bytes,
                        self.peak_flops, self.launch_latency,
                        {r: c for r, c in self.resources.items() if r in used}, routes)

    # ---------------------------------------------------------------- files

    def to_json(self) -> str:
        """The topology as JSON text; :meth:`from_json` reads it back."""
        return json.dumps({
            "format": _FORMAT,
            "name": self.name,
            "sites": list(self.sites),
            "hbm_bandwidth": self.hbm_bandwidth,
            "memory_bytes": self.memory_bytes,
            "peak_flops": dict(self.peak_flops),
            "launch_latency": self.launch_latency,
            "resources": dict(self.resources),
            "routes": [{"src": s, "dst": d, "resources": list(r.resources), "latency": r.latency}
                       for (s, d), r in sorted(self.routes.items())],
        }, indent=1)

    @staticmethod
    def from_json(source: str | os.PathLike[str]) -> Topology:
        """Read a topology from JSON text, or from the path of a file holding it."""
        text = str(source)
        if isinstance(source, os.PathLike) or not text.lstrip().startswith("{"):
            with open(source, encoding="utf-8") as fh:
                text = fh.read()
        try:
            d = json.loads(text)
            if d.get("format", _FORMAT) != _FORMAT:
                raise ExchangeError(f"unknown topology format {d.get('format')!r}; expected {_FORMAT!r}.")
            return Topology(
                d["name"], tuple(d["sites"]), float(d["hbm_bandwidth"]), int(d["memory_bytes"]),
                d.get("peak_flops", {}), float(d.get("launch_latency", LAUNCH_LATENCY)), d["resources"],
                {(int(r["src"]), int(r["dst"])): Route(tuple(r["resources"]), float(r.get("latency", 0.0)))
                 for r in d["routes"]})
        except (KeyError, TypeError, ValueError) as e:
            raise ExchangeError(
                "a topology file needs name, sites, hbm_bandwidth, memory_bytes, resources and routes "
                f"(each route: src, dst, resources, latency); reading it failed with {e!r}.") from e


# -------------------------------------------------------------------- builders


def nvswitch(name: str, gpus: int, link_bandwidth: float, hbm_bandwidth: float, memory_bytes: int,
             peak_flops: Mapping[str, float], latency: float = NVLINK_LATENCY,
             launch_latency: float = LAUNCH_LATENCY) -> Topology:
    """A non-blocking all-to-all switch: a transfer contends only at its two endpoints.

    Every GPU has ``egress(i)`` and ``ingress(i)`` of ``link_bandwidth`` bytes/s per direction.
    """
    sites = tuple(range(gpus))
    resources = {f"{kind}({i})": link_bandwidth for i in sites for kind in ("egress", "ingress")}
    routes = {(s, d): Route((f"egress({s})", f"ingress({d})"), latency) for s in sites for d in sites if s != d}
    return Topology(name, sites, hbm_bandwidth, memory_bytes, peak_flops, launch_latency, resources, routes)


def pcie_server(name: str, gpus: int, bridge_bandwidth: float, port_bandwidth: float, hbm_bandwidth: float,
                memory_bytes: int, peak_flops: Mapping[str, float], latency: float = PCIE_LATENCY,
                launch_latency: float = LAUNCH_LATENCY) -> Topology:
    """GPUs without peer links: every transfer crosses its GPU's PCIe port and one shared host bridge."""
    sites = tuple(range(gpus))
    resources = {f"{kind}({i})": port_bandwidth for i in sites for kind in ("egress", "ingress")}
    resources["host-bridge"] = bridge_bandwidth
    routes = {(s, d): Route((f"egress({s})", "host-bridge", f"ingress({d})"), latency)
              for s in sites for d in sites if s != d}
    return Topology(name, sites, hbm_bandwidth, memory_bytes, peak_flops, launch_latency, resources, routes)


# DGX-1V hybrid cube-mesh: (a, b, NVLink bricks); each brick is 25 GB/s per direction.
DGX1V_LINKS: tuple[tuple[int, int, int], ...] = (
    (0, 1, 1), (0, 2, 1), (0, 3, 2), (0, 4, 2), (1, 2, 2), (1, 3, 1), (1, 5, 2), (2, 3, 2),
    (2, 6, 1), (3, 7, 1), (4, 5, 1), (4, 6, 1), (4, 7, 2), (5, 6, 2), (5, 7, 1), (6, 7, 2),
)


def dgx_v100(brick_bandwidth: float = 25 * GB, bridge_bandwidth: float = 15.75 * GB) -> Topology:
    """DGX-1V: linked pairs use their own link direction; every other pair shares one PCIe bridge."""
    sites = tuple(range(8))
    resources: dict[str, float] = {}
    routes: dict[tuple[int, int], Route] = {}
    for a, b, bricks in DGX1V_LINKS:
        for s, d in ((a, b), (b, a)):
            resources[f"nvlink({s}->{d})"] = bricks * brick_bandwidth
            routes[(s, d)] = Route((f"nvlink({s}->{d})",), NVLINK_LATENCY)
    resources["pcie-bridge"] = bridge_bandwidth
    for s in sites:
        for d in sites:
            if s != d and (s, d) not in routes:
                routes[(s, d)] = Route(("pcie-bridge",), PCIE_LATENCY)
    flops = {"float16": 125e12, "float32": 15.7e12}
    return Topology("dgx-v100", sites, 900 * GB, 32 * GIB, flops, LAUNCH_LATENCY, resources, routes)


_SITE_RESOURCE = re.compile(r"([^()]*)\(([\d\s\->,]*)\)")


def _renumber(resource: str, node: int, offset: int) -> str:
    m = _SITE_RESOURCE.fullmatch(resource)
    if m is None:
        return f"{resource}[node {node}]"
    ids = re.sub(r"\d+", lambda x: str(int(x.group()) + offset), m.group(2))
    return f"{m.group(1)}({ids})"


def multi_node(base: str | Topology, nodes: int, network_bandwidth: float,
               network_latency: float = NETWORK_LATENCY, name: str | None = None) -> Topology:
    """``nodes`` copies of a server joined by a network of ``network_bandwidth`` bytes/s per node and direction.

    Site ``node * gpus_per_node + i`` is GPU ``i`` of ``node``.  Inside a node the
    base routes apply (renumbered).  A transfer between nodes draws from
    ``egress(src)`` (when the base has it), ``node_out[src node]``,
    ``node_in[dst node]`` and ``ingress(dst)`` (when the base has it).

    >>> t = multi_node("dgx-h100", 2, 50e9)
    >>> t.route(0, 9).resources, t.bandwidth(0, 9)
    (('egress(0)', 'node_out[0]', 'node_in[1]', 'ingress(9)'), 50000000000.0)
    """
    b = get_topology(base) if isinstance(base, str) else base
    k = len(b.sites)
    if b.sites != tuple(range(k)):
        raise ExchangeError(f"multi_node needs a base whose sites are 0..{k - 1}; got {b.sites} for {b.name!r}.")
    if nodes < 1 or not network_bandwidth > 0:
        raise ExchangeError(f"multi_node needs nodes >= 1 and a positive network bandwidth; "
                            f"got {nodes}, {network_bandwidth}.")
    resources: dict[str, float] = {}
    routes: dict[tuple[int, int], Route] = {}
    for n in range(nodes):
        off = n * k
        for r, c in b.resources.items():
            resources[_renumber(r, n, off)] = c
        for (s, d), route in b.routes.items():
            routes[(s + off, d + off)] = Route(tuple(_renumber(r, n, off) for r in route.resources), route.latency)
        resources[f"node_out[{n}]"] = network_bandwidth
        resources[f"node_in[{n}]"] = network_bandwidth
    for s in range(nodes * k):
        for d in range(nodes * k):
            ns, nd = divmod(s, k)[0], divmod(d, k)[0]
            if ns == nd:
                continue
            path = [f"egress({s})"] if f"egress({s % k})" in b.resources else []
            path += [f"node_out[{ns}]", f"node_in[{nd}]"]
            path += [f"ingress({d})"] if f"ingress({d % k})" in b.resources else []
            routes[(s, d)] = Route(tuple(path), network_latency)
    return Topology(name or f"{nodes}x-{b.name}", tuple(range(nodes * k)), b.hbm_bandwidth, b.memory_bytes,
                    b.peak_flops, b.launch_latency, resources, routes)


def _registry() -> dict[str, Topology]:
    a100 = {"float16": 312e12, "bfloat16": 312e12, "tf32": 156e12, "float32": 19.5e12}
    hopper = {"float16": 989e12, "bfloat16": 989e12, "tf32": 494.5e12, "float32": 67e12}
    tops = [
        nvswitch("dgx-a100", 8, 300 * GB, 1555 * GB, 40 * GIB, a100),
        nvswitch("dgx-h100", 8, 450 * GB, 3350 * GB, 80 * GIB, hopper),
        nvswitch("hgx-h200", 8, 450 * GB, 4800 * GB, 141 * GIB, hopper),
        dgx_v100(),
        pcie_server("pcie", 8, 32 * GB, 32 * GB, 1555 * GB, 40 * GIB, a100),
    ]
    reg = {t.name: t for t in tops}
    # 400 Gb/s per node: 50 GB/s each direction.
    reg["2x-dgx-h100"] = multi_node(reg["dgx-h100"], 2, 50 * GB)
    return reg


TOPOLOGIES: dict[str, Topology] = _registry()


def get_topology(name: str | Topology, gpus: int | None = None) -> Topology:
    """A registered topology (or the one given, or a JSON file), restricted to its first ``gpus`` sites;
    a switch topology asked for more GPUs than it has is widened to a larger switch of the same GPUs.

    >>> get_topology("dgx-h100", gpus=2).table().column("bandwidth").to_pylist()
    [450000000000.0, 450000000000.0]
    """
    if isinstance(name, Topology):
        top = name
    elif name in TOPOLOGIES:
        top = TOPOLOGIES[name]
    elif isinstance(name, str) and name.endswith(".json") and os.path.exists(name):
        top = Topology.from_json(name)  # a file written by a measuring script
    else:
        raise ExchangeError(f"unknown topology {name!r}; known: {sorted(TOPOLOGIES)} "
                            "(or build one with nvswitch(), multi_node() or Topology.from_json()).")
    if gpus is None or gpus == len(top.sites):
        return top
    if gpus < 1:
        raise ExchangeError(f"a topology needs at least one GPU; got gpus={gpus}.")
    if gpus > len(top.sites):
        switch = _switch_links(top)
        if switch is None:
            raise ExchangeError(
                f"topology {top.name!r} has {len(top.sites)} GPUs and no switch to widen; got gpus={gpus}. "
                f"Compile for at most {len(top.sites)} devices, or pass a topology with {gpus} GPUs "
                "(nvswitch(), multi_node() or Topology.from_json()).")
        # the same GPUs on a larger non-blocking switch: what a plan for more logical devices than the
        # machine has GPUs (cpu:16, say) is priced against; the name keeps the GPUs' calibration
        return nvswitch(top.name, gpus, switch[0], top.hbm_bandwidth, top.memory_bytes, top.peak_flops,
                        switch[1], top.launch_latency)
    return top.subset(top.sites[:gpus])


def _switch_links(top: Topology) -> tuple[float, float] | None:
    """(link bandwidth, latency) of a uniform non-blocking switch as :func:`nvswitch` builds it;
    None for any other topology."""
    sites = top.sites
    if set(top.resources) != {f"{kind}({i})" for i in sites for kind in ("egress", "ingress")}:
        return None
    bandwidths = set(top.resources.values())
    latencies = {r.latency for r in top.routes.values()}
    if len(bandwidths) != 1 or len(latencies) > 1:
        return None
    if any(r.resources != (f"egress({s})", f"ingress({d})") for (s, d), r in top.routes.items()):
        return None
    return bandwidths.pop(), latencies.pop() if latencies else NVLINK_LATENCY
