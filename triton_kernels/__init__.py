"""@triton.jit kernels of rwkv_jax (no JAX here); installed as rwkv_jax.triton_kernels."""
