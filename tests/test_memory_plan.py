"""The GPU executor's memory plan, checked without a GPU: buffers alive together never share bytes,
and every pair of tasks on different streams that touch the same bytes (one of them writing) is
ordered by the waits the plan issues (a vector-clock happens-before check)."""

from __future__ import annotations

import pytest
from cases import CASES

import relational_tensors as rt
from relational_tensors.gpu_exec.memory_plan import MemoryPlan, plan_memory
from relational_tensors.models import LLAMA3_8B, llama_block


def hazards(cg: rt.CompiledGraph, plan: MemoryPlan) -> list[tuple[int, int]]:
    dag = cg.dag
    clocks: dict[int, dict[int, int]] = {}
    last: dict[int, int] = {}
    for t in dag.tasks:
        if t.kind == "load":
            continue
        clock = dict(clocks[last[t.device]]) if t.device in last else {}
        for w in plan.waits[t.id]:
            for s, i in clocks[w].items():
                clock[s] = max(clock.get(s, -1), i)
        clock[t.device] = t.id
        clocks[t.id] = clock
        last[t.device] = t.id

    def ordered(a: int, b: int) -> bool:
        return clocks[b].get(dag.tasks[a].device, -1) >= a

    by_arena: dict[int, list[tuple[int, int, int, bool]]] = {}
    for t in dag.tasks:
        if t.kind == "load" or (t.kind == "kernel" and t.outputs[0] in plan.reshaped):
            continue  # loads finish before execution; an aliased reshape touches nothing
        for b, write in [(b, False) for b in t.inputs] + [(b, True) for b in t.outputs]:
            d, lo, hi = plan.byte_range(dag, b)
            if hi > lo:
                by_arena.setdefault(d, []).append((t.id, lo, hi, write))
    bad = []
    for accesses in by_arena.values():
        accesses.sort(key=lambda a: a[1])
        for i, (ta, _lo_a, hi_a, wa) in enumerate(accesses):
            for tb, lo_b, _hi_b, wb in accesses[i + 1:]:
                if lo_b >= hi_a:
                    break
                if ta == tb or not (wa or wb):
                    continue
                first, second = sorted((ta, tb))
                if dag.tasks[first].device != dag.tasks[second].device and not ordered(first, second):
                    bad.append((first, second))
    return bad


def check(cg: rt.CompiledGraph) -> MemoryPlan:
    plan = plan_memory(cg.graph, cg.dag, cg.live)
    assert hazards(cg, plan) == []
    for d, size in plan.arena_bytes.items():  # the arena holds at least what is alive at the peak
        assert size >= cg.memory()[d] * 0.5
    return plan


@pytest.mark.parametrize("p", [4, 8])
@pytest.mark.parametrize("tokens", [8192, 131072])
def test_long_sequence_plans_are_hazard_free(tokens: int, p: int) -> None:
    g = llama_block(1, tokens, dtype="float16", **LLAMA3_8B)
    check(rt.compileGraph(g, device=f"cpu:{p}"))


@pytest.mark.parametrize("p", [3, 6, 8])
@pytest.mark.parametrize("selector", ["dp", "random"])
def test_small_block_plans_are_hazard_free(p: int, selector: str) -> None:
    g = llama_block(2, 48, 32, 8, 2, 88, dtype="float16", seq_ends=[5, 17, 20, 33, 48])
    check(rt.compileGraph(g, device=f"cpu:{p}", selector=selector, seed=p))


@pytest.mark.parametrize("case", sorted(CASES))
def test_operator_plans_are_hazard_free(case: str) -> None:
    g, _ = CASES[case]("float32")
    for p in (4, 8):
        check(rt.compileGraph(g, device=f"cpu:{p}", selector="random", seed=p))


def test_reshape_outputs_share_their_input() -> None:
    g = llama_block(1, 1024, dtype="float16", **LLAMA3_8B)
    cg = rt.compileGraph(g, device="cpu:1")
    plan = check(cg)
    reshapes = [t for t in cg.dag.tasks if t.kind == "kernel" and cg.graph.nodes[t.op].kind == "reshape"]
    assert reshapes and all(t.outputs[0] in plan.alias for t in reshapes)
