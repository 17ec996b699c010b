"""The compiler driver: the ordered pass list (``compiler``), its options and state, the compiled result
(``compiled``), plan files, the multi-process path (``distributed``), checkpoints, the operator registry
and plan pictures."""
