"""Training language models on token files (rwkv_jax.train)."""

from .data import (Batch, TokenFile, WindowSampler, open_tokens, pack_rows, tokenize_text,
                   write_binidx, write_tokens)
