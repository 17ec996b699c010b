"""The topology tables, the flow engine and the ExProg simulator, checked against times derived by hand.

Every expected time below is written out from the bandwidths of the topology:
a transfer of S bytes alone on a route costs latency + S / bandwidth, k flows
sharing one resource each get capacity / k, and aggregating m parts into one
block of S bytes moves (m + 1) * S bytes through the site's HBM.
"""

from __future__ import annotations

import math

import pytest

from relational_tensors.errors import ExchangeError
from relational_tensors.exchange.ast import Action, ExProg, InAtom, Partition, Requirement
from relational_tensors.exchange.closure import memberships
from relational_tensors.exchange.membership import MAX_EXHAUSTIVE, fastest_membership
from relational_tensors.exchange.simulator import SimResult, better, simulate
from relational_tensors.machine.flows import FlowNetwork
from relational_tensors.machine.machines import TOPOLOGIES, get_topology
from relational_tensors.machine.topology import DGX1V_LINKS, Topology, multi_node

GB = 1e9
# DGX-A100
LAT = 2e-6        # NVLink route latency
LINK = 300e9      # NVSwitch bandwidth per GPU and direction
HBM = 1555e9      # A100 HBM bandwidth
# DGX-V100
PCIE_LAT = 5e-6
NV1, NV2, BRIDGE = 25e9, 50e9, 15.75e9


A100, V100, H100 = get_topology("dgx-a100"), get_topology("dgx-v100"), get_topology("dgx-h100")
H100X2 = get_topology("2x-dgx-h100")


def agg(text: str) -> frozenset[str]:
    return frozenset(text.split("+"))


def act(x: str, source: int | str, *dests: int | str) -> Action:
    return Action(agg(x), source, tuple(dests))


def program(gpus: int, inputs: dict[str, int], outputs: dict[str, tuple[int | str, ...]], body: list[Action],
            partitions: tuple[Partition, ...] = (), size: int = int(GB)) -> ExProg:
    return ExProg(tuple(range(gpus)), partitions, tuple(InAtom(a, s, size) for a, s in inputs.items()),
                  tuple(Requirement(agg(x), t) for x, t in outputs.items()), frozenset(body))


def ends(r: SimResult, kind: str) -> list[float]:
    return [e.end for e in r.trace if e.kind == kind]


# ---------------------------------------------------------------- paper example (a): two GPUs, A+B at both


def test_swap_then_aggregate_on_both():
    # A @ 0 -> 1 and B @ 1 -> 0 start at once on disjoint endpoints (egress(0)+ingress(1),
    # egress(1)+ingress(0)): each runs alone at 300 GB/s, arriving at LAT + 1 GB / 300 GB/s.
    # Then A+B @ 0 and A+B @ 1 each read two parts and write one: 3 GB over their own HBM.
    p = program(2, {"A": 0, "B": 1}, {"A+B": (0, 1)},
                [act("A", 0, 1), act("B", 1, 0), act("A+B", 0), act("A+B", 1)])
    r = simulate(p, A100)
    assert r.valid
    assert r.time == pytest.approx(LAT + GB / LINK + 3 * GB / HBM)
    assert ends(r, "transfer") == pytest.approx([LAT + GB / LINK] * 2)
    assert sorted((e.site, e.bytes) for e in r.trace if e.kind == "aggregate") == [(0, 3 * GB), (1, 3 * GB)]
    assert all(e.dest is None for e in r.trace if e.kind == "aggregate")


def test_one_way_then_back():
    # A @ 0 -> 1: LAT + 1/300 s.  A+B @ 1 -> 0: aggregate at 1 (3 GB over HBM), which also
    # satisfies OUT at 1, then send the 1 GB result back: LAT + 1/300 s.  Strictly slower than the swap.
    p = program(2, {"A": 0, "B": 1}, {"A+B": (0, 1)}, [act("A", 0, 1), act("A+B", 1, 0)])
    r = simulate(p, A100)
    assert r.valid
    assert r.time == pytest.approx(2 * LAT + 2 * GB / LINK + 3 * GB / HBM)
    assert [e.kind for e in r.trace] == ["transfer", "aggregate", "transfer"]
    assert r.time > LAT + GB / LINK + 3 * GB / HBM


def test_partition_source_runs_at_every_site():
    # A+B @ G with G = {0, 1} is the two local aggregations of the swap program.
    p = program(2, {"A": 0, "B": 1}, {"A+B": ("G",)}, [act("A", 0, 1), act("B", 1, 0), act("A+B", "G")],
                partitions=(Partition("G", 2, (0, 1)),))
    r = simulate(p, A100)
    assert r.valid and r.time == pytest.approx(LAT + GB / LINK + 3 * GB / HBM)
    assert r.membership == {"G": (0, 1)}


# ---------------------------------------------------------------- paper example (b): four GPUs, the total at all


FOUR = {"A": 0, "B": 1, "C": 2, "D": 3}
TOTAL = {"A+B+C+D": (0, 1, 2, 3)}


def test_reduce_then_multicast():
    # Gather: B, C, D all enter GPU 0, so ingress(0) is shared three ways: 100 GB/s each,
    # all three arrive at LAT + 3 GB / 300 GB/s.  Aggregate 4 parts at 0: 5 GB over HBM.
    # Multicast to 1, 2, 3: three flows share egress(0), 100 GB/s each: LAT + 3 GB / 300 GB/s.
    p = program(4, FOUR, TOTAL,
                [act("B", 1, 0), act("C", 2, 0), act("D", 3, 0), act("A+B+C+D", 0, 1, 2, 3)])
    r = simulate(p, A100)
    assert r.valid
    assert r.time == pytest.approx(2 * LAT + 6 * GB / LINK + 5 * GB / HBM)
    gather = [e for e in r.trace if e.kind == "transfer" and e.dest == 0]
    assert [e.end for e in gather] == pytest.approx([LAT + 3 * GB / LINK] * 3)
    multicast = [e for e in r.trace if e.kind == "transfer" and e.site == 0]
    assert [e.end - e.start for e in multicast] == pytest.approx([LAT + GB / (LINK / 3)] * 3)


def test_tree_beats_reduce_then_multicast():
    # Step 1: A 0->1 and C 2->3 in parallel: LAT + 1/300.  Step 2: A+B at 1 and C+D at 3 (3 GB each
    # over separate HBMs), then swapped 1<->3 on disjoint endpoints: LAT + 1/300.  Step 3: A+B+C+D at
    # 1 and at 3 from two parts (3 GB over HBM), then 1->0 and 3->2: LAT + 1/300.
    tree = program(4, FOUR, TOTAL,
                   [act("A", 0, 1), act("C", 2, 3), act("A+B", 1, 3), act("C+D", 3, 1),
                    act("A+B+C+D", 1, 0), act("A+B+C+D", 3, 2)])
    star = program(4, FOUR, TOTAL,
                   [act("B", 1, 0), act("C", 2, 0), act("D", 3, 0), act("A+B+C+D", 0, 1, 2, 3)])
    t_tree = simulate(tree, A100)
    t_star = simulate(star, A100)
    assert t_tree.valid
    assert t_tree.time == pytest.approx(3 * LAT + 3 * GB / LINK + 6 * GB / HBM)
    assert t_tree.time < t_star.time
    assert [e.bytes for e in t_tree.trace if e.kind == "aggregate"] == [3 * GB] * 4


# ---------------------------------------------------------------- paper example (c): partitions by size


def split_program() -> ExProg:
    # X lives on 7 and must reach all of G1; Y lives on 0 and must reach all of G2.
    return program(8, {"X": 7, "Y": 0}, {"X": ("G1",), "Y": ("G2",)}, [act("X", 7, "G1"), act("Y", 0, "G2")],
                   partitions=(Partition("G1", 4), Partition("G2", 4)))


def test_membership_enumeration():
    ms = list(memberships(split_program()))
    assert len(ms) == math.comb(8, 4)
    assert ms[0] == {"G1": (0, 1, 2, 3), "G2": (4, 5, 6, 7)}
    assert all(not set(m["G1"]) & set(m["G2"]) for m in ms)


def test_simulator_picks_membership():
    # With 7 in G1 and 0 in G2 each multicast skips its own source: 3 flows share one egress,
    # 100 GB/s each, every destination's ingress is used once: LAT + 3 GB / 300 GB/s.  The first such
    # choice in combination order is G1 = (1, 2, 3, 7).
    r = fastest_membership(split_program(), A100)
    assert r.valid
    assert r.membership == {"G1": (1, 2, 3, 7), "G2": (0, 4, 5, 6)}
    assert r.time == pytest.approx(LAT + 3 * GB / LINK)
    assert r.search == "exhaustive"
    # The plain split puts 7 in G2 and 0 in G1: four flows on each egress, 75 GB/s each.
    plain = simulate(split_program(), A100, {"G1": (0, 1, 2, 3), "G2": (4, 5, 6, 7)})
    assert plain.valid and plain.time == pytest.approx(LAT + 4 * GB / LINK)
    assert plain.membership == {"G1": (0, 1, 2, 3), "G2": (4, 5, 6, 7)}


def test_local_search_when_too_many_memberships():
    # Eight partitions of one GPU over eight: 8! = 40320 choices, more than MAX_EXHAUSTIVE, so a local
    # search runs.  Atom Aj lives on 7 - j and Pj needs it.  The first choice (Pj = j) moves all eight
    # atoms at once on disjoint endpoints (LAT + 1/300 s); each swap that puts Pj on 7 - j turns two
    # transfers into nothing, and four swaps reach the optimum: no transfer at all.
    parts = tuple(Partition(f"P{j}", 1) for j in range(8))
    p = program(8, {f"A{j}": 7 - j for j in range(8)}, {f"A{j}": (f"P{j}",) for j in range(8)},
                [act(f"A{j}", 7 - j, f"P{j}") for j in range(8)], partitions=parts)
    assert math.factorial(8) > MAX_EXHAUSTIVE
    r = fastest_membership(p, A100)
    assert r.valid and r.search == "local"
    assert r.time == 0.0 and r.trace == ()
    assert r.membership == {f"P{j}": (7 - j,) for j in range(8)}
    first = simulate(p, A100, {f"P{j}": (j,) for j in range(8)})
    assert first.search == "fixed" and first.time == pytest.approx(LAT + GB / LINK)


def test_membership_errors():
    p = split_program()
    with pytest.raises(ExchangeError, match="G2"):
        simulate(p, A100, {"G1": (0, 1, 2, 3)})
    with pytest.raises(ExchangeError, match="disjoint"):
        simulate(p, A100, {"G1": (0, 1, 2, 3), "G2": (3, 4, 5, 6)})
    with pytest.raises(ExchangeError, match="no membership"):
        fastest_membership(program(2, {"A": 0}, {"A": ("G",)}, [], partitions=(Partition("G", 3),)), A100)
    with pytest.raises(ExchangeError, match="fastest_membership"):  # simulate runs a membership, never searches
        simulate(p, A100)


def test_the_topology_is_a_topology_not_a_name():
    with pytest.raises(ExchangeError, match=r"simulate takes a Topology; got the str 'dgx-a100'.*get_topology"):
        simulate(split_program(), "dgx-a100", {"G1": (0, 1, 2, 3), "G2": (4, 5, 6, 7)})  # type: ignore[arg-type]
    with pytest.raises(ExchangeError, match="fastest_membership takes a Topology"):
        fastest_membership(split_program(), "dgx-a100")  # type: ignore[arg-type]


def test_better_is_valid_then_faster_then_less_busy_and_keeps_the_first_on_ties():
    # the same transfer alone (one run), beside a second one (slower), and relayed (as fast, busier)
    alone = simulate(program(3, {"A": 0}, {"A": (1,)}, [act("A", 0, 1)]), A100)
    crowded = simulate(program(3, {"A": 0, "B": 0}, {"A": (1,), "B": (2,)}, [act("A", 0, 1), act("B", 0, 2)]), A100)
    invalid = simulate(program(3, {"A": 0}, {"A": (1,)}, []), A100)
    assert crowded.time > alone.time and not invalid.valid and invalid.time < alone.time
    assert better(None, invalid)
    assert better(invalid, crowded) and not better(crowded, invalid)  # valid first, however slow
    assert better(crowded, alone) and not better(alone, crowded)      # then faster
    assert not better(alone, alone)                                   # a tie keeps the first
    busier = SimResult(alone.time, alone.trace * 2, alone.membership, True)
    hair = SimResult(alone.time * (1 + 1e-12), (), alone.membership, True)
    assert better(busier, alone) and not better(alone, busier)        # as fast: less summed stage time wins
    assert not better(busier, hair)   # a hair slower never wins, however idle
    assert not better(hair, alone)    # and a hair faster (under TIME_TOL) is no faster: busier, it loses


# ---------------------------------------------------------------- DGX-V100


def v100(body: list[Action], inputs: dict[str, int], outputs: dict[str, tuple[int, ...]]) -> SimResult:
    return simulate(program(8, inputs, outputs, body), V100)


def test_v100_unlinked_pair_uses_bridge():
    r = v100([act("A", 0, 5)], {"A": 0}, {"A": (5,)})
    assert r.time == pytest.approx(PCIE_LAT + GB / BRIDGE)


def test_v100_bridge_is_shared():
    # 0-5 and 1-4 have no NVLink: both transfers share the one 15.75 GB/s bridge, 7.875 GB/s each.
    r = v100([act("A", 0, 5), act("B", 1, 4)], {"A": 0, "B": 1}, {"A": (5,), "B": (4,)})
    assert ends(r, "transfer") == pytest.approx([PCIE_LAT + GB / (BRIDGE / 2)] * 2)


def test_v100_double_link_twice_as_fast():
    nv2 = v100([act("A", 0, 3)], {"A": 0}, {"A": (3,)})  # 0-3: NV2, 50 GB/s
    nv1 = v100([act("A", 0, 1)], {"A": 0}, {"A": (1,)})  # 0-1: NV1, 25 GB/s
    assert nv2.time == pytest.approx(LAT + GB / NV2)
    assert nv1.time == pytest.approx(LAT + GB / NV1)
    assert nv1.time - LAT == pytest.approx(2 * (nv2.time - LAT))


def test_v100_relay_beats_bridge():
    # 0 -> 4 (NV2) then 4 -> 5 (NV1): 2 LAT + 1/50 + 1/25 s, against LAT_PCIE + 1/15.75 s direct.
    relay = v100([act("A", 0, 4), act("A", 4, 5)], {"A": 0}, {"A": (5,)})
    direct = v100([act("A", 0, 5)], {"A": 0}, {"A": (5,)})
    assert relay.time == pytest.approx(2 * LAT + GB / NV2 + GB / NV1)
    assert relay.time < direct.time


# ---------------------------------------------------------------- contention and sharing


def test_multicast_shares_source_egress():
    # Fused or split into three actions, three flows leave GPU 0 together: 100 GB/s each.
    fused = simulate(program(4, {"A": 0}, {"A": (1, 2, 3)}, [act("A", 0, 1, 2, 3)]), A100)
    split = simulate(program(4, {"A": 0}, {"A": (1, 2, 3)}, [act("A", 0, d) for d in (1, 2, 3)]), A100)
    for r in (fused, split):
        assert r.valid
        assert ends(r, "transfer") == pytest.approx([LAT + GB / (LINK / 3)] * 3)
    single = simulate(program(4, {"A": 0}, {"A": (1,)}, [act("A", 0, 1)]), A100)
    assert single.time == pytest.approx(LAT + GB / LINK)


def test_aggregations_share_hbm_and_are_not_repeated():
    # Two different 2-part aggregations at GPU 0 share hbm(0): 3 GB + 3 GB at 1555 GB/s.
    p = program(1, {"A": 0, "B": 0, "C": 0, "D": 0}, {"A+B": (0,), "C+D": (0,)}, [act("A+B", 0), act("C+D", 0)])
    r = simulate(p, A100)
    assert ends(r, "aggregate") == pytest.approx([6 * GB / HBM] * 2)
    # A+B @ 0 -> 1 and A+B @ 0 -> 2 aggregate once, then both send.
    q = program(3, {"A": 0, "B": 0}, {"A+B": (1, 2)}, [act("A+B", 0, 1), act("A+B", 0, 2)])
    r = simulate(q, A100)
    assert len([e for e in r.trace if e.kind == "aggregate"]) == 1
    assert r.time == pytest.approx(3 * GB / HBM + LAT + 2 * GB / LINK)


def test_atom_size_scales_time():
    p = program(2, {"A": 0}, {"A": (1,)}, [act("A", 0, 1)], size=256 << 20)
    assert simulate(p, H100).time == pytest.approx(LAT + (256 << 20) / 450e9)
    assert simulate(program(2, {"A": 0}, {"A": (1,)}, [act("A", 0, 1)], size=0), A100).time == \
        pytest.approx(LAT)


def test_multi_node_network_is_shared_per_node():
    # 0 -> 8 crosses node_out[0] and node_in[1] at 50 GB/s with the 10 us network latency; two
    # transfers from node 0 to node 1 share node_out[0]: 25 GB/s each.
    one = simulate(program(16, {"A": 0}, {"A": (8,)}, [act("A", 0, 8)]), H100X2)
    assert one.time == pytest.approx(10e-6 + GB / 50e9)
    two = simulate(program(16, {"A": 0, "B": 1}, {"A": (8,), "B": (9,)}, [act("A", 0, 8), act("B", 1, 9)]),
                   H100X2)
    assert ends(two, "transfer") == pytest.approx([10e-6 + GB / 25e9] * 2)
    inside = simulate(program(16, {"A": 8}, {"A": (9,)}, [act("A", 8, 9)]), H100X2)
    assert inside.time == pytest.approx(LAT + GB / 450e9)


# ---------------------------------------------------------------- validity and errors


def test_invalid_program_reports_invalid():
    # C is nowhere, so A+C @ 0 never becomes eligible and OUT at 1 never holds.
    p = program(2, {"A": 0, "B": 1}, {"A+B": (1,)}, [act("A+C", 0, 1)])
    r = simulate(p, A100)
    assert not r.valid
    assert r.unfired == ((act("A+C", 0, 1), 0),)
    assert r.unmet == ((agg("A+B"), 1),)
    assert r.time == 0.0 and r.trace == ()
    # Every action fires, but OUT asks for something nobody sends.
    q = program(2, {"A": 0, "B": 1}, {"A+B": (0, 1)}, [act("A", 0, 1), act("A+B", 1)])
    r = simulate(q, A100)
    assert not r.valid and r.unfired == () and r.unmet == ((agg("A+B"), 0),)


def test_program_errors():
    with pytest.raises(ExchangeError, match="lacks"):
        simulate(program(9, {"A": 0}, {"A": (8,)}, [act("A", 0, 8)]), A100)
    with pytest.raises(ExchangeError, match="not in GPUS"):
        simulate(program(2, {"A": 0}, {"A": (3,)}, [act("A", 0, 3)]), A100)
    with pytest.raises(ExchangeError, match="PARTITIONS"):
        simulate(program(2, {"A": 0}, {"A": (1,)}, [act("A", 0, "G")]), A100)
    with pytest.raises(ExchangeError, match="one size"):
        p = ExProg((0, 1), (), (InAtom("A", 0, 10), InAtom("B", 1, 20)), (), frozenset({act("A+B", 0)}))
        simulate(p, A100)


# ---------------------------------------------------------------- flow engine


def drain(net: FlowNetwork) -> list[tuple[float, object]]:
    out = []
    while (t := net.next_completion()) is not None:
        out += [(t, k) for k in net.advance_to(t)]
    return out


def test_max_min_fairness():
    # r1 (10) carries a and b; r2 (20) carries b and c.  r1 saturates first at 5 each,
    # then c takes what b leaves on r2: 15.
    net = FlowNetwork({"r1": 10.0, "r2": 20.0})
    net.start("a", ("r1",), 100.0, 0.0)
    net.start("b", ("r1", "r2"), 100.0, 0.0)
    net.start("c", ("r2",), 100.0, 0.0)
    assert net.active() == pytest.approx({"a": 5.0, "b": 5.0, "c": 15.0})


def test_rate_cap_leaves_the_rest_to_others():
    net = FlowNetwork({"r": 10.0})
    net.start("slow", ("r",), 10.0, 0.0, cap=2.0)
    net.start("fast", ("r",), 10.0, 0.0)
    assert net.active() == pytest.approx({"slow": 2.0, "fast": 8.0})
    # fast ends at 10/8; then slow stays at its cap: 10 - 2.5 = 7.5 bytes at 2 B/s.
    assert drain(net) == [(pytest.approx(1.25), "fast"), (pytest.approx(1.25 + 3.75), "slow")]


def test_rates_recomputed_on_finish_and_start():
    net = FlowNetwork({"r": 10.0})
    net.start("a", ("r",), 10.0, 0.0)
    net.start("b", ("r",), 30.0, 0.0)
    assert net.next_completion() == pytest.approx(2.0)
    assert net.advance_to(1.0) == []
    net.start("c", ("r",), 5.0, 1.0)  # now three share r: a has 5 left, b 25, c 5
    assert net.active() == pytest.approx({"a": 10 / 3, "b": 10 / 3, "c": 10 / 3})
    # a and c end at 1 + 5 / (10/3) = 2.5; b has 25 - 5 = 20 left, alone at 10 B/s: 4.5.
    assert drain(net) == [(pytest.approx(2.5), "a"), (pytest.approx(2.5), "c"), (pytest.approx(4.5), "b")]


def test_latency_and_zero_byte_flows():
    net = FlowNetwork({"r": 10.0})
    net.start("late", ("r",), 10.0, 0.0, latency=1.0)  # draws nothing before t = 1
    net.start("now", ("r",), 10.0, 0.0)
    net.start("ping", ("r",), 0.0, 0.0, latency=0.5)
    assert net.active() == {"late": 0.0, "now": 10.0, "ping": 0.0}
    assert drain(net) == [(pytest.approx(0.5), "ping"), (pytest.approx(1.0), "now"), (pytest.approx(2.0), "late")]
    assert net.next_completion() is None and len(net) == 0


def test_flow_errors():
    net = FlowNetwork({"r": 1.0})
    with pytest.raises(ExchangeError, match="unknown resources"):
        net.start("a", ("nope",), 1.0, 0.0)
    net.start("a", ("r",), 1.0, 0.0)
    with pytest.raises(ExchangeError, match="already"):
        net.start("a", ("r",), 1.0, 0.0)
    with pytest.raises(ExchangeError, match="clock"):
        net.start("b", ("r",), 1.0, 5.0)
    with pytest.raises(ExchangeError, match="positive capacity"):
        FlowNetwork({"r": 0.0})


def test_a_flow_starts_at_an_event_time_the_clock_passed_within_its_slack():
    # a flow ends at 2 µs and another one's latency is over 0.5 ps later: advance_to(2 µs) takes both
    # events and leaves the clock at the second; a flow started at 2 µs is the same instant (the
    # exchange simulator does this; it raised before)
    net = FlowNetwork({"r1": 1e6, "r2": 1e6})
    net.start("a", ("r1",), 2.0, 0.0)
    net.start("b", ("r2",), 1.0, 0.0, latency=2.0000005e-6)
    t = net.next_completion()
    assert t == 2e-6 and net.advance_to(t) == ["a"] and net.now > t
    net.start("c", ("r1",), 0.5, t)
    assert net.advance_to(4e-6) == ["c", "b"]


# ---------------------------------------------------------------- topology tables


def test_v100_table():
    top = get_topology("dgx-v100")
    res = top.resource_table().to_pylist()
    nvlinks = [r for r in res if r["kind"] == "nvlink"]
    assert len(DGX1V_LINKS) == 16 and len(nvlinks) == 16 * 2
    assert sorted({r["capacity"] for r in nvlinks}) == [NV1, NV2]
    assert [r["capacity"] for r in res if r["kind"] == "pcie-bridge"] == [BRIDGE]
    assert [r["capacity"] for r in res if r["kind"] == "hbm"] == [900e9] * 8
    links = top.table().to_pylist()
    assert len(links) == 8 * 7
    linked = {frozenset((a, b)) for a, b, _ in DGX1V_LINKS}
    for row in links:
        if frozenset((row["src"], row["dst"])) in linked:
            assert row["resources"] == [f"nvlink({row['src']}->{row['dst']})"]
            assert row["latency"] == pytest.approx(LAT)
        else:
            assert row["resources"] == ["pcie-bridge"]
            assert row["bandwidth"] == BRIDGE and row["latency"] == pytest.approx(PCIE_LAT)
    assert sum(r["resources"] == ["pcie-bridge"] for r in links) == 2 * (28 - 16)
    bricks = {}
    for a, b, n in DGX1V_LINKS:
        bricks[a] = bricks.get(a, 0) + n
        bricks[b] = bricks.get(b, 0) + n
    assert bricks == {g: 6 for g in range(8)}  # each V100 has six NVLink bricks


def test_registry_numbers():
    a100 = get_topology("dgx-a100")
    assert a100.sites == tuple(range(8))
    assert a100.table().column("bandwidth").to_pylist() == [LINK] * 56
    assert a100.route(2, 5).resources == ("egress(2)", "ingress(5)")
    assert a100.hbm_bandwidth == HBM and a100.flops("float16") == 312e12 and a100.flops("tf32") == 156e12
    assert get_topology("dgx-h100").hbm_bandwidth == 3350e9
    assert get_topology("hgx-h200").hbm_bandwidth == 4800e9
    assert get_topology("hgx-h200").flops("bfloat16") == 989e12
    assert get_topology("dgx-v100").flops("float16") == 125e12
    with pytest.raises(ExchangeError, match="float8"):
        a100.flops("float8")
    pcie = get_topology("pcie")
    assert pcie.route(0, 1).resources == ("egress(0)", "host-bridge", "ingress(1)")
    assert pcie.route(0, 1).latency == pytest.approx(PCIE_LAT)
    assert a100.route(3, 3).resources == ()
    assert "2x-dgx-h100" in TOPOLOGIES and len(get_topology("2x-dgx-h100").sites) == 16


def test_get_topology_shrinks_and_errors():
    four = get_topology("dgx-a100", gpus=4)
    assert four.sites == (0, 1, 2, 3) and len(four.table()) == 12
    assert set(four.resources) == {f"{k}({i})" for i in range(4) for k in ("egress", "ingress")}
    with pytest.raises(ExchangeError, match="dgx-a100"):
        get_topology("dgx-a1000")
    with pytest.raises(ExchangeError, match="'dgx-v100' has 8 GPUs and no switch to widen; got gpus=9"):
        get_topology("dgx-v100", gpus=9)
    wide = get_topology("dgx-a100", gpus=12)  # a switch: the same GPUs on a larger switch
    assert wide.sites == tuple(range(12)) and wide.name == "dgx-a100"
    assert wide.bandwidth(0, 11) == get_topology("dgx-a100").bandwidth(0, 7)
    assert wide.route(3, 10).latency == get_topology("dgx-a100").route(3, 4).latency
    with pytest.raises(ExchangeError, match="not in topology"):
        four.route(0, 5)


def test_multi_node_of_v100_renames_per_server_resources():
    t = multi_node(get_topology("dgx-v100"), 2, 12.5e9)
    assert t.route(8, 11).resources == ("nvlink(8->11)",)
    assert t.route(8, 13).resources == ("pcie-bridge[node 1]",)
    assert t.route(0, 8).resources == ("node_out[0]", "node_in[1]")
    assert t.name == "2x-dgx-v100"


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
def test_json_round_trip(name, tmp_path):
    top = TOPOLOGIES[name]
    again = Topology.from_json(top.to_json())
    assert again == top and hash(again) == hash(top)
    path = tmp_path / "topology.json"
    path.write_text(top.to_json())
    assert Topology.from_json(path) == top


def test_topology_checks_its_data():
    good = get_topology("dgx-a100", gpus=2)
    routes = dict(good.routes)
    del routes[(1, 0)]
    with pytest.raises(ExchangeError, match="no route"):
        Topology("broken", (0, 1), 1e12, 1, {}, 0.0, good.resources, routes)
    with pytest.raises(ExchangeError, match="unknown resources"):
        Topology("broken", (0, 1), 1e12, 1, {}, 0.0, {}, good.routes)
    with pytest.raises(ExchangeError, match="topology file"):
        Topology.from_json('{"name": "x"}')


def test_simulator_and_closure_agree_on_partition_sources() -> None:
    from relational_tensors.exchange.closure import is_valid
    from relational_tensors.exchange.text import parse

    prog = parse("GPUS: 0, 1\nPARTITIONS: G {0, 1}\nIN: A @ 0\nOUT: A @ 1\nA @ G -> 1")
    assert simulate(prog, get_topology("dgx-a100", gpus=2)).valid == is_valid(prog)
