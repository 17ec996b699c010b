"""PyTorch modules as graphs: trace with ``torch.export``, then translate the ATen graph rule by rule.

``from_torch(module, example_inputs)`` exports the module (static shapes, the
functional ATen graph ``torch.export`` produces before any decomposition, so
``linear``, ``layer_norm``, ``rms_norm`` and ``scaled_dot_product_attention``
arrive whole) and returns a :class:`TorchGraph`: an ``rt.Graph`` that also
carries the values of its parameters.

* Parameters, buffers and tensor constants become graph inputs of role
  ``parameter``, named by their module path (``layer.self_attn.q_proj.weight``).
  A ``Linear`` weight is stored transposed, ``[in, out]``, as ``matmul`` reads it.
* Whatever does not depend on a user input (rotary cos/sin tables, masks,
  ``arange``) is computed once with torch at trace time and enters the graph as
  one more parameter, named after the module and node that produced it.
* Recognized patterns, each replaced by one operator (and declined, so lowered
  op by op, when a check fails): hand-written RMSNorm
  (``x * rsqrt(mean(x**2, -1, keepdim=True) + eps) * w``) -> ``rmsnorm``;
  ``silu(a) * b`` -> ``swiglu``; GPT-2's tanh GELU written out -> ``gelu_tanh``;
  rotary embedding ``x * cos + rotate_half(x) * sin`` -> ``rope`` when the
  tables are the standard ones for positions 0..s-1 (the base is read from
  them), else ``rope_table`` reading the tables as the module made them
  (computed from position ids at run time, or scaled constants); k/v
  heads repeated by ``repeat_interleave`` or ``unsqueeze/expand/reshape`` before
  attention -> grouped-query ``attention``; SDPA's attention mask -> ``causal``
  (either alignment), ``seq_ends``, ``window`` and ``key_padding`` where it has that
  structure, else ``mask``/``bias`` inputs (``masks``); an empty tensor -> a constant.
* Every translated node is checked against the shape torch recorded for it; a
  dtype that differs is cast to torch's.

An operation without a rule raises ``rt.GraphError`` naming the operation, the
source line of the module that called it and the supported set; ``register_torch_op``
adds a rule.

Modules: ``translator`` (tracing, the walk over the fx graph, ``TorchGraph``,
``from_torch``), ``patterns`` (the recognized multi-op idioms), ``registry`` (the rule
table, ``register_torch_op`` and the refused operations), the rules by family
(``rules_elementwise``, ``rules_linalg``, ``rules_reduce``, ``rules_nn``, ``rules_shape``),
``masks`` (attention masks read as structure), ``support`` (docs/pytorch.md's list of operations,
generated), ``convert`` (torch <-> NumPy) and ``common`` (what the translator, rules and
patterns share).

>>> import pytest; torch = pytest.importorskip("torch")
>>> from relational_tensors.frontend.torch import from_torch
>>> g = from_torch(torch.nn.Linear(8, 4), (torch.randn(2, 8),))
>>> [n.name for n in g.nodes]
['input', 'weight', 'linear:matmul', 'bias', 'linear:add']
>>> g.node("weight").role, g.parameters["weight"].shape, g.output_names
('parameter', (8, 4), ('output',))
"""

from relational_tensors.frontend.torch.convert import numpy_to_torch, torch_to_numpy
from relational_tensors.frontend.torch.registry import register_torch_op
from relational_tensors.frontend.torch.torch_graph import TorchGraph
from relational_tensors.frontend.torch.translator import SUPPORTED_OPS, from_torch

__all__ = ["from_torch", "TorchGraph", "SUPPORTED_OPS", "torch_to_numpy", "numpy_to_torch", "register_torch_op"]
