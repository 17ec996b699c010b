"""Test collection: the GPU backend's modules import Triton and CuPy at the top, so without them
their doctests are not collected (tests/test_gpu.py skips itself with a reason)."""

import importlib.util

collect_ignore_glob = []
if importlib.util.find_spec("triton") is None or importlib.util.find_spec("cupy") is None:
    collect_ignore_glob += [
        "relational_tensors/runtime/cupy_backend.py",
        "relational_tensors/runtime/dist_cupy.py",
        "relational_tensors/kernels/*.py",
    ]
