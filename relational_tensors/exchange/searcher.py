"""The search of a whole lowering's exchange programs: one step limit shared by all of them.

A :class:`Searcher` searches the programs of one lowering (:func:`~relational_tensors.exchange.search.search_program`
for each).  Given a step limit for all of them (``total_steps``) and the lowering's naive programs
beforehand (:meth:`Searcher.spread`), it hands out the steps in lowering order, each program taking the
steps left in proportion to its weight (naive time times the number of readers that use it, 0 near the
lower bound) among the weights left, so the expensive exchanges get the effort and what a search leaves
unused goes to those after it.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable

from relational_tensors.errors import ExchangeError
from relational_tensors.exchange.ast import Action, ExProg
from relational_tensors.exchange.bound import at_bound, lower_bound
from relational_tensors.exchange.naive import Membership, naive_body
from relational_tensors.exchange.search import SearchResult, search_program
from relational_tensors.exchange.simulator import SimResult, check_topology, simulate
from relational_tensors.machine.topology import Topology

__all__ = ["Searcher", "make_searcher"]


class Searcher:
    """A synthesizer for :func:`~relational_tensors.physical.lower.lower` that searches every program.

    Each program is searched with at most ``max_steps`` judged proposals and ``budget_s`` seconds.
    With ``total_steps``, the programs of the lowering share that many steps: call :meth:`spread`
    with the lowering's naive programs first, then each program, in lowering order, takes the
    steps left in proportion to its weight among the weights left (its naive time times its
    uses; 0 near its :func:`lower_bound`).  A program :meth:`spread` did not see (an earlier search
    moved the readers it reads from) is weighed when it comes (see :meth:`_share`).  For one seed the result is
    deterministic unless ``budget_s`` stops a search.  ``results`` keeps one :class:`SearchResult`
    per program synthesized, in lowering order.
    """

    def __init__(self, topology: Topology, seed: int = 0, budget_s: float = 0.5,
                 max_steps: int | None = None, total_steps: int | None = None) -> None:
        self.topology = check_topology(topology, "Searcher")
        self.seed = seed
        self.budget_s = budget_s
        self.max_steps = max_steps
        self.total_steps = total_steps
        self.steps_left = total_steps
        self.results: list[SearchResult] = []
        self._weights: dict[tuple, float] = {}  # a program spread() saw, not yet searched -> its weight
        self._runs: dict[tuple, tuple[SimResult, float]] = {}  # a program -> its naive run and lower bound
        self._uses: dict[tuple, int] = {}
        self._by_shape: dict[tuple, list[tuple]] = defaultdict(list)  # _shape -> those programs, in order
        self._weight_left = 0.0

    def _weight(self, key: tuple, uses: int = 1) -> float:
        """``uses`` times the naive time of the program ``key`` names, 0 when that is near its lower bound
        (the run and the bound are kept for its search)."""
        prog, membership = key[0], dict(key[1])
        run = simulate(prog.with_body(naive_body(prog, membership)), self.topology, membership)
        bound = lower_bound(prog, self.topology, membership, free_moves=False)
        self._runs[key] = (run, bound)
        return 0.0 if at_bound(run.time, bound) else run.time * uses

    def spread(self, programs: Iterable[tuple[ExProg, Membership]]) -> None:
        """Weigh the programs this searcher will be given: one (program, starting membership) per use,
        in lowering order (bodies are ignored).  Without ``total_steps`` it does nothing."""
        if self.total_steps is None:
            return
        uses: Counter = Counter()
        seen: dict[tuple[int, int], tuple] = {}  # identical layers share their program objects: key each once
        for prog, membership in programs:
            key = seen.get((id(prog), id(membership)))
            if key is None:
                key = seen[(id(prog), id(membership))] = _program_key(prog, membership)
            uses[key] += 1
        for key, n in uses.items():
            w = self._weights[key] = self._weight(key, n)
            self._uses[key] = n
            self._by_shape[_shape(key[0])].append(key)
            self._weight_left += w

    def _share(self, key: tuple) -> int | None:
        """The steps the program ``key`` names may judge: its part of the steps left, capped by ``max_steps``.

        A program that :meth:`spread` did not see takes the place of the first one it saw with the same
        shape that has not come (an earlier search moved readers, so this one reads from other sites):
        its uses, and its weight in the pool.  Otherwise it counts once."""
        if self.steps_left is None:
            return self.max_steps
        if key in self._weights:
            w = self._weights.pop(key)
            pool = self._weight_left
            self._weight_left -= w
        else:
            twin = next((k for k in self._by_shape.get(_shape(key[0]), ()) if k in self._weights), None)
            uses = 1
            if twin is not None:
                self._weight_left -= self._weights.pop(twin)
                uses = self._uses[twin]
            w = self._weight(key, uses)
            pool = self._weight_left + w
        self._weight_left = max(0.0, self._weight_left)
        share = int(self.steps_left * (w / pool)) if pool > 0 else 0
        return share if self.max_steps is None else min(share, self.max_steps)

    def __call__(self, prog: ExProg, membership: Membership) -> tuple[frozenset[Action], Membership]:
        missing = sorted(set(prog.gpus) - set(self.topology.sites))
        if missing:
            raise ExchangeError(f"devices {missing} of the program are not sites of topology "
                                f"{self.topology.name!r} (sites {self.topology.sites}); search with a topology "
                                f"of at least {len(prog.gpus)} GPUs")
        # swaps only: a reader outside this program may sit on the device a move would take
        key = _program_key(prog, membership)
        steps = self._share(key)
        r = search_program(prog, self.topology, membership, seed=self.seed, budget_s=self.budget_s, max_steps=steps,
                           free_moves=False, known=self._runs.pop(key, None))
        if self.steps_left is not None:
            self.steps_left -= r.steps
        self.results.append(r)
        return r.body, r.membership

    def accepted(self) -> Counter:
        """How often each rule improved a program, over every program searched."""
        return Counter(rule for r in self.results for rule in r.accepted)


def _program_key(prog: ExProg, membership: Membership) -> tuple:
    """A program's preamble and starting membership: what its search depends on."""
    return prog.with_body(()), tuple(sorted((name, tuple(sites)) for name, sites in membership.items()))


def _shape(prog: ExProg) -> tuple:
    """What a program keeps when its sites are relabelled: its sites, its atoms' sizes and copies, and
    the sizes and reader counts of its requirements."""
    sizes = prog.atom_sizes()
    copies = Counter(inp.atom for inp in prog.inputs)
    atoms = Counter((sizes[a], n) for a, n in copies.items())
    needs = Counter((len(r.aggregate), sizes.get(next(iter(r.aggregate)), 0), len(r.targets)) for r in prog.outputs)
    return len(prog.gpus), tuple(sorted(atoms.items())), tuple(sorted(needs.items()))


def make_searcher(topology: Topology, seed: int = 0, budget_s: float = 0.5,
                  max_steps: int | None = None, total_steps: int | None = None) -> Searcher:
    """A :data:`~relational_tensors.physical.lower.Synthesizer` running :func:`search_program` on each
    program it is given (``budget_s`` and at most ``max_steps`` each, ``total_steps`` shared: see
    :class:`Searcher`); it keeps the results for inspection.

    >>> from relational_tensors.exchange.text import parse
    >>> from relational_tensors.machine.machines import get_topology
    >>> prog = parse("GPUS: 0, 1\\nPARTITIONS: F0 {size 1}\\nIN: A @ 0, B @ 1\\nOUT: A+B @ F0")
    >>> body, m = make_searcher(get_topology("dgx-a100"))(prog, {"F0": (0,)})
    >>> sorted(len(a.aggregate) for a in body), m
    ([1, 2], {'F0': (0,)})
    """
    return Searcher(topology, seed, budget_s, max_steps, total_steps)
