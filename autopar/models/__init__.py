"""Built-in models: a nanoGPT-style GPT, Hugging Face builders, and the MODEL resolver.

``resolve_model("llama3-70b")`` (or ``"gpt:layers=...,..."``, or ``"file.py:factory"``)
gives a :class:`ModelSpec` whose ``build()`` makes the model in the current device context
and whose ``example_inputs(batch, seq)`` makes a batch it returns a loss for.
"""

from autopar.models.gpt import GPT, GPTConfig
from autopar.models.registry import ModelSpec, builtin_names, resolve_model

__all__ = ["GPT", "GPTConfig", "ModelSpec", "builtin_names", "resolve_model"]
