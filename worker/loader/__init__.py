"""Model loading: names, GGUF files and HF directories to a `CausalLM` with its weights.

`load_model(path_or_builtin_name, device, dtype, attention) -> CausalLM`;
`builtin_model_path("tiny" | "small")` makes a built-in model on first use;
`resolve_model(name_or_dir)` accepts a name, a .gguf file or a directory.
"""

from worker.loader.builtin import builtin_model_path, resolve_model
from worker.loader.weights import load_model

__all__ = ["builtin_model_path", "load_model", "resolve_model"]
