"""The IR every pass reads: the ``Graph`` of abstract operators (``graph``), reverse-mode autodiff over it
(``autodiff``), its single-device NumPy reference (``reference``), and the graphs built on it: optimizers
(``optim``) and ready-made models (``models``)."""
