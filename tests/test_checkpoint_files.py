"""Damaged checkpoint files (``cg.load_checkpoint``, ``driver.checkpoint``): a tour of corruptions, each
refused with an ``ExecError`` naming the file and what is wrong, and the weights loaded before left as
they were; then random byte changes and truncations of a valid file, each refused or read bit for bit
as the safetensors format says (the safetensors library's own reading is the reference)."""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import relational_tensors as rt
from relational_tensors.core.types import Box
from relational_tensors.driver.checkpoint import read_pieces

_CODES = {np.dtype(np.float32): "F32", np.dtype(np.float64): "F64", np.dtype(ml_dtypes.bfloat16): "BF16",
          np.dtype(np.int64): "I64", np.dtype(np.bool_): "BOOL", np.dtype(np.uint8): "U8"}


def encode(tensors: dict[str, np.ndarray], header: dict[str, Any] | None = None) -> bytes:
    """A safetensors file as the format lays it out (tensors in name order, back to back); ``header``
    replaces entries of the header (or adds some), to write a damaged one."""
    entries: dict[str, Any] = {}
    data = b""
    for name in sorted(tensors):
        a = np.array(tensors[name], order="C")  # ascontiguousarray would make a scalar 1-D
        entries[name] = {"dtype": _CODES[a.dtype], "shape": list(a.shape),
                         "data_offsets": [len(data), len(data) + a.nbytes]}
        data += a.tobytes()
    entries.update(header or {})
    text = json.dumps(entries).encode()
    return struct.pack("<Q", len(text)) + text + data


def raw(header: bytes, data: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + data


X = np.arange(24, dtype=np.float32).reshape(4, 6) / 7
W = np.linspace(-1, 1, 48, dtype=np.float32).reshape(6, 8)
V = np.linspace(2, -2, 24, dtype=np.float32).reshape(8, 3)


def graph() -> rt.Graph:
    g = rt.Graph()
    x = g.input("x", [4, 6])
    h = g.matmul(x, g.parameter("w", [6, 8]), name="up")
    g.save(g.matmul(h, g.parameter("v", [8, 3]), name="down"), name="y")
    return g


@pytest.fixture(scope="module")
def cg() -> Any:
    return rt.compileGraph(graph(), device="cpu:2")


def output(cg: Any) -> np.ndarray:
    cg.load({"x": X})
    cg.execute()
    return np.asarray(cg.offload("y"))


def _w(**entry: Any) -> dict[str, Any]:
    return {"w": {"dtype": "F32", "shape": [6, 8], "data_offsets": [0, 192], **entry}}


GOOD = encode({"w": W, "v": V})
DATA = W.tobytes() + V.tobytes()  # the good file's data: v first (its name sorts first), then w
V_THEN_W = V.tobytes() + W.tobytes()
V_ENTRY = {"v": {"dtype": "F32", "shape": [8, 3], "data_offsets": [0, 96]}}

# name -> (the file's bytes, or several files' in a directory; what the refusal says)
TOUR: dict[str, tuple[bytes | dict[str, bytes], str]] = {
    "short offsets": (encode({"w": W, "v": V}, _w(data_offsets=[96, 96 + 188])), "shape × the size of its dtype"),
    "long offsets": (encode({"w": W}, _w(data_offsets=[0, 196])), "shape × the size of its dtype"),
    "negative offset": (raw(json.dumps(_w(data_offsets=[-4, 188])).encode(), W.tobytes()), "0 <= begin <= end"),
    "reversed offsets": (raw(json.dumps(_w(data_offsets=[192, 0])).encode(), W.tobytes()), "0 <= begin <= end"),
    "three offsets": (raw(json.dumps(_w(data_offsets=[0, 96, 192])).encode(), W.tobytes()), "[begin, end]"),
    "overlapping": (raw(json.dumps({**V_ENTRY, **_w(data_offsets=[48, 240])}).encode(), V_THEN_W[:240]),
                    "overlaps 'v'"),
    "a gap": (raw(json.dumps({**V_ENTRY, **_w(data_offsets=[100, 292])}).encode(), V_THEN_W + b"\0" * 4),
              "that no tensor holds"),
    "offsets past the data": (raw(json.dumps(_w(data_offsets=[0, 192])).encode(), W.tobytes()[:100]),
                              "cut short"),
    "trailing bytes": (GOOD + b"\0" * 8, "cover the data after the header exactly"),
    "truncated data": (GOOD[:-10], "cut short"),
    "truncated header": (GOOD[:30], "within the file"),
    "shorter than 8 bytes": (b"\x10\0\0", "a file of 3 bytes"),
    "empty": (b"", "a file of 0 bytes"),
    "text file": (b"this is a README, not weights\n" * 5, "within the file"),
    "header not JSON": (raw(b"{'w': 1}  "), "UTF-8 JSON object"),
    "header not UTF-8": (raw(b'{"\xff": 1}'), "UTF-8 JSON object"),
    "list header": (raw(b'[{"dtype": "F32", "shape": [6, 8], "data_offsets": [0, 192]}]', W.tobytes()),
                    "got a JSON array"),
    "string header": (raw(b'"w"'), "got a JSON string"),
    "deeply nested header": (raw(b"[" * 100_000), "UTF-8 JSON object"),
    "entry not an object": (raw(b'{"w": [0, 192]}', W.tobytes()), "an object with dtype, shape"),
    "missing shape": (raw(json.dumps({"w": {"dtype": "F32", "data_offsets": [0, 192]}}).encode(), W.tobytes()),
                      "'w' without shape"),
    "missing dtype and offsets": (raw(b'{"w": {"shape": [6, 8]}}', W.tobytes()),
                                  "'w' without dtype, data_offsets"),
    "wrong dtype string": (encode({"w": W}, _w(dtype="F33")), "'w' of dtype 'F33'"),
    "lower-case dtype": (encode({"w": W}, _w(dtype="f32")), "of dtype 'f32'"),
    "dtype not a string": (encode({"w": W}, _w(dtype=32)), "of dtype 32"),
    "float shape": (encode({"w": W}, _w(shape=[6.0, 8])), "list of non-negative integers"),
    "boolean shape": (encode({"w": W}, _w(shape=[True, 8])), "list of non-negative integers"),
    "negative shape": (encode({"w": W}, _w(shape=[-6, -8])), "list of non-negative integers"),
    "shape not a list": (encode({"w": W}, _w(shape=48)), "list of non-negative integers"),
    "a name twice in the header": (raw(b'{"w": {"dtype": "F32", "shape": [6, 8], "data_offsets": [0, 192]}, '
                                       b'"w": {"dtype": "F32", "shape": [6, 8], "data_offsets": [192, 384]}}',
                                       W.tobytes() + (W * 2).tobytes()), "'w' twice"),
    "metadata not strings": (encode({"w": W}, {"__metadata__": {"format": 1}}), "__metadata__ maps names"),
    "a key in two shards": ({"a.safetensors": encode({"w": W}), "b.safetensors": encode({"w": W * 2, "v": V})},
                            "'w' in both"),
    "a damaged shard": ({"a.safetensors": encode({"w": W}), "b.safetensors": encode({"v": V})[:-1]},
                        "b.safetensors"),
}


def _place(tmp_path: Path, files: bytes | dict[str, bytes]) -> Path:
    if isinstance(files, bytes):
        (tmp_path / "model.safetensors").write_bytes(files)
        return tmp_path / "model.safetensors"
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    return tmp_path


def test_the_good_file_loads_the_weights(cg: Any, tmp_path: Path) -> None:
    path = _place(tmp_path, GOOD)
    assert cg.load_checkpoint(path) == ["v", "w"]
    want = rt.reference(graph(), {"x": X, "w": W, "v": V})["y"]
    assert np.abs(output(cg) - want).max() <= 1e-5 * np.abs(want).max()
    assert cg.load_checkpoint(str(path)) == ["v", "w"]  # a str path too


@pytest.mark.parametrize("case", sorted(TOUR))
def test_a_damaged_checkpoint_is_refused_and_the_loaded_weights_stay(cg: Any, tmp_path: Path, case: str) -> None:
    files, says = TOUR[case]
    (tmp_path / "good").mkdir()
    cg.load_checkpoint(_place(tmp_path / "good", GOOD))
    before = output(cg)
    (tmp_path / "bad").mkdir()
    path = _place(tmp_path / "bad", files)
    with pytest.raises(rt.ExecError) as e:
        cg.load_checkpoint(path)
    msg = str(e.value)
    assert says in msg and "safetensors" in msg, msg
    assert str(tmp_path / "bad") in msg  # names the file (or files)
    assert np.array_equal(output(cg), before)  # nothing of the damaged file was loaded


@pytest.mark.parametrize("path,says", [(None, "got NoneType None"), (42, "got int 42"), (b"m.safetensors", "bytes"),
                                       ("", "an empty path"), (["m.safetensors"], "got list")])
def test_a_checkpoint_path_of_the_wrong_type_is_refused(cg: Any, path: Any, says: str) -> None:
    with pytest.raises(rt.ExecError, match="a checkpoint is the path of a .safetensors file") as e:
        cg.load_checkpoint(path)
    assert says in str(e.value)


def test_missing_paths_and_directories_named_like_shards(cg: Any, tmp_path: Path) -> None:
    with pytest.raises(rt.ExecError, match="no safetensors checkpoint"):
        cg.load_checkpoint(tmp_path / "missing.safetensors")
    with pytest.raises(rt.ExecError, match="no safetensors checkpoint"):
        cg.load_checkpoint(tmp_path)  # a directory without shards
    (tmp_path / "a.safetensors").write_bytes(GOOD)
    (tmp_path / "b.safetensors").mkdir()
    with pytest.raises(rt.ExecError, match="b.safetensors' is not a file; got a directory"):
        cg.load_checkpoint(tmp_path)


def test_dtypes_of_the_format_that_this_reader_cannot_read(cg: Any, tmp_path: Path) -> None:
    fp8 = {"dtype": "F8_E4M3", "shape": [2, 2], "data_offsets": [0, 4]}
    other = raw(json.dumps({"scale": fp8, "v": {**V_ENTRY["v"], "data_offsets": [4, 100]},
                            **_w(data_offsets=[100, 292])}).encode(), b"\1\2\3\4" + V_THEN_W)
    assert cg.load_checkpoint(_place(tmp_path, other)) == ["v", "w"]  # a whole file: the others load
    with pytest.raises(rt.ExecError, match="has dtype F8_E4M3; this reader reads"):
        read_pieces(tmp_path / "model.safetensors", {"scale": ((2, 2), [Box((0, 0), (2, 2))])}, {})
    flags = raw(b'{"flags": {"dtype": "BOOL", "shape": [3], "data_offsets": [0, 3]}}', b"\0\1\2")
    (tmp_path / "model.safetensors").write_bytes(flags)
    with pytest.raises(rt.ExecError, match="a BOOL tensor's bytes are 0 or 1; got 2 in 'flags'"):
        read_pieces(tmp_path / "model.safetensors", {"flags": ((3,), [Box((0,), (3,))])}, {})


# ---------------------------------------------------------------------------------------- random damage

SAMPLE = {"w": W, "v": V, "half": np.linspace(-3, 3, 10, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(2, 5),
          "ids": np.array([3, -1, 7], dtype=np.int64), "mask": np.array([[True, False], [False, True]]),
          "scalar": np.array(2.5, dtype=np.float64), "empty": np.zeros((0, 4), dtype=np.uint8)}
SAMPLE_FILE = encode(SAMPLE)
HEADER_END = 8 + struct.unpack("<Q", SAMPLE_FILE[:8])[0]


def _boxes(shape: tuple[int, ...]) -> list[Box]:
    """The whole tensor, and for matrices a block taking part of each row (the reader's chunked path)."""
    whole = [Box((0,) * len(shape), shape)]
    if len(shape) == 2 and shape[0] > 1 and shape[1] > 1:
        whole.append(Box((1, 1), (shape[0], shape[1] - 1)))
    return whole


def _read(data: bytes) -> dict[str, list[np.ndarray]] | Exception:
    """What the reader makes of a file: each sample tensor's blocks, or its refusal."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "m.safetensors"
        path.write_bytes(data)
        wanted = {k: (a.shape, _boxes(a.shape)) for k, a in SAMPLE.items()}
        try:
            pieces = read_pieces(path, wanted, {})
        except rt.RelationalTensorsError as e:
            return e
    return {k: [a for _, a in p] for k, p in pieces.items()}


# the format's dtypes as NumPy reads them, written out here so that the reference does not share the reader's
_NUMPY = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "I64": np.int64,
          "I32": np.int32, "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16,
          "U8": np.uint8, "BOOL": np.bool_}


def _reference(data: bytes) -> dict[str, np.ndarray] | None:
    """The tensors of a file as the safetensors library reads them (its numpy module knows no bfloat16:
    its raw bytes, viewed here), or None where it refuses the file."""
    import safetensors

    try:
        tensors = safetensors.deserialize(data)
    except Exception:  # noqa: BLE001 - the library's refusals have no common type to name
        return None
    return {name: np.frombuffer(bytes(t["data"]), dtype=_NUMPY[t["dtype"]]).reshape(t["shape"])
            for name, t in tensors if t["dtype"] in _NUMPY}


def _agrees(data: bytes) -> None:
    got = _read(data)
    if isinstance(got, Exception):
        assert "checkpoint" in str(got)
        return
    ref = _reference(data)
    assert ref is not None, "the reader accepted a file the safetensors library refuses"
    for key, blocks in got.items():
        for box, block in zip(_boxes(SAMPLE[key].shape), blocks):
            want = ref[key][tuple(slice(lo, hi) for lo, hi in zip(box.lower, box.upper))]
            assert block.dtype == want.dtype and block.shape == want.shape
            assert block.tobytes() == want.tobytes(), key


def test_the_sample_file_reads_as_written() -> None:
    pytest.importorskip("safetensors")
    got = _read(SAMPLE_FILE)
    assert not isinstance(got, Exception)
    assert all(np.array_equal(got[k][0], a) and got[k][0].dtype == a.dtype for k, a in SAMPLE.items())
    _agrees(SAMPLE_FILE)


_damage: st.SearchStrategy[tuple[str, int, int]] = st.one_of(
    st.tuples(st.just("set"), st.integers(0, len(SAMPLE_FILE) - 1), st.integers(0, 255)),
    st.tuples(st.just("set"), st.integers(0, HEADER_END - 1), st.sampled_from(b'0123456789[]{}",:- eE.FIUB')),
    st.tuples(st.just("flip"), st.integers(0, len(SAMPLE_FILE) - 1), st.integers(0, 7)),
    st.tuples(st.just("cut"), st.integers(0, len(SAMPLE_FILE) - 1), st.just(0)),
    st.tuples(st.just("drop"), st.integers(0, len(SAMPLE_FILE) - 1), st.integers(1, 16)),
    st.tuples(st.just("grow"), st.integers(1, 16), st.integers(0, 255)),
)


def _apply(data: bytes, damage: tuple[str, int, int]) -> bytes:
    kind, at, value = damage
    if not data:
        return data
    at = min(at, len(data) - 1)  # an earlier change may have shortened the file
    if kind == "set":
        return data[:at] + bytes([value]) + data[at + 1:]
    if kind == "flip":
        return data[:at] + bytes([data[at] ^ (1 << value)]) + data[at + 1:]
    if kind == "cut":
        return data[:at]
    if kind == "drop":
        return data[:at] + data[at + value:]
    return data + bytes([value]) * at


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_damage, min_size=1, max_size=3))
def test_random_damage_is_refused_or_read_bit_for_bit(damages: list[tuple[str, int, int]]) -> None:
    pytest.importorskip("safetensors")
    data = SAMPLE_FILE
    for damage in damages:
        data = _apply(data, damage)
    _agrees(data)


def test_every_header_byte_changed_is_refused_or_read_bit_for_bit() -> None:
    pytest.importorskip("safetensors")
    for at in range(HEADER_END):
        for value in {SAMPLE_FILE[at] ^ 1, SAMPLE_FILE[at] ^ 4, ord("9"), ord(" ")}:
            _agrees(SAMPLE_FILE[:at] + bytes([value]) + SAMPLE_FILE[at + 1:])
