"""Hand-written PyTorch baselines for several GPUs, one process per GPU (``torchrun``).

The modules follow what a user would write by hand, one strategy per module:

* ``block``     the LLaMA block on one device (the formulation of ``bench/gpu_block.py``'s
                ``torch_block``, for any shape), its seeded weights, and the causal attention of a
                query block that ends where its keys end;
* ``llama_tp``  Megatron tensor parallelism: column-parallel q/k/v/w1/w3, row-parallel o/w2 + all-reduce;
* ``llama_sp``  sequence parallelism: tokens sharded, keys and values all-gathered for attention;
* ``llama_dp``  data parallelism: the batch sharded, weights replicated;
* ``chain``     the matrix chains A-E, row-sharded (the paper's PyTorch chain baseline);
* ``train``     the block's training step (``bench/gpu_train.py``'s) with DDP and with FSDP2;
* ``common``    process group, seeded tensors, splits, gathers, timing;
* ``run``       the entry point: ``torchrun --nproc_per_node N bench/baselines/run.py ...``.
"""
