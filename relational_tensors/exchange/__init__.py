"""Exchange programs (section 5 of the paper): the ExProg language (``ast``, ``text``, ``closure``), its
synthesis (``naive``, and ``search`` over the paper's rewrite rules: one function each in ``rules``, on the
bodies of ``body``) and the ExProg simulator (``simulator``; ``membership`` chooses the sites of partitions
declared by size) that prices a program on a topology of ``relational_tensors.machine``."""
