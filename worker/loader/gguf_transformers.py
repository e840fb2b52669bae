"""Turn a GGUF of an architecture other than `llama` into an HF model directory through
transformers' own GGUF loader (Gemma 3: `gemma3`).

transformers dequantizes the blocks (Q4_K, Q6_K, ...) with the `gguf` package and undoes
llama.cpp's conventions for the architecture (Gemma's norms are stored as `1 + w`); the model it
builds is written back as float32 safetensors with its config (`architectures` added: vLLM
needs it, and `save_pretrained` refuses a GGUF-loaded model) and its tokenizer. Slower than
`gguf.py`'s direct path (the whole HF model is built once, ~40 s for Gemma 3 270M) but exact by
construction: the directory holds what transformers itself computes with.

A GGUF without a chat template (Gemma 3 270M is the pretrained model) gets the model family's
documented turn format, so that `/v1/chat/completions` works; the completions API is the
natural one for a base model.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from worker.loader.shards import save_shards

# GGUF `general.architecture` -> the HF class that serves it.
ARCHITECTURES = {"gemma3": "Gemma3ForCausalLM"}

# Gemma's turn format (user / model turns, `<start_of_turn>` ... `<end_of_turn>`), written here.
GEMMA_TURNS = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def convert_with_transformers(gguf_file: str | Path, arch: str, dest: str | Path) -> None:
    """Write the HF directory of `gguf_file` (GGUF architecture `arch`) into folder `dest`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_file, dest = Path(gguf_file), Path(dest)
    with tempfile.TemporaryDirectory(prefix="radixray-gguf-") as alone:
        # transformers reads the folder too: it must see the GGUF alone (see gguf.py).
        os.symlink(gguf_file.resolve(), Path(alone) / gguf_file.name)
        model = AutoModelForCausalLM.from_pretrained(
            alone, gguf_file=gguf_file.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(alone, gguf_file=gguf_file.name)
    config = model.config
    config.architectures = [ARCHITECTURES[arch]]
    config.dtype = torch.float32
    # the weights written are plain float32: vLLM refuses a config that names GGUF quantization
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(dest)
    GenerationConfig.from_model_config(config).save_pretrained(dest)
    if tokenizer.chat_template is None and arch == "gemma3":
        tokenizer.chat_template = GEMMA_TURNS
    tokenizer.save_pretrained(dest)
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # the embedding, tied: HF and vLLM tie it back
    save_shards(((name, t.contiguous()) for name, t in state.items()), dest)
