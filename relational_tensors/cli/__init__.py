"""The command line: ``relational-tensors`` (``main``), its printed tables (``output``) and the model
files it compiles (``model_file``)."""
