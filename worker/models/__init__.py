"""Llama-family decoders over a paged KV pool, the HF directory loader and built-in models.

`load_model(path_or_builtin_name, device, dtype, attention) -> CausalLM`;
`CausalLM.forward(input_ids, positions, batch, kv_pool, logits_rows)` returns float32
logits of the selected tokens. `builtin_model_path("tiny" | "small")` makes a built-in model
on first use; `resolve_model(name_or_dir)` accepts either.
"""

from worker.models.builtin import builtin_model_path, resolve_model
from worker.models.config import ModelConfig
from worker.models.llama import CausalLM
from worker.models.loader import load_model

__all__ = ["CausalLM", "ModelConfig", "builtin_model_path", "load_model", "resolve_model"]
