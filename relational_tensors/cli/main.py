"""The command line: plan a graph, look at the plan, simulate and trace it, query catalogs.

    relational-tensors demo                                  # plan, run and check a LLaMA-style block
    relational-tensors plan model.py --devices cpu:8         # the plan table and the predicted time
    relational-tensors exchange model.py q_proj              # one operator's exchange program
    relational-tensors sql plans.duckdb "SELECT * FROM plan" # a catalog written by plan --catalog

A model file is Python defining ``build()`` that returns an ``rt.Graph`` (or a
``(torch module, example inputs)`` pair, traced with ``rt.from_torch``), or a
module-level ``graph``.  ``--json`` prints machine-readable results on stdout;
errors print one line on stderr and exit with status 1 (``--debug`` shows the
traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import math
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from relational_tensors.cli.model_file import load_graph, load_model
from relational_tensors.cli.output import Ui
from relational_tensors.errors import CommandError, RelationalTensorsError

__all__ = ["main", "CommandError", "load_graph", "parse_bytes"]

PROG = "relational-tensors"
DEMO_TRACE = "relational_tensors_demo_trace.json"


# ---------------------------------------------------------------------------------------------- output


def _seconds(t: float) -> str:
    """A duration with a unit people read at a glance."""
    if t < 1e-3:
        return f"{t * 1e6:.1f} µs"
    if t < 1.0:
        return f"{t * 1e3:.3f} ms"
    return f"{t:.3f} s"


def _escape(s: object) -> str:
    from rich.markup import escape

    return escape(str(s))


# ---------------------------------------------------------------------------------------------- inputs


_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """A byte count with an optional unit (decimal ``GB``, binary ``GiB``).

    >>> parse_bytes("80GiB"), parse_bytes("1.5e9"), parse_bytes("512 MB")
    (85899345920, 1500000000, 512000000)
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"expected a byte count such as 80GiB, 512MB or 1e9; got {text!r}")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"memory per device must be at least one byte; got {text!r}")
    from relational_tensors.driver.options import MAX_MEMORY

    if not value <= MAX_MEMORY:
        raise argparse.ArgumentTypeError(f"memory per device must be at most 2**62 bytes (4 EiB); got {text!r}")
    return int(value)


def _device_arg(text: str | None) -> object:
    """The --devices text as compileGraph's device argument; default: every GPU, else 8 virtual CPUs."""
    if text is None:
        from relational_tensors.machine.devices import visible_gpus

        return None if visible_gpus() else "cpu:8"
    text = text.strip()
    if text.isdigit():
        return int(text)
    if re.fullmatch(r"\d+(\s*,\s*\d+)+", text):
        return "cuda:" + text.replace(" ", "")
    return text


def _topology_arg(name: str) -> Any:
    """A registered topology name, or the path of a topology JSON file (loaded)."""
    from relational_tensors.machine.machines import get_topology
    from relational_tensors.machine.topology import Topology

    if name.endswith(".json") or Path(name).is_file():
        if not Path(name).is_file():
            raise CommandError(f"no topology file {name!r}; give a registered name or an existing JSON file.")
        return Topology.from_json(Path(name))
    get_topology(name)  # raises ExchangeError naming the known topologies
    return name


def _topology_name(topology: Any) -> str:
    return topology if isinstance(topology, str) else topology.name


# ---------------------------------------------------------------------------------------------- compiling


def _compile(args: argparse.Namespace, ui: Ui, graph: Any) -> Any:
    from relational_tensors.api.compile import compileGraph, save_plan
    from relational_tensors.dp_optimizer.plans import PLANS
    from relational_tensors.machine.target import Target

    device = _device_arg(args.devices)
    constraints: dict[str, str] = {}
    if args.hand_plan:
        p = Target.resolve(device, args.topology_value, args.calibration).p
        constraints.update(PLANS[args.hand_plan](graph, p))
    given: dict[str, str] = {}
    for text in args.constraint:
        target, sep, value = text.partition("=")
        if not sep or not target or not value:
            raise CommandError(f"--constraint is NAME=VALUE (an operator's split or an input's layout, e.g. "
                               f"attention=heads_kv=8 or x=S(0)); got {text!r}.")
        if target in given and given[target] != value:
            raise CommandError(f"each --constraint names a different operator or tensor; {target!r} got two, "
                               f"--constraint {target}={given[target]} and --constraint {text}; keep one.")
        given[target] = value
    constraints.update(given)  # after --plan: a --constraint overrides the hand plan's choice for its target
    with ui.compiling(f"planning {len(graph.operators)} operators for {device or 'every GPU'}"):
        cg = compileGraph(graph, device=device, selector=args.selector, seed=args.seed,
                             cost_model=args.cost_model, memory_per_device=args.memory_per_device,
                             catalog=args.catalog, tactic=args.tactic, schedule_mode=args.schedule,
                             topology=args.topology_value, search_budget_s=args.search_budget,
                             search_steps=args.search_steps, search_total_steps=args.search_total_steps,
                             calibration=args.calibration, attention=args.attention, refine=not args.no_refine,
                             keep_states=args.keep_states, constraints=constraints or None)
    if args.save_plan:
        save_plan(cg, args.save_plan)
    return cg


def _load_and_compile(args: argparse.Namespace, ui: Ui) -> Any:
    args.topology_value = _topology_arg(args.topology)  # an unknown topology fails before any work
    # whatever the model file prints goes to stderr, so that --json output stays parseable
    with ui.status(f"loading {args.file}"), contextlib.redirect_stdout(sys.stderr if ui.json else sys.stdout):
        graph = load_graph(args.file)
    return _compile(args, ui, graph)


def _summary(cg: Any, args: argparse.Namespace) -> dict[str, Any]:
    return {"file": getattr(args, "file", None), "devices": str(cg.devices), "p": cg.p,
            "selector": cg.plan.selector, "cost_model": cg.plan.cost_model, "plan_cost": cg.plan.cost,
            "planning_s": sum(cg.timings.values())}


def _width(ui: Ui) -> int:
    return max(ui.out.width, 100)


# ---------------------------------------------------------------------------------------------- commands


def cmd_run(args: argparse.Namespace, ui: Ui) -> int:
    """Plan and run a model file (--devices dist under torchrun: one process per device, rank 0 reports)."""
    import numpy as np

    from relational_tensors.graph.reference import reference

    args.topology_value = _topology_arg(args.topology)
    with ui.status(f"loading {args.file}"), contextlib.redirect_stdout(sys.stderr if ui.json else sys.stdout):
        graph, feeds_of = load_model(args.file)
        feeds = feeds_of()
    cg = _compile(args, ui, graph)
    ex = cg.executor
    lead = getattr(ex, "rank", 0) == 0  # a distributed run: every rank runs, rank 0 reports
    t0 = time.perf_counter()
    with ui.status(f"running on {cg.p} devices"):
        cg.load(feeds)
        times = []
        for _ in range(args.rounds):
            t1 = time.perf_counter()
            cg.execute()
            cg.synchronize()
            times.append(time.perf_counter() - t1)
        outs = {name: np.asarray(cg.offload(name)) for name in graph.outputs}
    ran = time.perf_counter() - t0
    cg.close()  # a distributed run: every rank done, the group torn down before any process exits
    want = reference(graph, feeds) if args.check else {}
    rows, ok = [], True
    for name, out in outs.items():
        row = {"output": name, "shape": list(out.shape), "dtype": str(out.dtype),
               "sum": float(np.sum(out, dtype=np.float64)), "max_abs": float(np.max(np.abs(out), initial=0))}
        if args.check:
            ref = np.asarray(want[name], dtype=np.float64)
            row["max_relative_difference"] = err = float(np.max(np.abs(out - ref), initial=0) / max(
                float(np.max(np.abs(ref), initial=0)), 1e-30))
            ok = ok and err <= args.tolerance
        rows.append(row)
    if not lead:
        return 0 if ok else 1
    if ui.json:
        ui.result({**_summary(cg, args), "ran_s": ran, "execute_s": times, "outputs": rows, "ok": ok})
    else:
        for r, out in zip(rows, outs.values()):
            check = f"; max relative difference {r['max_relative_difference']:.1e}" if args.check else ""
            ui.say(f"{r['output']}: {out.dtype} {out.shape}, sum {r['sum']:.6g}, max |x| {r['max_abs']:.4g}{check}")
        ui.say(f"ran on {cg.p} devices ({cg.devices}{', one process each' if hasattr(ex, 'rank') else ''}) "
               f"in {ran:.2f}s; execute {_seconds(min(times))} (best of {len(times)})"
               + ("" if not args.check else " [green]OK[/]" if ok else " [red]MISMATCH[/]"))
    return 0 if ok else 1


def cmd_plan(args: argparse.Namespace, ui: Ui) -> int:
    from relational_tensors.driver.visualize import plan_rows, plan_table

    cg = _load_and_compile(args, ui)
    rows = plan_rows(cg)
    topo = _topology_name(args.topology_value)
    try:
        with ui.status(f"simulating on {topo}"):
            predicted: float | None = cg.simulate(args.topology_value, args.calibration)
        why = None
    except RelationalTensorsError as e:  # the plan stands even where this topology cannot hold it
        predicted, why = None, str(e)
    if ui.json:
        ui.result({**_summary(cg, args), "topology": topo, "predicted_s": predicted,
                   **({"simulation_error": why} if why else {}), "rows": rows})
        return 0
    ui.text(plan_table(cg, rows, width=_width(ui), titled=ui.people))
    if predicted is not None:
        ui.text(f"predicted time of one execution on {topo}: {_seconds(predicted)}" if ui.people
                else f"predicted_s {predicted!r}")
    else:
        ui.text(f"not simulated on {topo}: {why}")
    if args.catalog and ui.people:
        ui.say(f"catalog written to {_escape(args.catalog)} (query it with: {PROG} sql {_escape(args.catalog)})")
    return 0


def cmd_explain(args: argparse.Namespace, ui: Ui) -> int:
    from relational_tensors.driver.visualize import plan_rows, plan_table

    cg = _load_and_compile(args, ui)
    rows = plan_rows(cg)
    if ui.json:
        ui.result({**_summary(cg, args), "rows": rows})
    else:
        ui.text(plan_table(cg, rows, width=_width(ui), titled=ui.people))
    return 0


def cmd_simulate(args: argparse.Namespace, ui: Ui) -> int:
    cg = _load_and_compile(args, ui)
    topo = _topology_name(args.topology_value)
    with ui.status(f"simulating on {topo}"):
        t = cg.simulate(args.topology_value, args.calibration)
    if ui.json:
        ui.result({**_summary(cg, args), "topology": topo, "predicted_s": t})
    elif ui.quiet:
        print(repr(t))
    else:
        ui.say(f"predicted time of one execution of {_escape(args.file)} planned for {cg.devices} on {topo}: "
               f"[bold]{_seconds(t)}[/] ({cg.dag.summary()})")
    return 0


def cmd_trace(args: argparse.Namespace, ui: Ui) -> int:
    cg = _load_and_compile(args, ui)
    topo = _topology_name(args.topology_value)
    with ui.status(f"simulating on {topo}"):
        path = cg.trace(args.out, args.topology_value, args.calibration)
        t = cg.simulate(args.topology_value, args.calibration)
    events = len(json.loads(Path(path).read_text())["traceEvents"])
    if ui.json:
        ui.result({**_summary(cg, args), "topology": topo, "path": path, "events": events, "predicted_s": t})
    elif ui.quiet:
        print(path)
    else:
        ui.say(f"wrote {events} trace events ({_seconds(t)} predicted on {topo}) to [bold]{_escape(path)}[/]; "
               "open it in https://ui.perfetto.dev or chrome://tracing")
    return 0


def cmd_exchange(args: argparse.Namespace, ui: Ui) -> int:
    cg = _load_and_compile(args, ui)
    programs = cg.exchange_programs()
    name = args.op
    if name not in programs and f"save:{name}" in programs:
        name = f"save:{name}"
    if name not in programs:
        ops = {n.name for n in cg.graph.operators}
        if name in ops:  # a real operator that reads only graph inputs: nothing moves
            text = None
        else:
            saved = ", ".join(cg.graph.outputs)
            raise CommandError(f"no operator or saved output named {args.op!r} in {args.file}; operators: "
                               f"{', '.join(n.name for n in cg.graph.operators)}; saved outputs: {saved}.")
    else:
        text = programs[name]
    if ui.json:
        ui.result({"op": name, "devices": str(cg.devices), "program": text})
    elif text is None:
        ui.text(f"{name} reads only graph inputs, which are loaded straight into the blocks it reads; "
                "it has no exchange program.")
    else:
        ui.say(f"[bold]exchange program of {_escape(name)}[/] (p={cg.p}, {cg.devices}, split "
               f"{_escape(cg.plan.split(name) if not name.startswith('save:') else 'saved output')})")
        ui.text(text)
    return 0


def _render_table(table: Any, ui: Ui, caption: str | None) -> str:
    import io

    from rich.console import Console
    from rich.table import Table

    rows = [[_cell(v) for v in row.values()] for row in table.to_pylist()]
    names = table.column_names
    width = _width(ui)
    # what each column needs (cells past 40 characters are truncated): a table that cannot fit is shown
    # vertically, one "column: value" line per field, as DuckDB's own CLI does
    need = sum(min(max([len(n), *(len(r[k]) for r in rows)]), 40) + 3 for k, n in enumerate(names)) + 1
    if names and need > width:
        pad = max(len(n) for n in names)
        lines = []
        for k, r in enumerate(rows):
            lines.append(f"-- row {k + 1} " + "-" * max(0, min(width, 60) - 10 - len(str(k + 1))))
            lines += [f"{n.rjust(pad)} : {v}" for n, v in zip(names, r)]
        text = "\n".join(lines) + ("\n" if lines else "")
        return text + (f"{caption}\n" if caption and ui.people else "")
    out = Table()
    for col in names:
        out.add_column(col, overflow="ellipsis", max_width=40)
    for r in rows:
        out.add_row(*r)
    buf = io.StringIO()
    Console(file=buf, width=width, force_terminal=False, color_system=None).print(out)
    return buf.getvalue() + (f"{caption}\n" if caption and ui.people else "")


def _cell(v: Any) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, float):
        if math.isfinite(v) and v.is_integer() and abs(v) < 1e15:
            return f"{v:,.0f}"
        return f"{v:.6g}"
    return str(v)


def cmd_sql(args: argparse.Namespace, ui: Ui) -> int:
    """SQL on a catalog file: the statements of QUERY, of ``-f FILE`` or of stdin (split by DuckDB's own
    statement splitter), each result shown.  The file is opened read-only unless ``--write``, and always
    sandboxed (``catalog.files.SANDBOX``): no statement reaches another file.  Each statement's kind
    (``duckdb.StatementType``) is checked (``_allowed``) before any of the script runs."""
    from relational_tensors.catalog import Catalog
    from relational_tensors.catalog.files import split_statements

    if not Path(args.catalog_file).is_file():
        raise CommandError(f"no catalog file {args.catalog_file!r}; write one with "
                           f"`{PROG} plan MODEL.py --catalog {args.catalog_file}`.")
    if args.query is not None and args.file is not None:
        raise CommandError("give the SQL once: as QUERY or with -f FILE, not both.")
    script = args.query
    if args.file is not None:
        try:
            script = Path(args.file).read_text()
        except OSError as e:
            raise CommandError(f"cannot read the SQL file {args.file!r}: {e.strerror or e}.") from None
    statements = None if script is None else _allowed(split_statements(script), args.write)
    cat = Catalog(args.catalog_file, read_only=not args.write, sandboxed=True)
    try:
        if statements is None and sys.stdin.isatty():
            return _prompt(cat, ui, args)
        if statements is None:
            statements = _allowed(split_statements(sys.stdin.read()), args.write)
        results = []
        for statement in statements:
            results.append(_run_statement(cat, statement, ui, args))
        if ui.json:  # one statement: its rows, as a query always printed; several: each with its rows
            ui.result(results[0]["rows"] if len(results) == 1 else results)
        return 0
    finally:
        cat.close()


def _allowed(statements: list[tuple[str, str]], write: bool) -> list[str]:
    """The statements' text, once every one's kind is one the sql command runs (``catalog.files.READS``,
    and ``WRITES`` with ``--write``); else a ``CommandError`` naming the first other one, before any runs."""
    from relational_tensors.catalog.files import READS, WRITES

    for query, kind in statements:
        if kind in READS or (write and kind in WRITES):
            continue
        if kind in WRITES:
            raise CommandError(f"the sql command opens the catalog read-only unless --write; got a {kind} "
                               f"statement, which may change it: {_shorten(query)}. Nothing of the script ran. "
                               "Add --write to change the file.")
        shown = {"LOAD": "LOAD statement (INSTALL or LOAD)",
                 "unknown": "statement of a kind this duckdb module does not name"}.get(kind, f"{kind} statement")
        raise CommandError(f"the sql command reaches the catalog file only, not other files, databases or "
                           f"extensions, so it runs no {shown}, with or without --write; got: "
                           f"{_shorten(query)}. Nothing of the script ran. To save a result, print it with "
                           f"--csv or --json and redirect it (`{PROG} sql --csv CATALOG \"SELECT ...\" > "
                           "out.csv`); to copy, export, attach or use an extension, open the file with DuckDB itself.")
    return [query for query, _ in statements]


def _run_statement(cat: Any, query: str, ui: Ui, args: argparse.Namespace) -> dict[str, Any]:
    import duckdb
    import pyarrow as pa

    from relational_tensors.errors import CatalogError

    t0 = time.perf_counter()
    try:
        rel = cat.con.sql(query)
        table = rel.to_arrow_table() if rel is not None else pa.table({})
    except duckdb.Error as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(e, duckdb.PermissionException):
            raise CommandError(f"the sql command reaches the catalog file only (DuckDB's enable_external_access "
                               f"is off in its connection); got a statement that reaches another file or an "
                               f"extension ({first}): {_shorten(query)}. Read other files with DuckDB itself, "
                               "or load them into a catalog of your own.") from None
        if "configuration has been locked" in first:
            raise CommandError(f"the sql command's connection keeps its settings (DuckDB's lock_configuration); "
                               f"got a statement that changes one ({first}): {_shorten(query)}. Leave the "
                               "setting out; SET VARIABLE still works.") from None
        if cat.read_only and "read-only" in first:
            raise CommandError(f"the catalog {cat.path!r} is opened read-only, and this statement writes "
                               f"({first}); add --write to change the file. Got: {_shorten(query)}") from None
        raise CatalogError(f"catalog query failed: {first}; got {query!r}.") from None
    took = time.perf_counter() - t0
    if not ui.json:
        if args.csv:
            ui.text(_csv(table))
        else:
            rows = f"{table.num_rows} row{'' if table.num_rows == 1 else 's'}"
            ui.text(_render_table(table, ui, f"{rows} in {_seconds(took)}"))
    return {"statement": query, "rows": table.to_pylist()}


def _shorten(query: str, n: int = 80) -> str:
    text = " ".join(query.split())
    return text if len(text) <= n else text[: n - 3] + "..."


def _csv(table: Any) -> str:
    import io

    import pyarrow.csv as pacsv

    buf = io.BytesIO()
    pacsv.write_csv(table, buf)
    return buf.getvalue().decode()


def _prompt(cat: Any, ui: Ui, args: argparse.Namespace) -> int:
    """Read statements from the terminal until EOF or ``.quit``: a statement runs once a line ends it with
    ``;``; errors are reported and reading goes on."""
    from relational_tensors.catalog.files import split_statements

    if ui.people:
        ui.say(f"catalog {_escape(cat.path)}{' (read-only)' if cat.read_only else ''}: SQL statements end "
               "with ';'; views plan, specs, plan_inputs, op_times; .tables lists tables, .quit ends.")
    pending = ""
    while True:
        sys.stdout.write("sql> " if not pending else "...> ")
        sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            break
        command = line.strip()
        if not pending and command in (".quit", ".exit", "\\q"):
            break
        if not pending and command == ".tables":
            command = "SELECT table_name, table_type FROM information_schema.tables ORDER BY table_name;"
        pending += command + "\n"
        if not pending.rstrip().endswith(";"):
            continue
        try:
            for statement in _allowed(split_statements(pending), args.write):
                _run_statement(cat, statement, ui, args)
        except RelationalTensorsError as e:
            _error_line(e)
        pending = ""
    return 0


def cmd_query(args: argparse.Namespace, ui: Ui) -> int:
    """A named query of ``sql/queries`` over one compilation of a catalog file (the latest by default)."""
    from relational_tensors.catalog import Catalog

    if not Path(args.catalog_file).is_file():
        raise CommandError(f"no catalog file {args.catalog_file!r}; write one with "
                           f"`{PROG} plan MODEL.py --catalog {args.catalog_file}`.")
    params: dict[str, Any] = {}
    for item in args.param:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise CommandError(f"--param takes NAME=VALUE; got {item!r}.")
        params[key] = int(value) if re.fullmatch(r"-?[0-9]+", value) else value  # bound, never spliced in
    cat = Catalog(args.catalog_file, read_only=True)  # read-only catalogs are sandboxed (files.SANDBOX)
    try:
        cid = args.compilation
        if cid is None:
            (cid,), = cat.execute("SELECT coalesce(max(compilation_id), 0) FROM compilations").fetchall()
            if not cid:
                raise CommandError(f"the catalog {args.catalog_file!r} holds no compilation yet.")
        cat.narrow(int(cid))
        t0 = time.perf_counter()
        table = cat.query(args.name, defaults={"cid": int(cid)}, **params)
        took = time.perf_counter() - t0
        if ui.json:
            ui.result(table.to_pylist())
        elif args.csv:
            ui.text(_csv(table))
        else:
            rows = f"{table.num_rows} row{'' if table.num_rows == 1 else 's'}"
            ui.text(_render_table(table, ui, f"{args.name} on compilation {cid}: {rows} in {_seconds(took)}"))
        return 0
    finally:
        cat.close()


def cmd_calibrate(args: argparse.Namespace, ui: Ui) -> int:
    name = "relational_tensors.kernels.probes"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        need = name if e.name == name else e.name
        raise CommandError(f"calibration measures kernels and transfers on a GPU and needs the module {need}, "
                           "which this installation does not have; run it on a GPU machine with the gpu extras.") from e
    return int(module.main(list(args.rest)) or 0)


def cmd_demo(args: argparse.Namespace, ui: Ui) -> int:
    import numpy as np

    from relational_tensors.api.compile import compileGraph
    from relational_tensors.driver.visualize import plan_rows, plan_table, show_tiling
    from relational_tensors.graph.models import llama_block, llama_feeds
    from relational_tensors.graph.reference import reference

    topology = _topology_arg(args.topology)
    topo = _topology_name(topology)
    device = _device_arg(args.devices)
    g = llama_block(batch=2, seq=256, d_model=256, n_heads=8, n_kv_heads=2, d_ff=704, dtype="float32",
                    seq_ends=[64, 100, 256])
    ui.say("[bold]LLaMA-style block[/]: batch 2 x 256 tokens (packed: 3 sequences), d_model 256, "
           "8 query / 2 kv heads, d_ff 704, float32")
    t0 = time.perf_counter()
    with ui.status("planning"):
        cg = compileGraph(g, device=device, topology=topology)
    planned = time.perf_counter() - t0
    rows = plan_rows(cg)
    if ui.people:
        ui.text(plan_table(cg, rows, width=_width(ui)))
        ui.text(show_tiling(cg, "y", width=_width(ui)))
    ui.say(f"planned for {cg.devices} in {planned:.3f}s; task DAG: {cg.dag.summary()}")
    feeds = llama_feeds(g)
    t0 = time.perf_counter()
    with ui.status(f"running on {cg.p} devices"):
        out = cg.run(feeds)["y"]
    ran = time.perf_counter() - t0
    ref = reference(g, feeds)["y"]
    err = float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))
    ok = err < 1e-4
    peak = max(cg.memory().values())
    predicted = cg.simulate(topology)
    trace = cg.trace(args.trace, topology)
    verdict = "[green]OK[/]" if ok else "[red]MISMATCH[/]"
    if ui.json:
        ui.result({**_summary(cg, args), "ok": ok, "max_relative_difference": err, "planned_s": planned,
                   "ran_s": ran, "peak_bytes_per_device": peak, "topology": topo, "predicted_s": predicted,
                   "trace": trace, "rows": rows})
    elif ui.quiet:
        print(f"{'OK' if ok else 'MISMATCH'} max relative difference {err:.1e}; predicted {_seconds(predicted)} "
              f"on {topo}; trace {trace}")
    else:
        ui.say(f"ran on {cg.p} devices in {ran:.2f}s; peak memory per device {peak / 2**20:.1f} MiB; "
               f"max relative difference from the single-device reference: {err:.1e} {verdict}")
        ui.say(f"predicted time of one execution on {topo}: [bold]{_seconds(predicted)}[/]; "
               f"trace written to [bold]{_escape(trace)}[/] (open in https://ui.perfetto.dev)")
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------------- parser


def _global_flags(parser: argparse.ArgumentParser, here: bool) -> None:
    """--json/--quiet/--debug, accepted before or after the subcommand.  In a subparser the default is
    SUPPRESS, so a flag given before the subcommand is not reset by the subparser's default."""
    default: Any = False if here else argparse.SUPPRESS
    parser.add_argument("--json", action="store_true", default=default,
                        help="machine-readable output: results as JSON on stdout")
    parser.add_argument("--quiet", "-q", action="store_true", default=default, help="print only the result")
    parser.add_argument("--debug", action="store_true", default=default, help="show tracebacks on errors")


def _choices(option: str) -> tuple[str, ...]:
    from relational_tensors.driver.options import CompileOptions

    return CompileOptions.choices(option)


def _default(option: str) -> Any:
    from relational_tensors.driver.options import CompileOptions

    return CompileOptions.default(option)


def _plan_options(parser: argparse.ArgumentParser) -> None:
    from relational_tensors.dp_optimizer.plans import PLANS

    parser.add_argument("file", metavar="FILE", help="Python file defining build() -> rt.Graph, or graph")
    o = parser.add_argument_group("planning")
    o.add_argument("--devices", "--device", dest="devices", metavar="DEV",
                   help="cpu:N (virtual CPUs), N or 0,1,.. (GPUs, may be absent when only planning), "
                        "cuda:0,0 (devices sharing a GPU); default: every GPU, else cpu:8")
    o.add_argument("--topology", default=_default("topology"),
                   help="machine simulated: a registered name or a topology JSON file (default: hgx-h200)")
    o.add_argument("--selector", default=_default("selector"), choices=_choices("selector"), help="spec selector")
    o.add_argument("--cost-model", default=_default("cost_model"), choices=_choices("cost_model"),
                   help="cost model (calibrated: seconds on --topology with --calibration's kernel rates)")
    o.add_argument("--schedule", default=_default("schedule_mode"), choices=_choices("schedule_mode"),
                   help="exchange-program synthesis")
    o.add_argument("--search-steps", type=int, default=None, metavar="N",
                   help="with --schedule search: at most N proposals judged per program")
    o.add_argument("--search-total-steps", type=int, default=_default("search_total_steps"), metavar="N",
                   help="with --schedule search: proposals judged over the plan, spread by each program's naive "
                        "time (reproducible for a --seed); default %(default)s")
    o.add_argument("--search-budget", type=float, default=_default("search_budget_s"), metavar="S",
                   help="seconds of search per exchange program with --schedule search")
    o.add_argument("--attention", default=_default("attention"), choices=_choices("attention"),
                   help="GPU attention kernel (flash: flash-attn or PyTorch's where it applies)")
    o.add_argument("--tactic", default=_default("tactic"), choices=_choices("tactic"), help="DP tactic")
    o.add_argument("--no-refine", action="store_true",
                   help="keep Algorithm 1's choice (no coordinate descent across the tensors it cuts)")
    o.add_argument("--keep-states", default=_default("keep_states"), choices=_choices("keep_states"),
                   help="how assigned states stay on the devices between steps (auto: as read, sharded "
                        "where memory needs it)")
    o.add_argument("--seed", type=int, default=_default("seed"), help="seed of the random selector and the search")
    o.add_argument("--memory-per-device", type=parse_bytes, default=None, metavar="BYTES",
                   help="memory limit per device, e.g. 80GiB")
    o.add_argument("--plan", dest="hand_plan", default=None, choices=sorted(PLANS),
                   help="constrain the plan to a hand-written strategy (rt.plans), the rest the optimizer's")
    o.add_argument("--constraint", action="append", default=[], metavar="NAME=VALUE",
                   help="pin an operator's split (attention=heads_kv=8) or an input's or state's layout "
                        "(x=S(0), wq=R); repeatable, applied after --plan")
    o.add_argument("--save-plan", default=None, metavar="PATH",
                   help="save the compiled plan (rt.load_plan(PATH, graph) reloads it without planning)")
    o.add_argument("--catalog", default=None, metavar="PATH", help="persist the catalog in this DuckDB file")
    o.add_argument("--calibration", default=None, metavar="PATH",
                   help="kernel calibration file (relational-tensors calibrate) for simulation and cost models")


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors on one line (the rule, what was given, where help is), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from relational_tensors._version import __version__
    from relational_tensors.machine.machines import TOPOLOGIES

    parser = _Parser(
        prog=PROG, description="Plan AI computations over many devices as joins followed by aggregations.",
        epilog=f"topologies: {', '.join(TOPOLOGIES)}. Run `{PROG} COMMAND --help` for a command's options.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _global_flags(parser, here=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func: Callable[[argparse.Namespace, Ui], int], help: str,
            **kw: Any) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, **kw)
        _global_flags(p, here=False)
        p.set_defaults(func=func)
        return p

    d = add("demo", cmd_demo, "plan, run and check a LLaMA-style block on every GPU (or 8 virtual CPUs)")
    d.add_argument("--devices", "--device", dest="devices", metavar="DEV",
                   help="cpu:N, cuda:0,1,... (default: every GPU, else cpu:8)")
    d.add_argument("--topology", default="hgx-h200", help="the machine the plan is simulated on")
    d.add_argument("--trace", default=f"./{DEMO_TRACE}", metavar="PATH", help="where to write the Chrome trace")

    _plan_options(add("plan", cmd_plan, "print the plan table (with placements) and the predicted time"))
    r = add("run", cmd_run, "plan and run a model file (--devices dist: one process per device under torchrun)")
    _plan_options(r)
    r.add_argument("--rounds", type=int, default=1, metavar="N", help="executions to run (and time)")
    r.add_argument("--check", action="store_true", help="compare every output with the single-device reference")
    r.add_argument("--tolerance", type=float, default=1e-4, metavar="T",
                   help="--check's largest relative difference (to the output's largest magnitude)")
    _plan_options(add("explain", cmd_explain, "print the plan table only"))
    _plan_options(add("simulate", cmd_simulate, "print the predicted seconds of one execution on --topology"))
    t = add("trace", cmd_trace, "write a Chrome/Perfetto trace of the simulated execution")
    _plan_options(t)
    t.add_argument("out", metavar="OUT.json", help="the trace file to write")
    e = add("exchange", cmd_exchange, "print one operator's exchange program (ExProg text)")
    _plan_options(e)
    e.add_argument("op", metavar="OP_NAME", help="an operator name (or a saved output's name)")
    s = add("sql", cmd_sql, "run SQL statements on a catalog file: QUERY, -f FILE or stdin (read-only "
            "unless --write; no statement reaches another file)")
    s.add_argument("catalog_file", metavar="CATALOG.duckdb")
    s.add_argument("query", nargs="?", default=None, metavar="QUERY",
                   help="one or more statements separated by ';'")
    s.add_argument("-f", "--file", default=None, metavar="FILE", help="read the statements from FILE")
    s.add_argument("--write", action="store_true", help="open the file for writing: INSERT, UPDATE, DELETE, "
                   "MERGE, CREATE, DROP, ALTER, VACUUM, ANALYZE may change it (COPY, EXPORT, ATTACH, INSTALL, "
                   "LOAD are refused either way)")
    s.add_argument("--csv", action="store_true", help="print each result as CSV")
    q = add("query", cmd_query, "run a named query (sql/queries) on one compilation of a catalog file")
    q.add_argument("catalog_file", metavar="CATALOG.duckdb")
    q.add_argument("name", metavar="NAME", help="a named query: " + ", ".join(_query_list()))
    q.add_argument("--compilation", type=int, default=None, metavar="ID", help="default: the latest")
    q.add_argument("--param", action="append", default=[], metavar="NAME=VALUE", help="a $NAME of the query")
    q.add_argument("--csv", action="store_true", help="print the result as CSV")
    c = add("calibrate", cmd_calibrate, "measure this GPU's kernels for the simulator (needs a GPU); "
            "arguments after it go to the calibration module", add_help=False)
    c.set_defaults(rest=[])
    return parser


def _query_list() -> list[str]:
    from relational_tensors.catalog.catalog import _query_names

    return list(_query_names())


def _error_line(e: BaseException) -> None:
    msg = " ".join(str(e).split()) or type(e).__name__
    if not isinstance(e, (RelationalTensorsError, OSError)):
        msg = f"{type(e).__name__}: {msg} (run with --debug for the traceback)"
    print(f"{PROG}: error: {msg}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 success, 1 failure, 2 bad usage)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # only flags without values come before the command; everything after `calibrate` is its module's
    command = next((i for i, tok in enumerate(argv) if not tok.startswith("-")), None)
    if command is not None and argv[command] == "calibrate":
        args = parser.parse_args(argv[:command + 1])
        args.rest = argv[command + 1:]
    else:
        args = parser.parse_args(argv)
    ui = Ui(json=args.json, quiet=args.quiet, debug=args.debug)
    if args.debug:  # the library's own log (per-pass timings) on stderr too
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    try:
        return int(args.func(args, ui))
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - every failure becomes one line unless --debug
        if args.debug:
            raise
        _error_line(e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
