set -x
nvidia-smi --query-gpu=name --format=csv,noheader
timeout -s INT 90 python3 scratch/diag_norm.py 2>&1 | tail -30
timeout -s INT 250 python3 -m pytest -q -p no:cacheprovider tests/test_attention_bias_kernel.py tests/test_attention_padding_kernel.py tests/test_attention_grad_kernel.py tests/test_grad_kernels.py 2>&1 | tail -15
timeout -s INT 230 python3 bench/gpu_moe.py --tokens 8192 --modes eager,compile,grouped_mm,user,graph,capacity --out $OUT 2>&1 | tail -40
