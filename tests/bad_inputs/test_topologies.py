"""Machine descriptions: a bad topology, calibration file or topology name is refused with an ExchangeError
that names the field, never a hang, a wrong time or a raw Python exception.

Each case is a reproducer: before the mechanism it names was fixed it hung (a NaN peak rate looped the
whole-plan simulator forever), raised a raw AssertionError/TypeError/KeyError/RecursionError, or let a
non-finite number through.  A case that could hang runs under ``_deadline`` so that a regression fails
instead of stalling the suite."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_cli import MLP

import relational_tensors as rt
from relational_tensors.machine.flows import FlowNetwork
from relational_tensors.machine.kernel_model import KernelModel
from relational_tensors.machine.machines import get_topology
from relational_tensors.machine.topology import Route, Topology, multi_node, nvswitch, pcie_server

NAN, INF = math.nan, math.inf
FLOPS = {"float32": 1e12}


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Fail (TimeoutError) instead of hanging when the body runs past ``seconds``."""
    if not hasattr(signal, "setitimer"):  # pragma: no cover - not on this platform
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"hung: still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _switch(**kw: Any) -> Topology:
    args: dict[str, Any] = {"link_bandwidth": 1e9, "hbm_bandwidth": 1e12, "memory_bytes": 1 << 30,
                            "peak_flops": FLOPS}
    return nvswitch("t", 2, **{**args, **kw})


def _graph() -> rt.Graph:
    """Two matmuls over two devices: the plan has copies, so the flow engine runs."""
    g = rt.Graph()
    x = g.input("x", [64, 32])
    w1, w2 = g.parameter("w1", [32, 64]), g.parameter("w2", [64, 32])
    h = g.unary(g.matmul(x, w1, name="up"), "relu", name="act")
    g.save(g.matmul(h, w2, name="down"), name="y")
    return g


@pytest.fixture(scope="module")
def compiled() -> rt.CompiledGraph:
    return rt.compileGraph(_graph(), device="cpu:2", topology="dgx-a100")


def _doc(**changes: Any) -> dict[str, Any]:
    """A valid two-GPU topology file as a dict, with ``changes`` applied at top level."""
    doc = json.loads(_switch().to_json())
    doc.update(changes)
    return doc


# ------------------------------------------------------------------------------ the Topology constructor


SCALARS = [  # (field, bad value, words of the message)
    ("hbm_bandwidth", NAN, "finite"), ("hbm_bandwidth", INF, "finite"), ("hbm_bandwidth", 0.0, "> 0"),
    ("hbm_bandwidth", -1e12, "> 0"), ("hbm_bandwidth", "1e12", "number"), ("hbm_bandwidth", True, "number"),
    ("hbm_bandwidth", None, "number"),
    ("memory_bytes", NAN, "integer"), ("memory_bytes", INF, "integer"), ("memory_bytes", 0, ">= 1"),
    ("memory_bytes", -8, ">= 1"), ("memory_bytes", 1.5, "integer"), ("memory_bytes", "8", "integer"),
    ("memory_bytes", True, "integer"),
    ("launch_latency", NAN, "finite"), ("launch_latency", INF, "finite"), ("launch_latency", -1e-6, ">= 0"),
    ("launch_latency", "4e-6", "number"), ("launch_latency", False, "number"),
]


@pytest.mark.parametrize("name, value, words", SCALARS)
def test_scalar_fields_must_be_finite_numbers_in_range(name: str, value: Any, words: str) -> None:
    with pytest.raises(rt.ExchangeError, match=name) as e:
        dataclasses.replace(_switch(), **{name: value})
    assert words in str(e.value) and "got" in str(e.value)


@pytest.mark.parametrize("flops, words", [
    ({"float32": NAN}, "finite"), ({"float32": INF}, "finite"), ({"float32": 0.0}, "> 0"),
    ({"float16": 1e12, "float32": -1.0}, "> 0"), ({"float32": "1e12"}, "number"), ({"float32": None}, "number"),
    ({"float32": True}, "number"), ({"": 1e12}, "non-empty string"), ({3: 1e12}, "non-empty string"),
    ({}, "at least one"), ([("float32", 1e12)], "mapping"),
])
def test_peak_flops_are_finite_positive_rates_of_named_dtypes(flops: Any, words: str) -> None:
    with pytest.raises(rt.ExchangeError, match="peak_flops") as e:
        _switch(peak_flops=flops)
    assert words in str(e.value)


def test_an_empty_peak_flops_names_the_fix() -> None:
    with pytest.raises(rt.ExchangeError, match=r"peak_flops needs at least one dtype.*got \{\}.*float32"):
        _switch(peak_flops={})


@pytest.mark.parametrize("capacity, words", [(NAN, "finite"), (INF, "finite"), (0.0, "> 0"), (-5.0, "> 0"),
                                             ("fast", "number"), (True, "number")])
def test_resource_capacities_are_finite_and_positive(capacity: Any, words: str) -> None:
    top = _switch()
    with pytest.raises(rt.ExchangeError, match=r"resources\['egress\(0\)'\]") as e:
        dataclasses.replace(top, resources={**top.resources, "egress(0)": capacity})
    assert words in str(e.value)


def test_an_infinite_capacity_says_how_to_model_an_uncontended_link() -> None:
    with pytest.raises(rt.ExchangeError, match="route with no resources"):
        _switch(link_bandwidth=INF)


@pytest.mark.parametrize("latency, words", [(NAN, "finite"), (INF, "finite"), (-1e-6, ">= 0"),
                                            ("2e-6", "number"), (None, "number")])
def test_route_latencies_are_finite_and_not_negative(latency: Any, words: str) -> None:
    top = _switch()
    routes = {**top.routes, (0, 1): Route(top.routes[(0, 1)].resources, latency)}
    with pytest.raises(rt.ExchangeError, match=r"routes\[0->1\]\.latency") as e:
        dataclasses.replace(top, routes=routes)
    assert words in str(e.value)


@pytest.mark.parametrize("routes, words", [
    ({(0, 1): ("egress(0)",), (1, 0): Route((), 0.0)}, "Route"),
    ({(0, 1): Route("egress(0)", 0.0), (1, 0): Route((), 0.0)}, "resource names"),  # type: ignore[arg-type]
    ({(0, 1): Route((7,), 0.0), (1, 0): Route((), 0.0)}, "resource names"),  # type: ignore[arg-type]
    ({"0->1": Route((), 0.0), (1, 0): Route((), 0.0)}, "(src, dst)"),
    ({(0.0, 1.0): Route((), 0.0), (1, 0): Route((), 0.0)}, "(src, dst)"),
    ([Route((), 0.0)], "mapping"),
])
def test_routes_have_the_shape_of_routes(routes: Any, words: str) -> None:
    with pytest.raises(rt.ExchangeError, match="route") as e:
        dataclasses.replace(_switch(), routes=routes)
    assert words in str(e.value)


@pytest.mark.parametrize("sites, words", [(("0", "1"), "integer"), ((0.0, 1.0), "integer"), ((True, False), "integer"),
                                          ((-1, 0), ">= 0"), (2, "sequence"), ("01", "sequence"), ((), "distinct"),
                                          ((0, 0), "distinct")])
def test_sites_are_distinct_non_negative_integers(sites: Any, words: str) -> None:
    with pytest.raises(rt.ExchangeError, match="site") as e:
        Topology("t", sites, 1e12, 1 << 30, FLOPS, 0.0, {}, {})
    assert words in str(e.value)


@pytest.mark.parametrize("name", ["", None, 3])
def test_a_topology_is_named(name: Any) -> None:
    with pytest.raises(rt.ExchangeError, match="name must be a non-empty string"):
        Topology(name, (0,), 1e12, 1 << 30, FLOPS, 0.0, {}, {})


def test_integral_memory_is_stored_as_an_int_and_good_data_still_builds() -> None:
    top = dataclasses.replace(_switch(), memory_bytes=8e10)  # 8e10 in a JSON file is an integer
    assert top.memory_bytes == 80_000_000_000 and isinstance(top.memory_bytes, int)
    assert Topology("one", (0,), 1e12, 1, FLOPS, 0.0, {}, {}).sites == (0,)


_FIELDS = ["hbm_bandwidth", "memory_bytes", "launch_latency", "peak_flops", "resources", "latency"]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(where=st.sampled_from(_FIELDS),
       value=st.one_of(st.sampled_from([NAN, INF, -INF]), st.floats(max_value=-1e-300, allow_nan=False)))
def test_any_non_finite_or_negative_number_in_any_field_is_refused(where: str, value: float) -> None:
    top = _switch()
    if where in ("hbm_bandwidth", "memory_bytes", "launch_latency"):
        change: dict[str, Any] = {where: value}
        field = where
    elif where == "peak_flops":
        change, field = {"peak_flops": {"float16": 1e12, "float32": value}}, "peak_flops['float32']"
    elif where == "resources":
        change, field = {"resources": {**top.resources, "ingress(1)": value}}, "resources['ingress(1)']"
    else:
        route = top.routes[(1, 0)]
        change, field = {"routes": {**top.routes, (1, 0): Route(route.resources, value)}}, "routes[1->0].latency"
    with pytest.raises(rt.ExchangeError) as e:
        dataclasses.replace(top, **change)
    assert field in str(e.value) and "got" in str(e.value)


@pytest.mark.parametrize("build, words", [
    (lambda: nvswitch("t", 0, 1e9, 1e12, 1 << 30, FLOPS), "gpus"),
    (lambda: nvswitch("t", 2.5, 1e9, 1e12, 1 << 30, FLOPS), "gpus"),  # type: ignore[arg-type]
    (lambda: pcie_server("t", True, 1e9, 1e9, 1e12, 1 << 30, FLOPS), "gpus"),
    (lambda: multi_node(get_topology("dgx-a100"), 0, 50e9), "nodes"),
    (lambda: multi_node(get_topology("dgx-a100"), 1.5, 50e9), "nodes"),  # type: ignore[arg-type]
    (lambda: multi_node(get_topology("dgx-a100"), 2, NAN), "network_bandwidth"),
    (lambda: multi_node(get_topology("dgx-a100"), 2, INF), "network_bandwidth"),
    (lambda: multi_node(get_topology("dgx-a100"), 2, 50e9, network_latency=NAN), "network_latency"),
    (lambda: multi_node(get_topology("dgx-a100"), 2, 50e9, network_latency=-1.0), "network_latency"),
])
def test_builders_name_their_bad_argument(build: Any, words: str) -> None:
    with pytest.raises(rt.ExchangeError, match=words):
        build()


# ------------------------------------------------------------------------------ the flow engine


@pytest.mark.parametrize("capacity", [NAN, INF, 0.0, -1.0])
def test_flow_network_capacities_are_finite_and_positive(capacity: float) -> None:
    with pytest.raises(rt.ExchangeError, match="finite positive capacity"):
        FlowNetwork({"r": capacity})


@pytest.mark.parametrize("kw, words", [({"nbytes": NAN}, "nbytes"), ({"nbytes": INF}, "nbytes"),
                                       ({"latency": NAN}, "latency"), ({"latency": INF}, "latency"),
                                       ({"cap": NAN}, "cap"), ({"now": NAN}, "clock")])
def test_a_flow_with_a_non_finite_size_latency_or_clock_is_refused(kw: dict[str, float], words: str) -> None:
    net: FlowNetwork[str] = FlowNetwork({"r": 1.0})
    args: dict[str, Any] = {"nbytes": 1.0, "now": 0.0, **kw}
    with _deadline(5), pytest.raises(rt.ExchangeError, match=words):
        net.start("a", ("r",), args.pop("nbytes"), **args)


@pytest.mark.parametrize("t", [NAN, INF])
def test_the_clock_moves_to_finite_times_only(t: float) -> None:
    net: FlowNetwork[str] = FlowNetwork({"r": 1.0})
    net.start("a", ("r",), 1.0, 0.0)
    with _deadline(5), pytest.raises(rt.ExchangeError, match="finite time"):
        net.advance_to(t)
    assert len(net) == 1  # nothing finished at a time that is not one


class _Poisoned(FlowNetwork[str]):
    """A network whose rate computation goes wrong after allocation: what a bug, or a capacity that slipped
    past validation, would do.  The engine must stop, not loop."""

    poison: str = "rate"

    def _allocate(self) -> None:
        super()._allocate()
        drawing = self._alive & (self._ready <= self.now) & (self._remaining > 0)
        getattr(self, f"_{self.poison}")[drawing] = NAN


@pytest.mark.parametrize("poison", ["rate", "remaining"])
def test_the_flow_engine_refuses_to_loop_without_progress(poison: str) -> None:
    net = _Poisoned({"r": 1.0})
    net.poison = poison
    net.start("ok", ("r",), 0.0, 0.0, latency=1.0)  # an event the engine passes before it is stuck
    net.start("stuck", ("r",), 1.0, 0.0)
    with _deadline(5), pytest.raises(rt.ExchangeError, match="no progress") as e:
        while (t := net.next_completion()) is not None:
            net.advance_to(t)
    assert "'stuck'" in str(e.value)
    with _deadline(5), pytest.raises(rt.ExchangeError, match="no progress"):
        net.advance_to(10.0)


def test_healthy_flows_still_finish_exactly() -> None:
    net: FlowNetwork[str] = FlowNetwork({"r": 10.0})
    net.start("a", ("r",), 10.0, 0.0)
    net.start("free", (), 5.0, 0.0, latency=0.5)  # no resource: it moves in its latency alone
    assert net.next_completion() == 0.5 and net.advance_to(0.5) == ["free"]
    assert net.next_completion() == 1.0 and net.advance_to(1.0) == ["a"] and net.next_completion() is None


# ------------------------------------------------------------------------------ whole-plan simulation


def test_a_nan_peak_rate_no_longer_hangs_the_simulator(compiled: rt.CompiledGraph) -> None:
    with _deadline(20), pytest.raises(rt.ExchangeError, match=r"peak_flops\['float32'\].*got nan"):
        compiled.simulate(_switch(peak_flops={"float32": NAN}))


@pytest.mark.parametrize("latency", [NAN, INF])
def test_a_non_finite_route_latency_is_refused_not_asserted(compiled: rt.CompiledGraph, latency: float) -> None:
    with _deadline(20), pytest.raises(rt.ExchangeError, match=r"routes\[0->1\]\.latency"):
        compiled.simulate(_switch(latency=latency))


def _bad_files(tmp: Path) -> dict[str, tuple[Path, str]]:
    """Bad topology files and the words their errors carry."""
    files = {
        "nan-flops": (_doc(peak_flops={"float32": NAN}), r"peak_flops\['float32'\]"),
        "nan-latency": (_doc(routes=[{**r, "latency": NAN} for r in _doc()["routes"]]), "latency"),
        "inf-capacity": (_doc(resources={k: INF for k in _doc()["resources"]}), "finite"),
        "list": ([1, 2], "JSON object"),
    }
    out = {}
    for name, (doc, words) in files.items():
        path = tmp / f"{name}.json"
        path.write_text(json.dumps(doc))
        out[name] = (path, words)
    deep = tmp / "deep.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    out["deep"] = (deep, "nest")
    return out


@pytest.mark.parametrize("case", ["nan-flops", "nan-latency", "inf-capacity", "list", "deep"])
@pytest.mark.parametrize("mode", ["naive", "search"])
def test_compile_refuses_a_bad_topology_file(tmp_path: Path, case: str, mode: str) -> None:
    path, words = _bad_files(tmp_path)[case]
    with _deadline(20), pytest.raises(rt.ExchangeError, match=words) as e:
        rt.compileGraph(_graph(), device="cpu:2", topology=str(path), schedule_mode=mode)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("case", ["nan-flops", "deep"])
def test_simulate_refuses_a_bad_topology_file(compiled: rt.CompiledGraph, tmp_path: Path, case: str) -> None:
    path, words = _bad_files(tmp_path)[case]
    with _deadline(20), pytest.raises(rt.ExchangeError, match=words):
        compiled.simulate(str(path))


# ------------------------------------------------------------------------------ Topology.from_json


def _route_without(key: str) -> dict[str, Any]:
    routes = _doc()["routes"]
    del routes[0][key]
    return _doc(routes=routes)


FROM_JSON = [  # (the document, words of the message)
    ([1, 2], "a topology is a JSON object"),
    ("just text", "a topology is a JSON object"),
    (_doc(format="relational_tensors.topology/9"), "format"),
    (_doc(name=None), "name"),
    (_doc(sites="01"), "sites"),
    (_doc(sites=["0", "1"]), "sites"),
    (_doc(sites=[0.5, 1]), "sites"),
    (_doc(hbm_bandwidth="fast"), "hbm_bandwidth"),
    (_doc(hbm_bandwidth=True), "hbm_bandwidth"),
    (_doc(hbm_bandwidth=[1e12]), "hbm_bandwidth"),
    (_doc(memory_bytes=1.5), "memory_bytes"),
    (_doc(memory_bytes="80GiB"), "memory_bytes"),
    (_doc(launch_latency=None), "launch_latency"),
    (_doc(peak_flops=[1e12]), "peak_flops"),
    (_doc(peak_flops={"float32": "a lot"}), "peak_flops"),
    (_doc(peak_flops={"float32": False}), "peak_flops"),
    (_doc(resources=[1e9]), "resources"),
    (_doc(resources={"egress(0)": "1e9"}), "resources"),
    (_doc(routes={"0->1": {}}), "routes"),
    (_doc(routes=[["0", "1"]]), "routes[0]"),
    (_route_without("dst"), "routes[0].dst"),
    (_route_without("resources"), "routes[0].resources"),
    (_doc(routes=[{**_doc()["routes"][0], "src": "0"}]), "routes[0].src"),
    (_doc(routes=[{**_doc()["routes"][0], "src": True}]), "routes[0].src"),
    (_doc(routes=[{**_doc()["routes"][0], "src": [0]}]), "routes[0].src"),
    (_doc(routes=[{**_doc()["routes"][0], "resources": "egress(0)"}]), "routes[0].resources"),
    (_doc(routes=[{**_doc()["routes"][0], "latency": "2us"}]), "latency"),
    (_doc(routes=_doc()["routes"] * 2), "twice"),
]
for _key in ("name", "sites", "hbm_bandwidth", "memory_bytes", "peak_flops", "resources", "routes"):
    FROM_JSON.append(({k: v for k, v in _doc().items() if k != _key}, f"{_key} is missing"))


@pytest.mark.parametrize("doc, words", FROM_JSON, ids=[f"{i}-{w}" for i, (_, w) in enumerate(FROM_JSON)])
def test_from_json_names_the_field_of_a_badly_shaped_file(tmp_path: Path, doc: Any, words: str) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(rt.ExchangeError) as e:
        Topology.from_json(path)
    assert words in str(e.value) and str(path) in str(e.value)
    if isinstance(doc, dict):  # the same document as text: the same error, said of the text
        with pytest.raises(rt.ExchangeError, match="topology JSON text") as e2:
            Topology.from_json(json.dumps(doc))
        assert words in str(e2.value)


def test_from_json_of_a_list_given_as_text() -> None:
    with pytest.raises(rt.ExchangeError, match=r"topology JSON text: a topology is a JSON object .*; got list \[1, 2"):
        Topology.from_json("[1, 2]")


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"a":' * 100_000 + "1" + "}" * 100_000])
def test_from_json_of_deeply_nested_text(text: str) -> None:
    with _deadline(10), pytest.raises(rt.ExchangeError, match="nests too deeply"):
        Topology.from_json(text)


@pytest.mark.parametrize("text, words", [("{not json", "not JSON"), ('{"name": "t",}', "not JSON"),
                                         ("{" + '"x": 1' * 3, "not JSON")])
def test_from_json_of_text_that_is_not_json(text: str, words: str) -> None:
    with pytest.raises(rt.ExchangeError, match=words):
        Topology.from_json(text)


def test_from_json_of_missing_unreadable_and_odd_sources(tmp_path: Path) -> None:
    with pytest.raises(rt.ExchangeError, match="no topology file .*does not exist"):
        Topology.from_json(tmp_path / "nope.json")
    with pytest.raises(rt.ExchangeError, match="does not exist.*JSON text starts with"):
        Topology.from_json("nope.json")
    with pytest.raises(rt.ExchangeError, match="is a directory"):
        Topology.from_json(tmp_path)
    with pytest.raises(rt.ExchangeError, match="is a directory"):
        Topology.from_json(str(tmp_path))
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'{"name": "caf\xe9"}')
    with pytest.raises(rt.ExchangeError, match="UTF-8"):
        Topology.from_json(latin)
    empty = tmp_path / "empty.json"
    empty.write_text("")
    with pytest.raises(rt.ExchangeError, match="not JSON"):
        Topology.from_json(empty)
    with pytest.raises(rt.ExchangeError, match="JSON text or the path"):
        Topology.from_json(42)  # type: ignore[arg-type]
    with pytest.raises(rt.ExchangeError, match="topology file"):
        Topology.from_json("bad\0name.json")


def test_from_json_still_reads_what_to_json_writes(tmp_path: Path) -> None:
    top = _switch()
    assert Topology.from_json(top.to_json()) == top
    (tmp_path / "t.json").write_text(top.to_json())
    assert Topology.from_json(tmp_path / "t.json") == top == Topology.from_json(str(tmp_path / "t.json"))
    doc = _doc()
    del doc["launch_latency"], doc["format"]
    assert Topology.from_json(json.dumps(doc)).launch_latency == top.launch_latency  # the optional keys


# ------------------------------------------------------------------------------ get_topology


@pytest.mark.parametrize("name", [None, 42, "", "dgx-a1000", ["dgx-a100"], 2.5])
def test_get_topology_of_an_unknown_name_lists_the_known_ones(name: Any) -> None:
    with pytest.raises(rt.ExchangeError, match="known: .*hgx-h200") as e:
        get_topology(name)
    assert "got" in str(e.value) or "unknown topology" in str(e.value)


def test_get_topology_of_missing_files_and_directories(tmp_path: Path) -> None:
    with pytest.raises(rt.ExchangeError, match="no topology file .*does not exist.*known: .*hgx-h200"):
        get_topology(str(tmp_path / "nope.json"))
    with pytest.raises(rt.ExchangeError, match="is a directory.*known: .*hgx-h200"):
        get_topology(str(tmp_path))
    folder = tmp_path / "looks-like.json"
    folder.mkdir()
    with pytest.raises(rt.ExchangeError, match="is a directory.*known: .*hgx-h200"):
        get_topology(str(folder))
    good = tmp_path / "good.json"
    good.write_text(_switch().to_json())
    assert get_topology(good) == get_topology(str(good)) == _switch()  # a path object is a path


@pytest.mark.parametrize("gpus", [0, -1, 2.5, True, "2"])
def test_get_topology_needs_a_whole_number_of_gpus(gpus: Any) -> None:
    with pytest.raises(rt.ExchangeError, match="gpus"):
        get_topology("dgx-a100", gpus=gpus)


@pytest.mark.parametrize("topology", ["", "nope.json", "dgx-a1000", "folder"])
def test_compile_refuses_an_unknown_topology_at_compile_time(tmp_path: Path, topology: str) -> None:
    if topology == "folder":
        topology = str(tmp_path)
    with pytest.raises(rt.ExchangeError, match="known: .*hgx-h200"):
        rt.compileGraph(_graph(), device="cpu:2", topology=topology)


def test_no_topology_is_the_default_machine() -> None:
    assert rt.compileGraph(_graph(), device="cpu:2", topology=None).target.topology.name.startswith("hgx-h200")


@pytest.mark.parametrize("topology", [42, 4.5])
def test_compile_refuses_a_topology_that_is_no_name_with_a_typed_error(topology: Any) -> None:
    # CompileOptions checks the argument's type first (a PlanError); get_topology's own answer to these
    # is an ExchangeError (test_get_topology_of_an_unknown_name_lists_the_known_ones)
    with pytest.raises(rt.RelationalTensorsError, match="topology"):
        rt.compileGraph(_graph(), device="cpu:2", topology=topology)


@pytest.mark.parametrize("topology", [42, "nope.json", "dgx-a1000"])
def test_simulate_refuses_an_unknown_topology(compiled: rt.CompiledGraph, topology: Any) -> None:
    with pytest.raises(rt.ExchangeError, match="known: .*hgx-h200"):
        compiled.simulate(topology)


# ------------------------------------------------------------------------------ calibration files


def _calibration(tmp: Path, content: Any, raw: bool = False) -> Path:
    path = tmp / "calibration.json"
    path.write_text(content if raw else json.dumps(content))
    return path


CALIBRATIONS = [  # (the file's content, words of the message)
    ([1, 2], "JSON object"),
    ({"efficiency": {"matmul": 0.0}}, "efficiency['matmul']"),
    ({"efficiency": {"matmul": 1.5}}, "efficiency['matmul']"),
    ({"efficiency": {"matmul": NAN}}, "efficiency['matmul']"),
    ({"efficiency": {"matmul": INF}}, "efficiency['matmul']"),
    ({"efficiency": {"matmul": "0.7"}}, "efficiency['matmul']"),
    ({"efficiency": {"matmul": True}}, "efficiency['matmul']"),
    ({"efficiency": {"matmull": 0.7}}, "matmull"),
    ({"efficiency": [0.7]}, "efficiency"),
    ({"curves": {"matmul": [[1e9, NAN]]}}, "curves['matmul'][0]"),
    ({"curves": {"matmul": [[1e9, 1e12], [0.0, 1e12]]}}, "curves['matmul'][1]"),
    ({"curves": {"matmul": [[1e9, -1e12]]}}, "curves['matmul'][0]"),
    ({"curves": {"matmul": [[INF, 1e12]]}}, "curves['matmul'][0]"),
    ({"curves": {"matmul": [[1e9]]}}, "curves['matmul'][0]"),
    ({"curves": {"matmul": [["1e9", 1e12]]}}, "curves['matmul'][0]"),
    ({"curves": {"matmul": "fast"}}, "curves['matmul']"),
    ({"curves": {"flash": [[1e9, 1e12]]}}, "flash"),
    ({"curves": [[1e9, 1e12]]}, "curves"),
]


@pytest.mark.parametrize("content, words", CALIBRATIONS, ids=[f"{i}-{w}" for i, (_, w) in enumerate(CALIBRATIONS)])
def test_a_bad_calibration_file_names_the_file_and_the_field(tmp_path: Path, content: Any, words: str) -> None:
    path = _calibration(tmp_path, content)
    with pytest.raises(rt.ExchangeError) as e:
        KernelModel.from_calibration(_switch(), path)
    assert words in str(e.value) and str(path) in str(e.value) and "got" in str(e.value)


def test_calibration_files_that_cannot_be_read(tmp_path: Path) -> None:
    top = _switch()
    with pytest.raises(rt.ExchangeError, match="no calibration file .*does not exist"):
        KernelModel.from_calibration(top, tmp_path / "nope.json")
    with pytest.raises(rt.ExchangeError, match="is a directory"):
        KernelModel.from_calibration(top, tmp_path)
    with pytest.raises(rt.ExchangeError, match="not JSON"):
        KernelModel.from_calibration(top, _calibration(tmp_path, "{oops", raw=True))
    with pytest.raises(rt.ExchangeError, match="nests too deeply"):
        KernelModel.from_calibration(top, _calibration(tmp_path, "[" * 100_000 + "]" * 100_000, raw=True))
    with pytest.raises(rt.ExchangeError, match="path"):
        KernelModel.from_calibration(top, 42)  # type: ignore[arg-type]


def test_a_kernel_model_checks_its_own_numbers() -> None:
    with pytest.raises(rt.ExchangeError, match=r"efficiency\['compute'\].*got nan"):
        KernelModel(_switch(), {"compute": NAN})
    with pytest.raises(rt.ExchangeError, match=r"curves\['memory'\]\[0\]"):
        KernelModel(_switch(), curves={"memory": ((1e6, 0.0),)})
    partial = KernelModel(_switch(), {"matmul": 0.5})  # the families left out keep their defaults
    assert partial.efficiency["memory"] == 0.8 and partial.time(1e9, 1e6, "float32", "memory") > 0


def test_a_good_calibration_still_loads(tmp_path: Path) -> None:
    path = _calibration(tmp_path, {"efficiency": {"matmul": 1.0}, "curves": {"memory": [[1e8, 2e12], [1e6, 1e11]],
                                                                             "attention": []}, "gpu": "any"})
    model = KernelModel.from_calibration(_switch(), path)
    assert model.efficiency["matmul"] == 1.0 and model.curves["memory"] == ((1e6, 1e11), (1e8, 2e12))
    assert model.source == str(path)


def test_compile_and_simulate_refuse_a_bad_calibration(compiled: rt.CompiledGraph, tmp_path: Path) -> None:
    path = _calibration(tmp_path, {"efficiency": {"matmul": NAN}})
    with _deadline(20), pytest.raises(rt.ExchangeError, match=r"efficiency\['matmul'\]"):
        rt.compileGraph(_graph(), device="cpu:2", calibration=str(path))
    with _deadline(20), pytest.raises(rt.ExchangeError, match=r"efficiency\['matmul'\]"):
        compiled.simulate(calibration=str(path))
    with pytest.raises(rt.ExchangeError, match="no calibration file"):
        rt.compileGraph(_graph(), device="cpu:2", calibration=str(tmp_path / "nope.json"))


# ------------------------------------------------------------------------------ the command line

MODEL = MLP  # the command line's test model (tests/test_cli.py)


def _cli(*args: object, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(rt.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "relational_tensors", *map(str, args)], capture_output=True,
                          text=True, timeout=120, cwd=cwd, env=env)


@pytest.mark.parametrize("case", ["nan-flops", "nan-latency", "list", "deep"])
def test_cli_simulate_refuses_a_bad_topology_file_in_one_line(tmp_path: Path, case: str) -> None:
    (tmp_path / "model.py").write_text(MODEL)
    path, words = _bad_files(tmp_path)[case]
    r = _cli("simulate", "model.py", "--devices", "cpu:2", "--topology", path, cwd=tmp_path)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("relational-tensors: error: "), r.stderr
    assert words.replace("\\", "") in lines[0] and path.name in lines[0]


def test_cli_simulate_refuses_a_bad_calibration_file_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "model.py").write_text(MODEL)
    path = _calibration(tmp_path, {"curves": {"matmul": [[1e9, NAN]]}})
    r = _cli("simulate", "model.py", "--devices", "cpu:2", "--calibration", path, cwd=tmp_path)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "curves['matmul'][0]" in lines[0] and "calibration.json" in lines[0], r.stderr
