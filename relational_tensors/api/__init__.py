"""The public face: compiling a graph (``compile``), a PyTorch module compiled and called like the module
(``parallelize``), and a whole training step of one (``training``).  ``relational_tensors`` re-exports it."""
