"""Fewer passes over the data: atoms and delivered pieces as views (a task-DAG rewrite after lowering).

Lowering moves a block in three passes: ``decompose`` slices the producer's block into atoms,
``copy`` sends each atom, ``recompose`` assembles the reader's block from the pieces.  Two rewrites
make most of that one pass, without changing what any task computes:

* an atom of a block is a view of that block when nothing reads it as a kernel input (kernels
  read contiguous blocks): copies, ⊕ and assembly read the atom in place, strided, and the
  ``decompose`` task goes away (atoms of log-sum-exp partials, which carry a second array, stay);
* a piece that a copy delivers, or a ⊕ completes, and only the reader's ``recompose`` reads is a
  view of the block being assembled: the copy or ⊕ writes straight into it, and the ``recompose``
  keeps only the atoms that were already on its device; with none left it goes away.  A whole piece
  that several assemblies read (a block delivered once for two readers) is a view of the first one's
  block, and the later ones read it from there.  (A complete
  ⊕ of sum, max or min partials is the final value; log-sum-exp partials are finalized by the
  ``recompose`` and stay.)
* a state's next value that copies deliver, or a ``recompose`` assembles, for its ``assign`` alone is
  a view of the kept block the ``assign`` writes: the copies and the assembly write the state in place
  and the ``assign`` goes away.  (Every task writing a kept block waits for every earlier task that
  touched it, as an ``assign`` does: the memory plan's and the stream schedules' rule.)  So does a value a
  ``where`` selects or a ``put_rows`` writes rows of, when every other reader of the state's old value
  runs before it and it reads the old value, if at all, as the whole block (a cache written at a few
  positions or rows): the kernel writes the kept block in place, each element where it reads it.  Any
  other value a kernel makes stays: it is fused with its ``assign`` where the executor can
  (``runtime.fusion``).

Task ids are renumbered; emission order is kept.
"""

from __future__ import annotations

import dataclasses

from relational_tensors.physical.tasks import Buffer, DecomposePayload, RecomposePayload, Task, TaskDAG

__all__ = ["fuse_views"]


def fuse_views(dag: TaskDAG, select_in_place: bool = True) -> TaskDAG:
    """The same computation with decompose atoms and delivered pieces turned into views where allowed.
    ``dag`` is consumed: its tasks are renumbered in place.  ``select_in_place`` lets a ``where`` or a
    ``put_rows`` write a state's kept block (the module's docstring); off where the tasks are reordered
    afterwards (phases, pipeline schedules), which could move a reader of the old value after it."""
    tasks = dag.tasks
    nodes = dag.nodes
    # the buffers the rewrites ask about: a recompose's pieces and an assign's value (their readers and
    # producers); only those are indexed (most buffers are neither).  A decompose's atoms ask only whether a
    # kernel reads them (``kernel_read``)
    asked: set[int] = set()
    kept_blocks = dag.kept_state_blocks()
    shares: dict[int, list[int]] = {}  # kept block -> reshapes of it (which may keep its bytes: read them too)
    share_of: dict[int, int] = {}
    kernel_read: set[int] = set()  # buffers a kernel reads (kernels read contiguous blocks, never a view)
    for t in tasks:
        kind = t.kind
        if kind == "kernel":
            kernel_read.update(t.inputs)
            if select_in_place and t.inputs:
                first = t.inputs[0]
                k = first if first in kept_blocks else share_of.get(first)
                if k is not None and t.op is not None and nodes[t.op].kind == "reshape":
                    share_of[t.outputs[0]] = k
                    shares.setdefault(k, []).append(t.outputs[0])
                    asked.add(t.outputs[0])
        elif kind == "recompose":
            asked.update(t.inputs)
        elif kind == "assign":
            asked.update(t.inputs)
            asked.update(t.outputs)  # (the kept block: whether anything reads the old value after the kernel)
    readers: dict[int, list[Task]] = {b: [] for b in asked}
    producer: dict[int, Task] = {}
    for t in tasks:
        for b in t.inputs:
            at = readers.get(b)
            if at is not None:
                at.append(t)
        for b in t.outputs:
            if b in asked and b not in producer:
                producer[b] = t
    outputs = {b for blocks in dag.outputs.values() for _, b in blocks}
    buffers = dag.buffers  # rewritten in place (a view differs from its buffer in ``parent`` alone)
    # the tasks that stay, in emission order, each as rewritten; ids are renumbered once the pass is done
    # (until then ``_hosts`` and ``_selects_in_place`` compare the readers' ids as emitted)
    kept_tasks: list[Task] = []

    # one pass in task order: each rewrite reads what earlier tasks' rewrites left (a piece's first reader
    # is the first to ask for it), as three passes one after the other would
    for t in tasks:
        kind = t.kind
        if kind == "decompose":  # atoms as views of the block they are cut from
            src = t.inputs[0]
            if buffers[src].partial == "lse":
                kept_tasks.append(t)
                continue
            keep = []  # the positions of the atoms that stay (no tuples made for the many that go)
            for i, b in enumerate(t.outputs):
                if b in outputs or b in kernel_read:
                    keep.append(i)
                else:
                    buffers[b] = _view(buffers[b], src)
            if not keep:
                continue  # dropped
            if len(keep) < len(t.outputs):
                cut = t.payload
                assert isinstance(cut, DecomposePayload)
                t = dataclasses.replace(t, outputs=tuple(t.outputs[i] for i in keep),
                                        payload=DecomposePayload(tuple(cut.cells[i] for i in keep)))
        elif kind == "recompose":  # delivered pieces as views of the block their reader assembles
            out = buffers[t.outputs[0]]
            if out.partial is None:
                pieces = t.payload
                assert isinstance(pieces, RecomposePayload)
                finalize = pieces.finalize
                out_id, out_device, out_dtype = out.id, out.device, out.dtype
                left = []  # the positions of the pieces that stay
                for i, b in enumerate(t.inputs):
                    made_by = producer.get(b)
                    piece = buffers[b]
                    piece_readers = readers[b]  # (most are read by this recompose alone: no call to _hosts)
                    if (made_by is not None and made_by.kind in ("copy", "aggregate") and not finalize[i]
                            and piece.partial != "lse" and piece.parent is None
                            and (len(piece_readers) == 1 or _hosts(t, piece_readers, piece))
                            and b not in outputs and piece.device == out_device and piece.dtype == out_dtype):
                        buffers[b] = _view(piece, out_id)
                    else:
                        left.append(i)
                if not left and t.inputs:  # (a recompose of no pieces makes an empty block: it stays)
                    continue  # dropped
                if len(left) < len(t.inputs):
                    t = dataclasses.replace(t, inputs=tuple(t.inputs[i] for i in left),
                                            payload=RecomposePayload(cells=tuple(pieces.cells[i] for i in left),
                                                                     aggregation=pieces.aggregation,
                                                                     finalize=tuple(finalize[i] for i in left)))
        elif kind == "assign":  # a state's next value assembled in the block it is kept in
            src, dst = t.inputs[0], t.outputs[0]
            made_by = producer.get(src)
            value, kept = buffers[src], buffers[dst]
            same = (src not in outputs and value.parent is None and value.partial is None and kept.parent is None
                    and (value.device, value.box, value.dtype) == (kept.device, kept.box, kept.dtype))
            if same and made_by is not None and (
                    made_by.kind in ("copy", "recompose") and len(readers[src]) == 1
                    or select_in_place and _selects_in_place(
                        dag, made_by, dst, [*readers[dst], *(r for b in shares.get(dst, ()) for r in readers[b])],
                        {dst, *shares.get(dst, ())})):
                buffers[src] = _view(value, dst)
                continue  # dropped
        kept_tasks.append(t)

    for i, t in enumerate(kept_tasks):
        t.id = i
    return dataclasses.replace(dag, tasks=kept_tasks, buffers=buffers, phase_split=None, later=frozenset())


# kernels whose output element i reads the first operand (if at all) at element i alone, so they may write
# into that operand's block: ``where`` (a selection) and ``put_rows`` (rows replaced)
IN_PLACE_KINDS = ("where", "put_rows")


def _selects_in_place(dag: TaskDAG, kernel: Task, kept: int, old_readers: list[Task], old: set[int]) -> bool:
    """Whether ``kernel``, a ``where`` or ``put_rows`` making a state's next value, may write it into the
    state's kept block ``kept`` itself: every other task reading the state's old value runs before it, and
    it reads the old value (if at all) as the whole block, each element where it writes it (a cache written
    at a few positions or rows and kept elsewhere: the block is read and written once, not copied twice).
    ``old`` holds the buffers that hold the old value's bytes (the kept block, reshapes of it)."""
    if kernel.kind != "kernel" or kernel.op is None or dag.nodes[kernel.op].kind not in IN_PLACE_KINDS or \
            len(kernel.outputs) != 1:
        return False
    # an atom of the old value (a view of it) would be read where other elements are written
    if any(b != kept and dag.root(b) == kept for b in kernel.inputs):
        return False
    # put_rows reads its values' row i where it writes row ids[i], and writes x over the block first: the old
    # value (``old``: the kept block and reshapes that keep its bytes) may only be its x
    if dag.nodes[kernel.op].kind == "put_rows" and any(b in old or dag.root(b) in old for b in kernel.inputs[1:]):
        return False
    return all(r.id < kernel.id or r is kernel for r in old_readers)


def _hosts(t: Task, readers: list[Task], piece: Buffer) -> bool:
    """Whether the block ``recompose`` ``t`` assembles holds ``piece``: its only reader, or the first of
    several assemblies that read it (the later ones read it there, strided, as they read any view)."""
    if len(readers) == 1:
        return True
    return piece.partial is None and all(r.kind == "recompose" for r in readers) and min(r.id for r in readers) == t.id


def _view(buf: Buffer, parent: int) -> Buffer:
    return Buffer(buf.id, buf.device, buf.box, buf.dtype, buf.tensor, buf.partial, parent)

