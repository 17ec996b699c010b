"""Machines described by their builder's parameters, and the ones shipped as such files.

A topology file either lists every route (what :meth:`Topology.to_json` writes, and what a measuring
script produces) or names a *builder* and its parameters, which is how a machine's data sheet reads:

``nvswitch``
    ``gpus`` GPUs on one non-blocking switch: ``link_bandwidth`` bytes/s per GPU and direction.
``rails``
    ``nodes`` copies of the ``base`` machine (a registered name), every GPU with a NIC of its own
    (``nic_bandwidth`` bytes/s per direction, ``nic_out(i)``/``nic_in(i)``), rail-aligned: GPU ``j``
    of every node sits on rail ``j``.  A transfer between nodes on one rail draws from the source's
    NIC out and the destination's NIC in; across rails it first crosses the source node's own fabric
    to the GPU on the destination's rail and leaves through that GPU's NIC (what NCCL's PXN does),
    so it never crosses rails in the network.

Both take the GPU's ``hbm_bandwidth``, ``memory_bytes`` and ``peak_flops`` (``rails`` inherits the
base's) and an optional ``chip``: the machine whose calibration the GPUs use.  The shipped files are
in ``machines/`` beside this module; every one is registered under its name.

>>> from relational_tensors.machine.topology import get_topology
>>> t = get_topology("2x-hgx-h200-ib")
>>> t.route(0, 8).resources, t.route(0, 9).resources
(('nic_out(0)', 'nic_in(8)'), ('egress(0)', 'ingress(1)', 'nic_out(1)', 'nic_in(9)'))
>>> get_topology("h200-nvl72").gpu_machine, len(get_topology("gb200-nvl72").sites)
('hgx-h200', 72)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from relational_tensors.errors import ExchangeError
from relational_tensors.machine.topology import (
    LAUNCH_LATENCY,
    NETWORK_LATENCY,
    NVLINK_LATENCY,
    Route,
    Topology,
    _positive,
    node_copies,
    nvswitch,
    show,
)

__all__ = ["MACHINES", "from_builder", "rails", "shipped_machines"]

MACHINES = Path(__file__).resolve().parent / "machines"


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
    base = (known or {}).get(base_name) if isinstance(base_name, str) else None
    if base is None:  # a user's file, read after the registry is built
        from relational_tensors.machine.topology import get_topology

        base = get_topology(base_name)
    return rails(base, doc["nodes"], doc["nic_bandwidth"], doc.get("network_latency", NETWORK_LATENCY), name)


def shipped_machines(known: Mapping[str, Topology]) -> dict[str, Topology]:
    """Every machine file shipped in ``machines/``, by name (a rails file's base may be one of ``known``)."""
    out: dict[str, Topology] = {}
    for path in sorted(MACHINES.glob("*.json")):
        doc = json.loads(path.read_text())
        try:
            top = from_builder(doc, {**known, **out})
        except ExchangeError as e:
            raise ExchangeError(f"machine file {path.name!r}: {e}") from None
        out[top.name] = top
    return out
