"""The registry of named machines: the built-in topologies, and the machine files shipped in
``machines/`` beside this module (builder documents, see ``topology.from_builder``), every one
registered under its name; :func:`get_topology` resolves a name, a file or a ``Topology``.

>>> t = get_topology("2x-hgx-h200-ib")
>>> t.route(0, 8).resources, t.route(0, 9).resources
(('nic_out(0)', 'nic_in(8)'), ('egress(0)', 'ingress(1)', 'nic_out(1)', 'nic_in(9)'))
>>> get_topology("h200-nvl72").gpu_machine, len(get_topology("gb200-nvl72").sites)
('hgx-h200', 72)
>>> get_topology("dgx-a100", gpus=4).sites
(0, 1, 2, 3)
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from relational_tensors.core.numbers import is_integer
from relational_tensors.errors import ExchangeError
from relational_tensors.machine.topology import (
    GB,
    GIB,
    NVLINK_LATENCY,
    REGISTERED,
    Topology,
    dgx_v100,
    from_builder,
    multi_node,
    nvswitch,
    pcie_server,
    show,
)

__all__ = ["MACHINES", "TOPOLOGIES", "get_topology", "shipped_machines"]

MACHINES = Path(__file__).resolve().parent / "machines"


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
    reg.update(shipped_machines(reg))
    return reg


TOPOLOGIES: dict[str, Topology] = _registry()
REGISTERED.update(TOPOLOGIES)


def get_topology(name: str | Topology, gpus: int | None = None) -> Topology:
    """A registered topology (or the one given, or a JSON file), restricted to its first ``gpus`` sites;
    a switch topology asked for more GPUs than it has is widened to a larger switch of the same GPUs.

    >>> get_topology("dgx-h100", gpus=2).table().column("bandwidth").to_pylist()
    [450000000000.0, 450000000000.0]
    """
    known = f"known: {sorted(TOPOLOGIES)} (or build one with nvswitch(), multi_node() or Topology.from_json())"
    if isinstance(name, Topology):
        top = name
    elif isinstance(name, str) and name in TOPOLOGIES:
        top = TOPOLOGIES[name]
    elif isinstance(name, (str, os.PathLike)) and os.path.isdir(name):
        raise ExchangeError(f"topology {os.fspath(name)!r} is a directory, not a topology: give a registered "
                            f"name or the path of a topology JSON file; {known}.")
    elif isinstance(name, os.PathLike) or (isinstance(name, str) and name.endswith(".json")):
        if not os.path.exists(name):
            raise ExchangeError(f"no topology file {os.fspath(name)!r}: it does not exist; give a registered "
                                f"name or the path of an existing topology JSON file; {known}.")
        top = Topology.from_json(name)
    elif isinstance(name, str):
        raise ExchangeError(f"unknown topology {name!r}; {known}.")
    else:
        raise ExchangeError(f"a topology is a registered name, a Topology or the path of a topology JSON file; "
                            f"got {type(name).__name__} {show(name)}; {known}.")
    if gpus is not None and not is_integer(gpus):
        raise ExchangeError(f"gpus must be a whole number of GPUs (or None for all of them); got {show(gpus)}.")
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
                        switch[1], top.launch_latency, top.chip)
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
