"""The Llama-architecture decoder, its loader, presets and tokenizers."""

from tether.model.config import ModelConfig
from tether.model.llama import ModelSlice
from tether.model.loader import load_slice, model_fingerprint, resolve_model
from tether.model.tokenizer import Tokenizer, load_tokenizer

__all__ = ["ModelConfig", "ModelSlice", "load_slice", "model_fingerprint", "resolve_model",
           "Tokenizer", "load_tokenizer"]
