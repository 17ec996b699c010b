"""Exchange programs (section 5 of the paper): the ExProg language (``ast``, ``text``, ``closure``), its
synthesis (``naive``, and ``search`` over the paper's rewrite rules) and the ExProg simulator that
prices a program on a topology of ``relational_tensors.machine``."""
