"""Llama-family decoders over a paged KV pool: the architecture alone (`llama.py`), its config
(`config.py`) and rotary embedding (`rope.py`). Loading weights is `worker.loader`'s.

`CausalLM.forward(input_ids, positions, batch, kv_pool, logits_rows)` returns float32 logits of
the selected tokens.
"""

from worker.models.config import ModelConfig
from worker.models.llama import CausalLM

__all__ = ["CausalLM", "ModelConfig"]
