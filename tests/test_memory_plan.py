"""The GPU executor's memory plan, checked without a GPU: buffers alive together never share bytes,
and every pair of tasks on different streams that touch the same bytes (one of them writing) is
ordered by the waits the plan issues (a vector-clock happens-before check)."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
from cases import CASES

import relational_tensors as rt
from relational_tensors.errors import OutOfMemoryPlanError
from relational_tensors.graph.models import LLAMA3_8B, llama_block, llama_training_graph
from relational_tensors.kernels.launchers import kernel_scratch
from relational_tensors.runtime.memory_plan import MemoryPlan, align, plan_arena, plan_memory, sibling_tasks


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
        if t.kind == "load" or (t.kind == "kernel" and (t.outputs[0] in plan.reshaped or t.id in plan.done_by)):
            continue  # loads finish before execution; an aliased reshape and an lse its forward wrote touch nothing
        for b, write in [(b, False) for b in t.inputs] + [(b, True) for b in plan.writes(t)]:
            d, lo, hi = plan.byte_range(dag, b)
            if hi > lo:
                by_arena.setdefault(d, []).append((t.id, lo, hi, write))
        if t.id in plan.scratch:  # its kernel's scratch: written and read during the task
            slot = plan.scratch[t.id]
            by_arena.setdefault(t.device, []).append((t.id, slot.offset, slot.offset + slot.size, True))
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


def check(cg: rt.CompiledGraph, siblings: Mapping[int, int] | None = None) -> MemoryPlan:
    plan = plan_memory(cg.dag, cg.live, siblings)
    assert hazards(cg, plan) == []
    for d, size in plan.arena_bytes.items():  # the arena holds at least what the liveness says is alive at once
        assert size >= cg.memory()[d]
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


@pytest.mark.parametrize("p", [1, 8])
def test_the_arena_of_a_training_step_is_its_liveness_peak_within_one_percent(p: int) -> None:
    """The prediction ``cg.memory()`` is what the GPU executor allocates: reshape outputs counted in
    their input's memory on both sides, and the placement tight (the 8B-shaped block's training step
    at 8K tokens, bf16 with float32 masters and AdamW)."""
    g = llama_training_graph(1, 8192, 4096, 32, 8, 14336, 32000, dtype="bfloat16", optimizer="adamw",
                             master_dtype="float32")
    cg = rt.compileGraph(g, device=f"cpu:{p}")
    plan = check(cg)
    for d in range(p):
        assert plan.arena_bytes[d] <= 1.01 * cg.memory()[d], (d, plan.arena_bytes[d], cg.memory()[d])


def test_the_arena_keeps_the_tightest_of_its_orders() -> None:
    """Largest first leaves a hole here (2,304 bytes: the small early buffer finds no room between the
    two others) where first born packs the 2,048 bytes alive at once."""
    sizes = {0: 1024, 1: 512, 2: 768, 3: 768}
    lifetimes = {0: (4, 4), 1: (0, 2), 2: (1, 2), 3: (1, 6)}
    slots, arena, reuses = plan_arena(sizes, lifetimes)
    assert arena == 2048
    for a in sizes:
        for b in sizes:
            apart = lifetimes[a][1] < lifetimes[b][0] or lifetimes[b][1] < lifetimes[a][0]
            sa, sb = slots[a], slots[b]
            assert a == b or apart or sa.offset + sa.size <= sb.offset or sb.offset + sb.size <= sa.offset
    assert all(lifetimes[old][1] < lifetimes[b][0] for b, olds in reuses.items() for old in olds)


@pytest.mark.parametrize("p", [1, 3, 4, 8])
def test_forward_attention_writes_the_lse_its_backward_reads(p: int) -> None:
    """Where the backward's attention_lse reads the forward's q and k blocks, the forward task writes the
    lse: its block is born at the forward (reserved until its last reader, the hazard check sees the
    forward's write), and without the pairing the plan is the one before.  (At p = 3 the lse reads
    blocks of its own, and nothing pairs.)"""
    g = llama_training_graph(2, 40, 32, 4, 2, 48, 29, seq_ends=(7, 20, 40))
    cg = rt.compileGraph(g, device=f"cpu:{p}")
    plan = check(cg)
    pairs = sibling_tasks(cg.dag, ("attention_lse",))
    lse_tasks = [t for t in cg.dag.tasks if t.kind == "kernel" and cg.graph.nodes[t.op].kind == "attention_lse"]
    assert len(pairs) == (0 if p == 3 else len(lse_tasks)) and pairs.items() <= plan.done_by.items()
    for lse_task, fwd in pairs.items():
        f, lt = cg.dag.tasks[fwd], cg.dag.tasks[lse_task]
        assert f.device == lt.device and f.inputs[:2] == lt.inputs[:2] and fwd < lse_task
        assert cg.graph.nodes[f.op].kind == "attention" and cg.graph.nodes[lt.op].kind == "attention_lse"
        assert plan.writes(f) == (*f.outputs, lt.outputs[0])
    plain = plan_memory(cg.dag, cg.live, siblings={})
    assert plain.done_by == {} and hazards(cg, plain) == []


@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_one_swiglu_gradient_kernel_writes_both(p: int) -> None:
    """The swiglu backward's two tasks on the same a, b and dy blocks: the first writes both gradients (its
    sibling's block is born there, and the hazard check sees the write); every pair reads the same
    buffers, one task for da and one for db."""
    g = llama_training_graph(2, 40, 32, 4, 2, 48, 29, seq_ends=(7, 20, 40))
    cg = rt.compileGraph(g, device=f"cpu:{p}")
    plan = check(cg)
    pairs = sibling_tasks(cg.dag, ("swiglu_grad",))
    assert pairs and pairs.items() <= plan.done_by.items()
    for later, first in pairs.items():
        f, t = cg.dag.tasks[first], cg.dag.tasks[later]
        assert first < later and f.device == t.device and f.inputs == t.inputs
        assert {cg.graph.nodes[f.op].op.wrt, cg.graph.nodes[t.op].op.wrt} == {0, 1}
        assert plan.writes(f) == (*f.outputs, t.outputs[0])


def test_the_forward_lse_equals_the_recomputed_one() -> None:
    """The NumPy kernels of the pair agree: the forward's log-sum-exp (which the GPU forward kernel
    writes for the backward) is the attention_lse operator's, on a packed causal GQA block."""
    import numpy as np

    from relational_tensors.sql_specs.attention import AttentionOp
    from relational_tensors.sql_specs.attention_grad import AttentionLseOp

    g = llama_training_graph(1, 40, 32, 4, 2, 48, 29, seq_ends=(7, 20, 40))
    op = next(n for n in g.nodes if n.kind == "attention").op
    assert isinstance(op, AttentionOp) and op.causal and op.seq_ends
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(t.shape).astype(np.float32) for t in op.input_types[:3])
    lse_op = AttentionLseOp(op.input_types[:2], **op.options())
    _, lse_forward = op.kernel([q, k, v], op.spec().functions[0])
    np.testing.assert_allclose(lse_forward, lse_op.kernel([q, k], lse_op.spec().functions[0]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("p", [1, 3, 4])
def test_kernel_scratch_is_placed_in_the_arena_during_its_task(p: int) -> None:
    """Scratch given to kernel tasks takes arena bytes no buffer alive at its task holds, any reuse of them
    by another device's reader is ordered by a wait, and it costs the arena at most the largest scratch."""
    g = llama_training_graph(2, 40, 32, 4, 2, 48, 29, seq_ends=(7, 20, 40), optimizer="adamw")
    cg = rt.compileGraph(g, device=f"cpu:{p}")
    kernels = [t.id for t in cg.dag.tasks if t.kind == "kernel"]
    scratch = {t: 512 + 64 * (t % 7) for t in kernels[::3]}
    plan = plan_memory(cg.dag, cg.live, scratch=scratch)
    plain = plan_memory(cg.dag, cg.live)
    assert set(plan.scratch) == set(scratch) and hazards(cg, plan) == []
    for tid, slot in plan.scratch.items():
        d = cg.dag.tasks[tid].device
        assert slot.size >= scratch[tid] and slot.offset + slot.size <= plan.arena_bytes[d]
        for r, (born, dies) in plan.lifetimes.items():
            other = plan.slots[r]
            if cg.dag.buffers[r].device == d and born <= tid <= dies:
                assert other.offset + other.size <= slot.offset or slot.offset + slot.size <= other.offset
    for d in range(p):
        assert plan.arena_bytes[d] <= plain.arena_bytes[d] + max(align(n) for n in scratch.values()) * 2


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("keep", ["as read", "sharded"])
def test_next_values_written_in_place_wait_for_every_reader_of_the_old(p: int, keep: str) -> None:
    """Copies that deliver a state's next value straight into its kept block (no ``assign``) overwrite a
    block the step read, perhaps from other devices: the plan orders them after every such reader."""
    g = llama_training_graph(2, 64, 64, 4, 2, 96, 128, dtype="bfloat16", optimizer="adamw",
                             master_dtype="float32")
    cg = rt.compileGraph(g, device=f"cpu:{p}", keep_states=keep)
    kept = cg.dag.kept_state_blocks()
    in_place = [t for t in cg.dag.tasks if t.kind != "assign" and cg.dag.overwrites(t, kept)]
    if keep == "as read":
        assert in_place
    check(cg)


def test_a_gpu_plan_counts_its_kernels_scratch() -> None:
    """On GPU devices the liveness counts the scratch a kernel holds during its task (a reduction over a
    leading axis moves the whole input into scratch first): ``cg.memory()`` is the GPU executor's arena,
    the scratch shows as "other" at the peak, and a memory limit the buffers alone would meet is refused
    before anything runs.  CPU devices (NumPy kernels) need no scratch."""
    g = rt.Graph()
    x = g.input("x", [4096, 512])
    g.save(g.sum(x, axis=0), name="y")
    cpu = rt.compileGraph(g, device="cpu:1")
    gpu = rt.compileGraph(g, device="cuda:0")
    scratch = kernel_scratch(gpu.dag)
    assert kernel_scratch(cpu.dag) == scratch and sum(scratch.values()) == 4096 * 512 * 4  # the input, moved
    assert gpu.memory()[0] == cpu.memory()[0] + 4096 * 512 * 4
    plan = plan_memory(gpu.dag, gpu.live, scratch=scratch)
    assert gpu.memory()[0] <= plan.arena_bytes[0] <= 1.01 * gpu.memory()[0]
    assert gpu.memory_by_category()[0]["other"] >= 4096 * 512 * 4
    limit = cpu.memory()[0] + 4096 * 512 * 2  # the buffers fit, the buffers and the scratch do not
    rt.compileGraph(g, device="cpu:1", memory_per_device=limit)
    with pytest.raises(OutOfMemoryPlanError, match="device 0 needs"):
        rt.compileGraph(g, device="cuda:0", memory_per_device=limit)
