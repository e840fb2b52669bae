"""Decoders over a paged KV pool, a file per architecture: the Llama family (`llama.py`) and
Gemma 3 (`gemma3.py`, full and sliding-window layers), LFM2 (`lfm2.py`, short convolutions
with a recurrent state, and full attention), their config (`config.py`) and rotary
embedding (`rope.py`). Loading weights is `worker.loader`'s; `model_class` picks the class.

`CausalLM.forward(input_ids, positions, batch, kv_pool, logits_rows)` returns float32 logits of
the selected tokens.
"""

from torch import nn

from worker.models.config import ModelConfig
from worker.models.gemma3 import Gemma3LM
from worker.models.lfm2 import Lfm2LM
from worker.models.llama import CausalLM


def model_class(config: ModelConfig) -> type[nn.Module]:
    """The decoder class that serves `config`'s architecture."""
    return {"gemma3": Gemma3LM, "lfm2": Lfm2LM}.get(config.model_type, CausalLM)


__all__ = ["CausalLM", "Gemma3LM", "Lfm2LM", "ModelConfig", "model_class"]
