"""A compiled program as data: the encoding of a plan file's body, without pickle.

The program (the logical plan, the task DAG with its exchange programs, the liveness, the options) is a
tree of the package's own classes, Python containers and NumPy arrays.  :func:`encode` writes it as one
JSON document plus binary blobs (arrays as ``.npy`` bytes without pickled objects, catalog rows as Arrow
IPC streams); :func:`decode` reads it back.  Every value is tagged: a JSON array is a container or an
object whose first element names what it is.

- ``["T", ...]``, ``["L", ...]``, ``["S", ...]``, ``["Z", ...]``: tuple, list, set, frozenset (``["t", [...]]``
  and ``["l", [...]]``: a tuple or list of strings and integers only, read in one piece);
  ``["D", k, v, k, v, ...]``: a dict (keys of any encodable kind).
- ``["p", "module:Class", v, ...]``: an instance whose slots (in their order) all hold integers,
  strings or tuples of them (boxes, intervals), each tuple written as an array;
- ``["q", "module:Class", v, ...]``: an instance with slots only, every one set, its values in slot order;
- ``["O", "module:Class", state, slots]``: an instance of a class of this package (``state``: a JSON
  object of its ``__dict__``; ``slots``: the names and values of its slots), rebuilt without calling its
  constructor (``object.__new__``, then its attributes set); ``["R", n]``: the ``n``-th object or
  container met so far (shared references, and sharing, survive).
- ``["A", k]``: the ``k``-th blob as an array; ``["W", k]``: as an Arrow table; ``["N", dtype, value]``:
  a NumPy scalar; ``["F", "nan"]`` and the infinities; ``["P", path]``; ``["G"]``: the caller's graph;
  ``["V", id]``: node ``id`` of that graph.

Loading never runs code from the file: a class is looked up only inside ``relational_tensors`` (a name
outside it, or one that is not a class, refuses the file), no constructor or ``__setstate__`` is called,
and arrays load with ``allow_pickle=False``.

>>> import numpy as np
>>> body, blobs = encode({"a": (1, 2.5, float("inf")), "b": [np.arange(3)]}, graph=None)
>>> back = decode(body, blobs, graph=None)
>>> back["a"], back["b"][0].tolist()
((1, 2.5, inf), [0, 1, 2])
"""

from __future__ import annotations

import functools
import importlib
import io
import itertools
import json
import math
import types
from pathlib import PurePath
from typing import Any

import numpy as np
import pyarrow as pa

from relational_tensors.core.dtypes import numpy_dtype
from relational_tensors.errors import PlanError

__all__ = ["encode", "decode"]

PACKAGE = "relational_tensors"
_ATOMS = (str, int, bool, type(None))
_PLAIN = frozenset(_ATOMS)
_SCALARS = frozenset((str, int, float, bool, type(None)))
_CODE = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.ModuleType, functools.partial)


_LAYOUTS: dict[type, tuple[bool, tuple[str, ...] | None]] = {}


def _layout(cls: type) -> tuple[bool, tuple[str, ...] | None]:
    """Whether instances of ``cls`` have a ``__dict__``, and their slot names (None: no slots)."""
    found = _LAYOUTS.get(cls)
    if found is None:
        slotted = any("__slots__" in c.__dict__ for c in cls.__mro__ if c is not object)
        has_dict = any("__dict__" in c.__dict__ for c in cls.__mro__ if c is not object) or not slotted
        found = _LAYOUTS[cls] = (has_dict, _slot_names(cls) if slotted else None)
    return found


_SLOT_NAMES: dict[type, tuple[str, ...]] = {}


def _slot_names(cls: type) -> tuple[str, ...]:
    found = _SLOT_NAMES.get(cls)
    if found is None:
        found = _SLOT_NAMES[cls] = _find_slots(cls)
    return found


def _find_slots(cls: type) -> tuple[str, ...]:
    names: list[str] = []
    for klass in reversed(cls.__mro__):
        own = klass.__dict__.get("__slots__", ())
        for name in [own] if isinstance(own, str) else own:
            if not name.startswith("__") and name not in names:
                names.append(name)
    return tuple(names)


class _Encoder:
    def __init__(self, graph: Any) -> None:
        self.graph = graph
        self.seen: dict[int, int] = {}
        self.keep: list[Any] = []  # the objects met, alive while their ids are keys of seen
        self.blobs: list[bytes] = []

    def _memo(self, obj: Any) -> list | None:
        n = self.seen.get(id(obj))
        if n is not None:
            return ["R", n]
        self.seen[id(obj)] = len(self.keep)
        self.keep.append(obj)
        return None

    def blob(self, data: bytes) -> int:
        self.blobs.append(data)
        return len(self.blobs) - 1

    def value(self, v: Any) -> Any:  # noqa: C901 - one case per kind of value
        if isinstance(v, _ATOMS):
            return v
        if isinstance(v, float):
            return v if math.isfinite(v) else ["F", repr(v)]
        if self.graph is not None and v is self.graph:
            return ["G"]
        cls = type(v)
        if cls.__name__ == "Node" and cls.__module__ == f"{PACKAGE}.graph.graph" and self.graph is not None \
                and v.id < len(self.graph.nodes) and self.graph.nodes[v.id] is v:
            return ["V", v.id]
        if isinstance(v, np.generic):
            return ["N", v.dtype.name, v.item()]
        if isinstance(v, PurePath):
            return ["P", str(v)]
        ref = self._memo(v)
        if ref is not None:
            return ref
        if isinstance(v, np.ndarray):
            if v.dtype.hasobject:
                raise PlanError("a plan holding an array of Python objects cannot be saved.")
            buf = io.BytesIO()
            custom = v.dtype.kind == "V"  # bfloat16 (ml_dtypes): stored as its bits, named
            np.save(buf, v.view(np.uint16) if custom else v, allow_pickle=False)
            return ["A", self.blob(buf.getvalue()), v.dtype.name if custom else None]
        if isinstance(v, pa.Table):
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, v.schema) as writer:
                writer.write_table(v)
            return ["W", self.blob(sink.getvalue().to_pybytes())]
        if cls is tuple or cls is list:
            if all(type(x) in _PLAIN for x in v):  # ints, strings: one JSON array, decoded at once
                return ["t" if cls is tuple else "l", list(v)]
            return ["T" if cls is tuple else "L", *[self.value(x) for x in v]]
        if cls is dict:
            out: list[Any] = ["D"]
            for k, x in v.items():
                out += [self.value(k), self.value(x)]
            return out
        if cls is set or cls is frozenset:
            return ["S" if cls is set else "Z", *[self.value(x) for x in v]]
        if isinstance(v, (type, *_CODE)) or not cls.__module__.startswith(PACKAGE):
            raise PlanError(f"a plan holding a {cls.__module__}.{cls.__qualname__} cannot be saved; a plan file "
                            "stores the package's own classes, containers and arrays.")
        has_dict, slot_names = _layout(cls)
        if not has_dict and slot_names is not None:
            values = [getattr(v, s, _PENDING) for s in slot_names]
            name = f"{cls.__module__}:{cls.__qualname__}"
            if all(type(x) in _PLAIN or type(x) is tuple and all(type(y) in _PLAIN for y in x) for x in values):
                # slots of integers, strings and tuples of them (boxes, intervals): one array
                return ["p", name, *[list(x) if type(x) is tuple else x for x in values]]
            if _PENDING not in values:  # every slot set: the values in slot order
                return ["q", name, *[self.value(x) for x in values]]
        state = {k: self.value(x) for k, x in vars(v).items()} if has_dict else None
        slots = None
        if slot_names is not None:
            names = [s for s in slot_names if hasattr(v, s)]
            slots = [names, [self.value(getattr(v, s)) for s in names]]
        return ["O", f"{cls.__module__}:{cls.__qualname__}", state, slots]


def encode(tree: Any, graph: Any) -> tuple[bytes, list[bytes]]:
    """``tree`` as a JSON document and its binary blobs; ``graph`` (and its nodes) become references."""
    enc = _Encoder(graph)
    doc = enc.value(tree)
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode(), enc.blobs


_CLASSES: dict[str, type] = {}


def _class(name: Any) -> type:
    """The class ``module:qualname`` of this package; anything else refuses the file."""
    found = _CLASSES.get(name) if isinstance(name, str) else None
    if found is None:
        found = _CLASSES[name] = _find_class(name)
    return found


def _find_class(name: Any) -> type:
    if not isinstance(name, str) or ":" not in name:
        raise PlanError(f"names a class as {name!r}")
    module, qualname = name.split(":", 1)
    if module != PACKAGE and not module.startswith(PACKAGE + "."):
        raise PlanError(f"names the class {name!r}, outside {PACKAGE}")
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        raise PlanError(f"names the class {name!r}, which this package does not have") from None
    if not isinstance(obj, type) or issubclass(obj, BaseException):
        raise PlanError(f"names {name!r}, which is not a class a plan holds")
    return obj


class _Decoder:
    def __init__(self, blobs: list[bytes], graph: Any) -> None:
        self.blobs, self.graph = blobs, graph
        self.memo: list[Any] = []

    def _blob(self, k: Any) -> bytes:
        if not isinstance(k, int) or not 0 <= k < len(self.blobs):
            raise PlanError(f"refers to blob {k!r} of {len(self.blobs)}")
        return self.blobs[k]

    def value(self, v: Any) -> Any:  # noqa: C901 - one case per tag
        kind = type(v)
        if kind is not list:
            if kind in _SCALARS:
                return v
            raise PlanError("holds a value of no known kind")
        tag = v[0] if v else None
        memo = self.memo
        if tag == "R":  # the commonest tags first: this runs once per value of the program
            n = v[1] if len(v) == 2 else None
            if type(n) is not int or not 0 <= n < len(memo) or memo[n] is _PENDING:
                raise PlanError(f"refers to object {n!r} before it is made")
            return memo[n]
        slot = len(memo)
        memo.append(_PENDING)
        out: Any
        if tag == "q":
            cls = _class(v[1] if len(v) > 1 else None)
            names = _slot_names(cls)
            if len(v) - 2 != len(names) or _layout(cls)[0]:
                raise PlanError(f"holds a {v[1]} with slots it does not have")
            out = object.__new__(cls)
            memo[slot] = out
            put, inline = object.__setattr__, self.inline
            for name, x in zip(names, itertools.islice(v, 2, None)):
                put(out, name, inline(x))
        elif tag == "p":
            out = self._plain_object(v)
        elif tag == "t" or tag == "l":
            items = v[1] if len(v) == 2 else None
            if type(items) is not list:
                raise PlanError("holds a plain sequence that is not one")
            out = tuple(items) if tag == "t" else items
        elif tag == "T" or tag == "Z":
            inline = self.inline
            items = [inline(x) for x in itertools.islice(v, 1, None)]
            out = tuple(items) if tag == "T" else frozenset(items)
        elif tag == "O":
            out = self._object(v, slot)
        elif tag == "L" or tag == "S":
            out = [] if tag == "L" else set()
            memo[slot] = out
            add, inline = (out.append if tag == "L" else out.add), self.inline
            for x in itertools.islice(v, 1, None):
                add(inline(x))
        elif tag == "D":
            out = {}
            memo[slot] = out
            if len(v) % 2 == 0:
                raise PlanError("holds a dict with a key and no value")
            inline = self.inline
            for k in range(1, len(v), 2):
                key = inline(v[k])
                out[key] = inline(v[k + 1])
        else:
            memo.pop()
            return self._rare(v, tag, slot)
        memo[slot] = out
        return out

    def inline(self, x: Any) -> Any:
        """``value(x)``, with the commonest cases (a scalar, a reference, a plain tuple) done here."""
        kind = type(x)
        if kind is not list:
            return x if kind in _SCALARS else self.value(x)
        head = x[0] if x else None
        if head == "R" and len(x) == 2 and type(x[1]) is int and 0 <= x[1] < len(self.memo):
            found = self.memo[x[1]]
            if found is not _PENDING:
                return found
        elif head == "t" and len(x) == 2 and type(x[1]) is list:
            found = tuple(x[1])
            self.memo.append(found)
            return found
        return self.value(x)

    def _plain_object(self, v: list) -> Any:
        cls = _class(v[1] if len(v) > 1 else None)
        names = _slot_names(cls)
        if _layout(cls)[0] or len(v) - 2 != len(names):
            raise PlanError(f"holds a {v[1]} with slots it does not have")
        out: Any = object.__new__(cls)
        put = object.__setattr__
        for name, x in zip(names, itertools.islice(v, 2, None)):
            put(out, name, tuple(x) if type(x) is list else x)
        return out

    def _object(self, v: list, slot: int) -> Any:
        if len(v) != 4:
            raise PlanError("holds an object without its class, state and slots")
        cls = _class(v[1])
        out: Any = object.__new__(cls)
        self.memo[slot] = out
        state, slots = v[2], v[3]
        if state is not None:
            if type(state) is not dict or not hasattr(out, "__dict__"):
                raise PlanError(f"holds a {v[1]} with attributes it cannot take")
            inline = self.inline
            out.__dict__.update({k: inline(x) for k, x in state.items()})
        if slots is not None:
            if type(slots) is not list or len(slots) != 2:
                raise PlanError(f"holds a {v[1]} with slots written as {slots!r}")
            names, values = slots
            if type(names) is not list or type(values) is not list or len(names) != len(values) \
                    or not set(names) <= set(_slot_names(cls)):
                raise PlanError(f"holds a {v[1]} with slots it does not have")
            for name, x in zip(names, values):
                object.__setattr__(out, name, self.value(x))
        return out

    def _rare(self, v: list, tag: Any, slot: int) -> Any:
        """The tags met a few times a program: graph references, numbers, arrays and tables."""
        rest = v[1:]
        if tag == "F":
            return float(rest[0]) if rest and rest[0] in ("nan", "inf", "-inf") else _bad("a float", rest)
        if tag == "G":
            return self.graph
        if tag == "V":
            nodes = self.graph.nodes
            if len(rest) != 1 or type(rest[0]) is not int or not 0 <= rest[0] < len(nodes):
                raise PlanError(f"refers to node {rest!r} of a graph with {len(nodes)} nodes")
            return nodes[rest[0]]
        if tag == "N":
            if len(rest) != 2 or not isinstance(rest[0], str) or not isinstance(rest[1], (int, float, bool)):
                raise PlanError(f"holds a NumPy scalar written as {rest!r}")
            return np.array(rest[1], dtype=_dtype(rest[0]))[()]
        if tag == "P":
            return PurePath(rest[0]) if rest and isinstance(rest[0], str) else _bad("a path", rest)
        out: Any
        if tag == "A":
            out = np.load(io.BytesIO(self._blob(rest[0] if rest else None)), allow_pickle=False)
            if len(rest) > 1 and rest[1] is not None:
                out = out.view(_dtype(rest[1]))
        elif tag == "W":
            out = pa.ipc.open_stream(pa.BufferReader(self._blob(rest[0] if rest else None))).read_all()
        else:
            raise PlanError(f"holds a value tagged {tag!r}")
        self.memo.append(out)
        return out


def _dtype(name: Any) -> np.dtype:
    """A NumPy dtype by name (``bfloat16`` included); never one of Python objects."""
    if not isinstance(name, str) or name == "object":
        raise PlanError(f"holds an array or scalar of dtype {name!r}")
    try:
        return numpy_dtype(name) if name == "bfloat16" else np.dtype(name)
    except (TypeError, ValueError):
        raise PlanError(f"holds an array or scalar of dtype {name!r}") from None


class _Pending:
    pass


_PENDING = _Pending()


def _bad(what: str, got: Any) -> Any:
    raise PlanError(f"holds {what} written as {got!r}")


def decode(body: bytes, blobs: list[bytes], graph: Any) -> Any:
    """The tree :func:`encode` wrote, its graph references bound to ``graph``; a PlanError says what in
    the body does not hold together."""
    try:
        doc = json.loads(body)
    except ValueError:
        raise PlanError("holds a body that is not JSON") from None
    try:
        return _Decoder(blobs, graph).value(doc)
    except PlanError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, pa.ArrowException, OSError) as e:
        raise PlanError(f"holds a value that does not decode ({type(e).__name__}: {e})") from None
