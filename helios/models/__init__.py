"""helios.models: GPT-2 and LLaMA-style models, Hugging Face folders in and out, generation.

``from_pretrained(path, dtype=None, device=None)`` reads a Hugging Face folder (config.json
and model.safetensors, or a sharded model.safetensors.index.json) into a
:class:`GPT2LMHeadModel` or a :class:`LlamaForCausalLM`; ``model.save_pretrained(path)``
writes one back that transformers loads; ``model.generate(ids, max_new_tokens, ...)`` samples
with a key/value cache on the device, its decode step captured and replayed
(:mod:`helios.models.generation`).  The models follow transformers weight for weight and take
helios-train's calling convention, ``model(idx, targets=None) -> (logits, loss)``.
See docs/models.md.
"""

from helios.models.generation import GenerationMixin, KVCache  # noqa: F401
from helios.models.gpt2 import GPT2Config, GPT2LMHeadModel  # noqa: F401
from helios.models.hf import from_pretrained, read_safetensors  # noqa: F401
from helios.models.llama import LlamaConfig, LlamaForCausalLM  # noqa: F401

__all__ = ["from_pretrained", "read_safetensors", "GPT2Config", "GPT2LMHeadModel", "LlamaConfig", "LlamaForCausalLM",
           "GenerationMixin", "KVCache"]
