"""Weights from safetensors checkpoints (``cg.load_checkpoint``): each process reads only the slices of
the blocks it keeps; graphs traced from torch modules read the module's state dict (Linear weights
transposed); sharded checkpoints in a directory; every mismatch refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import relational_tensors as rt
from relational_tensors.graph.models import llama_block, llama_feeds

safetensors = pytest.importorskip("safetensors.numpy")


def _weights(g: rt.Graph) -> dict[str, np.ndarray]:
    return {k: v for k, v in llama_feeds(g, seed=4).items() if g.node(k).role == "parameter"}


@pytest.mark.parametrize("p,constraints", [(1, None), (4, None), (3, {"wq": "S(1)", "w1": "S(0)", "w2": "R"})])
def test_a_block_reads_its_weights_from_a_checkpoint(tmp_path: Path, p: int, constraints: dict | None) -> None:
    g = llama_block(2, 16, 32, 4, 2, 48)
    weights = _weights(g)
    safetensors.save_file(weights, str(tmp_path / "model.safetensors"))
    cg = rt.compileGraph(g, device=f"cpu:{p}", constraints=constraints)
    assert cg.load_checkpoint(tmp_path / "model.safetensors") == sorted(weights)
    feeds = llama_feeds(g, seed=4)
    cg.load({"x": feeds["x"]})
    cg.execute()
    want = rt.reference(g, feeds)["y"]
    assert np.array_equal(cg.offload("y"), rt.compileGraph(g, device=f"cpu:{p}", constraints=constraints)
                          .run(feeds)["y"])
    assert np.abs(cg.offload("y") - want).max() <= 1e-5 * np.abs(want).max()


def test_a_sharded_checkpoint_directory_and_the_refusals(tmp_path: Path) -> None:
    g = llama_block(1, 8, 32, 4, 2, 48)
    weights = _weights(g)
    names = sorted(weights)
    safetensors.save_file({k: weights[k] for k in names[: len(names) // 2]}, str(tmp_path / "a.safetensors"))
    safetensors.save_file({k: weights[k] for k in names[len(names) // 2:]}, str(tmp_path / "b.safetensors"))
    cg = rt.compileGraph(g, device="cpu:2")
    assert cg.load_checkpoint(tmp_path) == names
    with pytest.raises(rt.ExecError, match="no safetensors checkpoint"):
        cg.load_checkpoint(tmp_path / "missing")
    safetensors.save_file({"wq": np.zeros((3, 3), np.float32)}, str(tmp_path / "wrong.safetensors"))
    with pytest.raises(rt.ExecError, match="has shape \\(3, 3\\); the graph's 'wq' needs"):
        cg.load_checkpoint(tmp_path / "wrong.safetensors")
    only_weights = rt.compileGraph(g, device="cpu:2")
    only_weights.load_checkpoint(tmp_path / "a.safetensors")
    only_weights.load_checkpoint(tmp_path / "b.safetensors")
    with pytest.raises(rt.ExecError, match="'x'"):  # the checkpoint holds the weights, not the input
        only_weights.execute()


def test_a_torch_module_reads_its_state_dict_transposed_into_the_graph(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.GELU(), torch.nn.Linear(20, 7)).to(torch.bfloat16)
    x = torch.randn(5, 12, dtype=torch.bfloat16)
    save_file(module.state_dict(), str(tmp_path / "m.safetensors"))
    g = rt.from_torch(module, (x,))
    cg = rt.compileGraph(g, device="cpu:3")
    loaded = cg.load_checkpoint(tmp_path / "m.safetensors")
    assert loaded and all(name in g.origins for name in loaded)
    others = {k: v for k, v in g.feeds(x).items() if k not in loaded}  # the user's input (and folded constants)
    cg.load(others)
    cg.execute()
    got = np.asarray(cg.offload(g.output_names[0]), dtype=np.float32)
    with_feeds = rt.compileGraph(g, device="cpu:3").run(g.feeds(x))[g.output_names[0]]
    assert np.array_equal(got, np.asarray(with_feeds, dtype=np.float32))  # the same bits as the module's own weights
