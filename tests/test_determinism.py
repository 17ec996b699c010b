"""Plans do not depend on Python's hash seed: the same compilation under different ``PYTHONHASHSEED``
values (each in its own interpreter) gives the same exchange programs and simulated time, for the
searched schedule, the naive one, and the greedy and random selectors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

_COMPILE = textwrap.dedent("""
    import json, sys
    import relational_tensors as rt
    from relational_tensors.graph.models import LLAMA3_8B, llama_block

    out = []
    for seq, device, topology, cost_model, selector, mode in json.loads(sys.argv[1]):
        g = llama_block(1, seq, dtype="float16", **LLAMA3_8B)
        cg = rt.compileGraph(g, device=device, topology=topology, cost_model=cost_model, selector=selector,
                             schedule_mode=mode, search_budget_s=600.0)
        out.append({"time": repr(cg.simulate()), "programs": cg.exchange_programs(), "timeouts": cg.search[1]})
    print(json.dumps(out))
""")


def _compiled(cases: list[tuple], hash_seed: int) -> list[dict]:
    env = {**os.environ, "PYTHONHASHSEED": str(hash_seed)}
    run = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(cases)], capture_output=True, text=True,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout)


def _assert_same_under(cases: list[tuple], hash_seeds: tuple[int, ...]) -> None:
    first, *others = [_compiled(cases, s) for s in hash_seeds]
    for seed, got in zip(hash_seeds[1:], others):
        for case, a, b in zip(cases, first, got):
            assert a["timeouts"] == b["timeouts"] == 0, f"the search budget stopped a search of {case}"
            differ = sorted(k for k in a["programs"].keys() | b["programs"].keys()
                            if a["programs"].get(k) != b["programs"].get(k))
            assert not differ, (f"{case}: PYTHONHASHSEED={hash_seeds[0]} and {seed} give different exchange "
                                f"programs {differ[:5]}")
            assert a["time"] == b["time"], f"{case}: simulated {a['time']} s and {b['time']} s"


def test_a_searched_plan_and_the_selectors_ignore_the_hash_seed() -> None:
    """A quick check: a searched plan on two nodes and the greedy and random selectors, under two hash seeds."""
    _assert_same_under([(8192, 8, "2x-hgx-h200-ib", "calibrated", "dp", "search"),
                        (8192, 8, "hgx-h200", "paper", "greedy", "naive"),
                        (8192, 8, "2x-hgx-h200-ib", "calibrated", "random", "naive")], (1, 2))


@pytest.mark.slow
def test_naive_plans_and_every_selector_ignore_the_hash_seed() -> None:
    """The naive schedule with the DP, greedy and random selectors, paper and calibrated costs, on one
    and two HGX H200 nodes, and a searched plan: the same under three hash seeds."""
    cases = [(8192, p, top, cost, selector, "naive")
             for top, p in (("hgx-h200", 8), ("2x-hgx-h200-ib", 16))
             for cost in ("paper", "calibrated") for selector in ("dp", "greedy", "random")]
    cases.append((8192, 8, "2x-hgx-h200-ib", "calibrated", "dp", "search"))
    _assert_same_under(cases, (1, 2, 3))


@pytest.mark.slow
def test_the_searched_8k_block_on_two_nodes_ignores_the_hash_seed() -> None:
    """The LLaMA-3-8B-shaped 8K block at p = 16 on two HGX H200 nodes, calibrated, searched: the search
    ranks proposals by summed resource loads, which must not be summed in a set's order (hash seeds 1
    and 2 gave 0.000951 s and 0.000933 s when they were)."""
    _assert_same_under([(8192, 16, "2x-hgx-h200-ib", "calibrated", "dp", "search")], (1, 2))
