"""Machines as data: the shipped machine files (a 72-GPU NVLink domain of two chips, HGX H200 nodes on
rails of InfiniBand), the builder documents they are written in, and plans priced on them."""

from __future__ import annotations

import numpy as np
import pytest

import relational_tensors as rt
from relational_tensors.errors import ExchangeError
from relational_tensors.machine.kernel_model import KernelModel
from relational_tensors.machine.machines import TOPOLOGIES, get_topology
from relational_tensors.machine.topology import Topology, from_builder, rails


def test_the_shipped_machines_are_registered_with_their_figures() -> None:
    gb, h = get_topology("gb200-nvl72"), get_topology("h200-nvl72")
    assert len(gb.sites) == len(h.sites) == 72
    assert gb.bandwidth(0, 71) == 900e9 and gb.hbm_bandwidth == 8e12 and gb.memory_bytes == 186_000_000_000
    assert gb.flops("bfloat16") == 2.5e15
    assert h.bandwidth(0, 71) == 450e9 and h.memory_bytes == 141 << 30 and h.flops("bfloat16") == 989e12
    assert len(get_topology("2x-hgx-h200-ib").sites) == 16 and len(get_topology("4x-hgx-h200-ib").sites) == 32
    assert len(get_topology("8x-hgx-h200-ib").sites) == 64


def test_a_domain_of_h200s_uses_the_h200_calibration_and_the_new_chip_none() -> None:
    h = KernelModel.from_calibration(get_topology("h200-nvl72"))
    assert h.source.endswith("hgx-h200.json")
    assert KernelModel.from_calibration(get_topology("4x-hgx-h200-ib")).source.endswith("hgx-h200.json")
    assert not KernelModel.from_calibration(get_topology("gb200-nvl72")).curves


@pytest.mark.parametrize("nodes", [2, 4])
def test_rails_give_every_gpu_its_own_nic_and_keep_traffic_on_its_rail(nodes: int) -> None:
    t = get_topology(f"{nodes}x-hgx-h200-ib")
    base = TOPOLOGIES["hgx-h200"]
    for s in t.sites:
        assert t.resources[f"nic_out({s})"] == t.resources[f"nic_in({s})"] == 50e9
        for d in t.sites:
            if s == d:
                continue
            route = t.route(s, d)
            if s // 8 == d // 8:  # inside a node: the node's own switch, renumbered
                assert route.resources == (f"egress({s})", f"ingress({d})")
                assert route.latency == base.route(0, 1).latency
            elif s % 8 == d % 8:  # one rail
                assert route.resources == (f"nic_out({s})", f"nic_in({d})")
            else:  # to the GPU of the destination's rail in the source node, then its NIC
                hop = s // 8 * 8 + d % 8
                assert route.resources == (f"egress({s})", f"ingress({hop})", f"nic_out({hop})", f"nic_in({d})")
            assert t.bandwidth(s, d) == (450e9 if s // 8 == d // 8 else 50e9)


def test_machine_files_round_trip_and_builder_documents_read() -> None:
    for name in ("gb200-nvl72", "2x-hgx-h200-ib"):
        t = get_topology(name)
        assert Topology.from_json(t.to_json()) == t
    doc = ('{"name": "mini", "builder": "rails", "base": "dgx-v100", "nodes": 2, "nic_bandwidth": 25e9, '
           '"network_latency": 5e-6}')
    t = Topology.from_json(doc)
    assert len(t.sites) == 16 and t.route(1, 9).resources == ("nic_out(1)", "nic_in(9)")
    assert t.route(8, 11).resources == ("nvlink(8->11)",)  # the base's own links, renumbered
    assert rails(get_topology("dgx-v100"), 2, 25e9, 5e-6, "mini") == t


@pytest.mark.parametrize("doc, words", [
    ({"name": "x", "builder": "torus"}, "unknown builder"),
    ({"name": "x", "builder": "rails", "base": "hgx-h200", "nodes": 2}, "no nic_bandwidth"),
    ({"name": "x", "builder": "rails", "base": "hgx-h200", "nodes": 2, "nic_bandwidth": 5e10, "nics": 8},
     "unknown nics"),
    ({"name": "x", "builder": "rails", "base": "hgx-h200", "nodes": 0, "nic_bandwidth": 5e10}, "nodes >= 1"),
    ({"name": "x", "builder": "rails", "base": "hgx-h200", "nodes": 2, "nic_bandwidth": -1}, "nic_bandwidth"),
    ({"name": "x", "builder": "rails", "base": "nowhere", "nodes": 2, "nic_bandwidth": 5e10},
     "base must be a registered machine"),
    ({"name": "", "builder": "nvswitch"}, "needs a name"),
    ({"name": "x", "builder": "nvswitch", "gpus": 4, "link_bandwidth": 1e9, "hbm_bandwidth": 1e12,
      "memory_bytes": 1 << 30, "peak_flops": {"float32": 1e13}, "chip": 3}, "chip"),
])
def test_a_bad_machine_document_is_refused_with_its_field(doc: dict, words: str) -> None:
    with pytest.raises(ExchangeError, match=words):
        from_builder(doc)


def test_a_plan_across_two_rail_joined_nodes_computes_the_reference() -> None:
    g = rt.Graph()
    x = g.input("x", [64, 96])
    h = g.unary(g.matmul(x, g.parameter("w1", [96, 80]), name="up"), "relu", name="act")
    g.save(g.matmul(h, g.parameter("w2", [80, 48]), name="down"), name="y")
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal(g.node(n).type.shape).astype(np.float32) for n in ("x", "w1", "w2")}
    cg = rt.compileGraph(g, device="cpu:16", topology="2x-hgx-h200-ib", cost_model="calibrated")
    np.testing.assert_allclose(cg.run(feeds)["y"], rt.reference(g, feeds)["y"], rtol=1e-4, atol=1e-4)
    assert cg.simulate() > 0


@pytest.mark.parametrize("device", ["cpu:²", "cpu:٣", "cuda:0,¹", "cpu:-1", "cpu:1.5", "tpu:2", "", 3.5, ["cpu"],
                                    True, "cpu:0", 0])
def test_a_device_of_another_form_is_refused_by_rule(device: object) -> None:
    from relational_tensors.machine.devices import parse_devices

    with pytest.raises(rt.PlanError, match="device"):
        parse_devices(device)
