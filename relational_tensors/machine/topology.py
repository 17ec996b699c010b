"""Hardware topologies as data: sites, shared resources and the route of every transfer.

A topology names its GPUs (sites), the interconnect *resources* that transfers
contend for (each with a capacity in bytes/s), and for every ordered pair of
distinct sites the route a transfer takes: the resources it draws from and a
start latency.  The simulators turn routes into flows of
:mod:`relational_tensors.machine.flows`, so a new machine is a new table (or a
JSON file written by a measuring script), not new code.

Resource names follow one convention, which :func:`multi_node` relies on:
``kind(i)`` or ``kind(i->j)`` with site ids in the parentheses is a per-GPU (or
per-link) resource; any other name (``pcie-bridge``, ``node_out[0]``) belongs to
the server as a whole.  Each GPU also has an HBM resource ``hbm(i)`` at
``hbm_bandwidth``, added by :meth:`Topology.capacities`.

A topology file either lists every route (what :meth:`Topology.to_json` writes, and what a measuring
script produces) or names a *builder* and its parameters, which is how a machine's data sheet reads
(:func:`from_builder`): ``nvswitch`` (``gpus`` GPUs on one non-blocking switch, ``link_bandwidth``
bytes/s per GPU and direction) or ``rails`` (``nodes`` copies of the ``base`` machine, every GPU with a
NIC of its own, rail-aligned: see :func:`rails`).  Both take the GPU's ``hbm_bandwidth``,
``memory_bytes`` and ``peak_flops`` (``rails`` inherits the base's) and an optional ``chip``: the
machine whose calibration the GPUs use.  The registry of named machines is ``machine.machines``.

>>> t = dgx_v100()
>>> t.route(0, 3), t.bandwidth(0, 3), t.bandwidth(0, 1), t.bandwidth(0, 5)
(Route(resources=('nvlink(0->3)',), latency=2e-06), 50000000000.0, 25000000000.0, 15750000000.0)
"""

from __future__ import annotations

import json
import math
import os
import re
import reprlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from relational_tensors.core.numbers import is_integer, is_number
from relational_tensors.errors import ExchangeError

__all__ = ["Route", "Topology", "multi_node", "nvswitch", "pcie_server", "dgx_v100", "rails", "from_builder"]

GB = 1e9
GIB = 1 << 30
NVLINK_LATENCY = 2e-6
PCIE_LATENCY = 5e-6
NETWORK_LATENCY = 10e-6
LAUNCH_LATENCY = 4e-6
_FORMAT = "relational_tensors.topology/1"
_FILE_KEYS = ("name, sites, hbm_bandwidth, memory_bytes, peak_flops, resources and routes (each route: src, dst, "
              "resources and an optional latency; launch_latency is optional too)")

_SHOW = reprlib.Repr()
_SHOW.maxstring, _SHOW.maxother, _SHOW.maxlist, _SHOW.maxdict, _SHOW.maxlevel = 60, 60, 6, 6, 3


def show(value: object) -> str:
    """A bounded repr for error messages: a value read from a file may be huge or deeply nested."""
    return _SHOW.repr(value)


def _positive(where: str, field_: str, value: object, what: str) -> float:
    """``value`` as a finite float > 0, else an ExchangeError naming ``field_``."""
    if not is_number(value):
        raise ExchangeError(f"{where}: {field_} must be a number ({what}); got {show(value)}. Write it as a "
                            "JSON or Python number, not a string or a bool.")
    if not 0 < value < math.inf:  # NaN fails both comparisons
        raise ExchangeError(f"{where}: {field_} must be a finite number > 0 ({what}); got {show(value)}. "
                            "Give the measured or data-sheet value.")
    return float(value)


def _duration(where: str, field_: str, value: object) -> float:
    """``value`` as a finite float >= 0 seconds, else an ExchangeError naming ``field_``."""
    if not is_number(value):
        raise ExchangeError(f"{where}: {field_} must be a number of seconds; got {show(value)}. Write it as a "
                            "JSON or Python number, not a string or a bool.")
    if not 0 <= value < math.inf:
        raise ExchangeError(f"{where}: {field_} must be a finite number of seconds >= 0; got {show(value)}. "
                            "Give the measured start latency (0 for none).")
    return float(value)


def _names(where: str, field_: str, mapping: object, what: str) -> Mapping[Any, Any]:
    """``mapping`` checked to be a mapping keyed by non-empty strings."""
    if not isinstance(mapping, Mapping):
        raise ExchangeError(f"{where}: {field_} must be a mapping of names to {what}; got "
                            f"{type(mapping).__name__} {show(mapping)}.")
    for k in mapping:
        if not isinstance(k, str) or not k:
            raise ExchangeError(f"{where}: every key of {field_} must be a non-empty string; got {show(k)} "
                                f"in {show(mapping)}.")
    return mapping


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
    chip: str = ""  # the machine whose GPUs these are, for their calibration ("" = this machine's own)

    def __post_init__(self) -> None:
        # every number is checked here, once, so that no simulator or cost model meets a NaN, an infinity,
        # a string or a bool: a NaN peak rate looped the whole-plan simulator forever before
        name = self.name
        if not isinstance(name, str) or not name:
            raise ExchangeError(f"a topology's name must be a non-empty string; got {show(name)}. Name the "
                                "machine (a name with a shipped calibration, e.g. 'hgx-h200', selects it).")
        where = f"topology {name!r}"
        sites = _site_ids(where, self.sites)
        object.__setattr__(self, "sites", sites)
        object.__setattr__(self, "hbm_bandwidth",
                           _positive(where, "hbm_bandwidth", self.hbm_bandwidth, "bytes/s of one GPU's memory"))
        mem = self.memory_bytes
        if not is_number(mem) or not (1 <= mem < math.inf and mem == int(mem)):
            raise ExchangeError(f"{where}: memory_bytes must be an integer number of bytes >= 1 (one GPU's "
                                f"memory); got {show(mem)}. Write the byte count, e.g. 85899345920 for 80 GiB.")
        object.__setattr__(self, "memory_bytes", int(mem))
        object.__setattr__(self, "launch_latency", _duration(where, "launch_latency", self.launch_latency))
        flops = _names(where, "peak_flops", self.peak_flops, "dense FLOP/s of one GPU")
        object.__setattr__(self, "peak_flops", {k: _positive(where, f"peak_flops[{k!r}]", v, "dense FLOP/s of "
                                                             "one GPU") for k, v in flops.items()})
        resources = _names(where, "resources", self.resources, "capacities in bytes/s")
        caps: dict[str, float] = {}
        for r, c in resources.items():
            if is_number(c) and c == math.inf:
                raise ExchangeError(
                    f"{where}: resources[{r!r}] must be a finite capacity in bytes/s; got {c!r}. An infinite "
                    "capacity is not a rate the flow engine can share; leave a link that never contends off "
                    "the routes instead (a route with no resources moves data in its latency alone).")
            caps[r] = _positive(where, f"resources[{r!r}]", c, "a capacity in bytes/s")
        object.__setattr__(self, "resources", caps)
        object.__setattr__(self, "routes", _routes(where, self.routes, sites, caps))
        missing = [(s, d) for s in sites for d in sites if s != d and (s, d) not in self.routes]
        if missing:
            raise ExchangeError(f"{where} has no route for the ordered pairs {missing[:8]}"
                                f"{' ...' if len(missing) > 8 else ''}; give every pair of distinct sites a route.")
        if not self.peak_flops:  # after the routes: a structural error is the one to fix first
            raise ExchangeError(f"{where}: peak_flops needs at least one dtype, since every kernel is priced "
                                "from it (dtypes without an entry use float32's, else the fastest); got {}. "
                                "Give e.g. {'float32': 6.7e13} (dense FLOP/s of one GPU).")

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

    @property
    def gpu_machine(self) -> str:
        """The machine whose GPUs these are: ``chip`` where given (a 72-GPU domain of H200s uses the
        HGX H200's calibration), else this machine."""
        return self.chip or self.machine

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
                        {r: c for r, c in self.resources.items() if r in used}, routes, self.chip)

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
            **({"chip": self.chip} if self.chip else {}),
        }, indent=1)

    @staticmethod
    def from_json(source: str | os.PathLike[str]) -> Topology:
        """Read a topology from JSON text (a string starting with ``{`` or ``[``), or from the path of a
        file holding it.  Every error is an :class:`ExchangeError` naming the file and the field."""
        if isinstance(source, str) and source.lstrip().startswith(("{", "[")):
            text, origin = source, "topology JSON text"
        elif isinstance(source, (str, os.PathLike)):
            text, origin = read_text(source, "topology"), f"topology file {os.fspath(source)!r}"
        else:
            raise ExchangeError(f"Topology.from_json takes JSON text or the path of a JSON file; got "
                                f"{type(source).__name__} {show(source)}.")
        doc = load_json(text, origin, "a topology")
        try:
            return _from_document(doc, origin)
        except ExchangeError as e:
            raise ExchangeError(f"{origin}: {e}") from None


def read_text(source: str | os.PathLike[str], what: str) -> str:
    """The UTF-8 text of the file ``source`` (a topology or calibration file), or an ExchangeError that
    says why it cannot be read."""
    path = os.fspath(source)
    hint = ("; JSON text starts with '{'" if isinstance(source, str) and what == "topology" else "")
    writer = "Topology.to_json() or a measuring script" if what == "topology" else "`relational-tensors calibrate`"
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except FileNotFoundError:
        raise ExchangeError(f"no {what} file {path!r}: it does not exist{hint}. Give the path of a JSON file "
                            f"written by {writer}.") from None
    except IsADirectoryError:
        raise ExchangeError(f"{what} file {path!r} is a directory, not a file; give the path of a JSON file "
                            f"written by {writer}.") from None
    except UnicodeDecodeError as e:
        raise ExchangeError(f"{what} file {path!r} is not UTF-8 text ({e.reason} at byte {e.start}); "
                            "write it as JSON in UTF-8.") from None
    except (OSError, ValueError) as e:  # permissions, a name too long, an embedded NUL
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ExchangeError(f"cannot read {what} file {show(path)}: {why}; give the path of a readable JSON "
                            "file.") from None


def load_json(text: str, origin: str, what: str) -> object:
    """``text`` parsed as JSON, or an ExchangeError naming ``origin``."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ExchangeError(f"{origin} nests too deeply to be {what} (JSON arrays or objects inside one "
                            "another past Python's recursion limit); got text of "
                            f"{len(text):,} characters starting {show(text[:20])}.") from None
    except ValueError as e:  # JSONDecodeError, and integers past Python's digit limit
        where = f" at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        msg = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
        raise ExchangeError(f"{origin} is not JSON: {msg}{where}; got text starting {show(text[:40])}.") from None


def _from_document(doc: object, origin: str) -> Topology:
    """A topology from a parsed topology file; shape errors name the field (the caller adds ``origin``)."""
    if not isinstance(doc, dict):
        raise ExchangeError(f"a topology is a JSON object with {_FILE_KEYS}; got {type(doc).__name__} "
                            f"{show(doc)}.")

    def need(key: str) -> Any:
        if key not in doc:
            raise ExchangeError(f"{key} is missing; a topology file needs {_FILE_KEYS}, as Topology.to_json() "
                                f"writes them; got the keys {show(sorted(doc))}.")
        return doc[key]

    fmt = doc.get("format", _FORMAT)
    if fmt != _FORMAT:
        raise ExchangeError(f"unknown topology format {show(fmt)}; expected {_FORMAT!r}.")
    if "builder" in doc:  # a machine described by its builder's parameters (see from_builder)
        return from_builder(doc)
    name, sites = need("name"), need("sites")
    if not isinstance(sites, list):
        raise ExchangeError(f"sites must be a list of site ids (integers >= 0); got {type(sites).__name__} "
                            f"{show(sites)}.")
    hbm, memory, flops = need("hbm_bandwidth"), need("memory_bytes"), need("peak_flops")
    launch, resources, raw = doc.get("launch_latency", LAUNCH_LATENCY), need("resources"), need("routes")
    for key, value in (("peak_flops", flops), ("resources", resources)):
        if not isinstance(value, dict):
            raise ExchangeError(f"{key} must be a JSON object of names to numbers; got {type(value).__name__} "
                                f"{show(value)}.")
    if not isinstance(raw, list):
        raise ExchangeError(f"routes must be a list of objects with src, dst, resources and latency; got "
                            f"{type(raw).__name__} {show(raw)}.")
    routes: dict[tuple[int, int], Route] = {}
    for i, r in enumerate(raw):
        if not isinstance(r, dict):
            raise ExchangeError(f"routes[{i}] must be an object with src, dst, resources and latency; got "
                                f"{type(r).__name__} {show(r)}.")
        for key in ("src", "dst", "resources"):
            if key not in r:
                raise ExchangeError(f"routes[{i}].{key} is missing; each route needs src, dst, resources and "
                                    f"an optional latency; got {show(r)}.")
        for key in ("src", "dst"):
            if not is_integer(r[key]):
                raise ExchangeError(f"routes[{i}].{key} must be a site id (an integer); got {show(r[key])}.")
        res = r["resources"]
        if not isinstance(res, list) or not all(isinstance(x, str) for x in res):
            raise ExchangeError(f"routes[{i}].resources must be a list of resource names (strings); got "
                                f"{show(res)}.")
        pair = (r["src"], r["dst"])
        if pair in routes:
            raise ExchangeError(f"routes[{i}] lists the route {pair[0]}->{pair[1]} twice; give each ordered "
                                "pair of sites one route.")
        latency = r.get("latency", 0.0)
        if not is_number(latency):
            raise ExchangeError(f"routes[{i}].latency must be a number of seconds; got {show(latency)}.")
        routes[pair] = Route(tuple(res), latency)
    chip = doc.get("chip", "")
    if not isinstance(chip, str):
        raise ExchangeError(f"chip must be the name of the machine whose GPUs these are (a string); got "
                            f"{show(chip)}.")
    return Topology(name, tuple(sites), hbm, memory, flops, launch, resources, routes, chip)


def _site_ids(where: str, sites: object) -> tuple[int, ...]:
    if isinstance(sites, (str, bytes, Mapping)) or not isinstance(sites, Iterable):
        raise ExchangeError(f"{where}: sites must be a sequence of site ids (integers >= 0); got "
                            f"{type(sites).__name__} {show(sites)}.")
    ids = tuple(sites)
    for s in ids:
        if not is_integer(s) or s < 0:
            raise ExchangeError(f"{where}: every site id must be an integer >= 0; got {show(s)} in sites "
                                f"{show(ids)}. Number the GPUs 0, 1, ...")
    out = tuple(int(s) for s in ids)
    if not out or len(set(out)) != len(out):
        raise ExchangeError(f"{where} needs at least one site and distinct site ids; got sites {show(out)}.")
    return out


def _routes(where: str, routes: object, sites: tuple[int, ...],
            caps: Mapping[str, float]) -> dict[tuple[int, int], Route]:
    if not isinstance(routes, Mapping):
        raise ExchangeError(f"{where}: routes must be a mapping of (src, dst) site pairs to Route; got "
                            f"{type(routes).__name__} {show(routes)}.")
    held = set(sites)
    out: dict[tuple[int, int], Route] = {}
    # the common case (int sites, a tuple of str names, a float latency) takes the fast path and keeps
    # its Route; the checks run for every route of every topology a compilation resolves
    for key, r in routes.items():
        if not (isinstance(key, tuple) and len(key) == 2 and is_integer(key[0]) and is_integer(key[1])):
            raise ExchangeError(f"{where}: every key of routes must be a (src, dst) pair of site ids; got "
                                f"{show(key)}.")
        s, d = int(key[0]), int(key[1])
        if s not in held or d not in held or s == d:
            raise ExchangeError(f"{where} has a route {s}->{d} between sites it does not hold "
                                f"(sites {sites}); routes join two distinct sites.")
        if not isinstance(r, Route):
            raise ExchangeError(f"{where}: routes[{s}->{d}] must be a Route(resources, latency); got "
                                f"{type(r).__name__} {show(r)}.")
        res = r.resources
        if type(res) is not tuple:
            if isinstance(res, (str, bytes)) or not isinstance(res, Iterable):
                raise ExchangeError(f"{where}: routes[{s}->{d}].resources must be a sequence of resource names "
                                    f"(strings); got {show(res)}.")
            res = tuple(res)
        for x in res:
            if type(x) is not str or x not in caps:
                if not isinstance(x, str):
                    raise ExchangeError(f"{where}: routes[{s}->{d}].resources must be a sequence of resource "
                                        f"names (strings); got {show(r.resources)}.")
                unknown = [y for y in res if y not in caps]
                raise ExchangeError(f"{where}: route {s}->{d} uses unknown resources {unknown}; declare each "
                                    f"resource with its capacity (declared: {show(sorted(caps))}).")
        lat = r.latency
        if type(lat) is not float or not 0 <= lat < math.inf:
            lat = _duration(where, f"routes[{s}->{d}].latency", lat)
        out[(s, d)] = r if res is r.resources and lat is r.latency else Route(res, lat)
    return out


# -------------------------------------------------------------------- builders


def _gpus(name: str, gpus: object) -> int:
    if not is_integer(gpus) or gpus < 1:  # type: ignore[operator]
        raise ExchangeError(f"topology {name!r} needs a whole number of GPUs >= 1; got gpus={show(gpus)}.")
    return int(gpus)  # type: ignore[call-overload]


def nvswitch(name: str, gpus: int, link_bandwidth: float, hbm_bandwidth: float, memory_bytes: int,
             peak_flops: Mapping[str, float], latency: float = NVLINK_LATENCY,
             launch_latency: float = LAUNCH_LATENCY, chip: str = "") -> Topology:
    """A non-blocking all-to-all switch: a transfer contends only at its two endpoints.

    Every GPU has ``egress(i)`` and ``ingress(i)`` of ``link_bandwidth`` bytes/s per direction.
    """
    sites = tuple(range(_gpus(name, gpus)))
    resources = {f"{kind}({i})": link_bandwidth for i in sites for kind in ("egress", "ingress")}
    routes = {(s, d): Route((f"egress({s})", f"ingress({d})"), latency) for s in sites for d in sites if s != d}
    return Topology(name, sites, hbm_bandwidth, memory_bytes, peak_flops, launch_latency, resources, routes, chip)


def pcie_server(name: str, gpus: int, bridge_bandwidth: float, port_bandwidth: float, hbm_bandwidth: float,
                memory_bytes: int, peak_flops: Mapping[str, float], latency: float = PCIE_LATENCY,
                launch_latency: float = LAUNCH_LATENCY) -> Topology:
    """GPUs without peer links: every transfer crosses its GPU's PCIe port and one shared host bridge."""
    sites = tuple(range(_gpus(name, gpus)))
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


def node_copies(base: Topology, nodes: int, who: str) -> tuple[dict[str, float], dict[tuple[int, int], Route]]:
    """The resources and routes of ``nodes`` copies of ``base`` (sites ``0..k-1``), renumbered: site
    ``node * k + i`` is GPU ``i`` of ``node``.  What the builders of several nodes (``who``) start from."""
    k = len(base.sites)
    if base.sites != tuple(range(k)):
        raise ExchangeError(f"{who} needs a base whose sites are 0..{k - 1}; got {base.sites} for {base.name!r}.")
    if not is_integer(nodes) or nodes < 1:
        raise ExchangeError(f"{who} needs a whole number of nodes >= 1; got nodes={show(nodes)}.")
    resources: dict[str, float] = {}
    routes: dict[tuple[int, int], Route] = {}
    for n in range(nodes):
        off = n * k
        for r, c in base.resources.items():
            resources[_renumber(r, n, off)] = c
        for (s, d), route in base.routes.items():
            routes[(s + off, d + off)] = Route(tuple(_renumber(r, n, off) for r in route.resources), route.latency)
    return resources, routes


def multi_node(base: Topology, nodes: int, network_bandwidth: float,
               network_latency: float = NETWORK_LATENCY, name: str | None = None) -> Topology:
    """``nodes`` copies of a server joined by a network of ``network_bandwidth`` bytes/s per node and direction.

    Site ``node * gpus_per_node + i`` is GPU ``i`` of ``node``.  Inside a node the
    base routes apply (renumbered).  A transfer between nodes draws from
    ``egress(src)`` (when the base has it), ``node_out[src node]``,
    ``node_in[dst node]`` and ``ingress(dst)`` (when the base has it).

    >>> t = multi_node(nvswitch("dgx-h100", 8, 450e9, 3350e9, 80 << 30, {"bfloat16": 989e12}), 2, 50e9)
    >>> t.route(0, 9).resources, t.bandwidth(0, 9)
    (('egress(0)', 'node_out[0]', 'node_in[1]', 'ingress(9)'), 50000000000.0)
    """
    b = base
    resources, routes = node_copies(b, nodes, "multi_node")
    k = len(b.sites)
    where = f"multi_node of {b.name!r}"
    network_bandwidth = _positive(where, "network_bandwidth", network_bandwidth, "bytes/s per node and direction")
    network_latency = _duration(where, "network_latency", network_latency)
    for n in range(nodes):
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
                    b.peak_flops, b.launch_latency, resources, routes, b.gpu_machine)


def rails(base: Topology, nodes: int, nic_bandwidth: float, network_latency: float = NETWORK_LATENCY,
          name: str | None = None) -> Topology:
    """``nodes`` copies of ``base`` joined by one NIC per GPU, rail-aligned (see the module's text).

    Site ``node * gpus_per_node + i`` is GPU ``i`` of ``node``; inside a node the base's routes apply."""
    resources, routes = node_copies(base, nodes, "rails")
    k = len(base.sites)
    nic = _positive(f"rails of {base.name!r}", "nic_bandwidth", nic_bandwidth, "bytes/s per NIC and direction")
    n_sites = nodes * k
    for s in range(n_sites):
        resources[f"nic_out({s})"] = nic
        resources[f"nic_in({s})"] = nic
    for s in range(n_sites):
        for d in range(n_sites):
            if s // k == d // k:
                continue
            if s % k == d % k:
                routes[(s, d)] = Route((f"nic_out({s})", f"nic_in({d})"), network_latency)
            else:  # to the GPU of the destination's rail inside the source node, then out through its NIC
                hop = (s // k) * k + d % k
                inner = routes[(s, hop)]
                routes[(s, d)] = Route((*inner.resources, f"nic_out({hop})", f"nic_in({d})"),
                                       inner.latency + network_latency)
    return Topology(name or f"{nodes}x-{base.name}-rails", tuple(range(n_sites)), base.hbm_bandwidth,
                    base.memory_bytes, base.peak_flops, base.launch_latency, resources, routes, base.gpu_machine)


# the named machines a builder document may take as its base: machine.machines registers every one here
# when it is imported (importing this package does), so a file naming a registered base reads anywhere
REGISTERED: dict[str, Topology] = {}

_BUILDERS = {
    "nvswitch": ("gpus", "link_bandwidth", "hbm_bandwidth", "memory_bytes", "peak_flops"),
    "rails": ("base", "nodes", "nic_bandwidth"),
}
_OPTIONAL = {"format", "name", "builder", "chip", "notes", "latency", "launch_latency", "network_latency"}


def from_builder(doc: Mapping[str, Any], known: Mapping[str, Topology] | None = None) -> Topology:
    """The topology a builder document describes (the module's text); errors name the field."""
    builder, name = doc.get("builder"), doc.get("name")
    if builder not in _BUILDERS:
        raise ExchangeError(f"unknown builder {show(builder)}; a machine file names one of {sorted(_BUILDERS)}, "
                            "or lists its routes as Topology.to_json() writes them.")
    if not isinstance(name, str) or not name:
        raise ExchangeError(f"a machine file needs a name (a non-empty string); got {show(name)}.")
    need = _BUILDERS[builder]
    missing = [k for k in need if k not in doc]
    extra = sorted(set(doc) - set(need) - _OPTIONAL)
    if missing or extra:
        raise ExchangeError(f"the {builder} builder takes {', '.join(need)} (and optionally "
                            f"{', '.join(sorted(_OPTIONAL - {'format', 'name', 'builder'}))}); got "
                            f"{'no ' + ', '.join(missing) if missing else ''}"
                            f"{' and ' if missing and extra else ''}{'unknown ' + ', '.join(extra) if extra else ''}.")
    chip = doc.get("chip", "")
    if not isinstance(chip, str):
        raise ExchangeError(f"chip must be the name of the machine whose GPUs these are; got {show(chip)}.")
    if builder == "nvswitch":
        return nvswitch(name, doc["gpus"], doc["link_bandwidth"], doc["hbm_bandwidth"], doc["memory_bytes"],
                        doc["peak_flops"], doc.get("latency", NVLINK_LATENCY),
                        doc.get("launch_latency", LAUNCH_LATENCY), chip)
    base_name = doc["base"]
    base = (REGISTERED if known is None else known).get(base_name) if isinstance(base_name, str) else None
    if base is None:
        raise ExchangeError(f"the rails builder's base must be a registered machine (known: {sorted(REGISTERED)}); "
                            f"got {show(base_name)}.")
    return rails(base, doc["nodes"], doc["nic_bandwidth"], doc.get("network_latency", NETWORK_LATENCY), name)
