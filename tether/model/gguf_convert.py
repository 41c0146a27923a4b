"""Convert a Llama-architecture GGUF file into a Hugging Face folder that tether's loader reads.

The `gguf` package (llama.cpp's reference reader) parses the file and dequantizes its tensors; this module
only renames tensors, undoes llama.cpp's Q/K row permutation, and writes config.json, model.safetensors,
the file's Q4_1 / Q8_0 blocks as they are (for tether/model/rowquant.py), tokenizer.json (byte-level BPE from
the file's vocabulary and merges) and tokenizer_config.json (special tokens and the chat template).
transformers is not needed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from tether.model.tokenizer import _bytes_to_unicode

if TYPE_CHECKING:   # imported where used: `gguf`, numpy and torch are only needed when a conversion runs (the
    import torch     # model's folder name, CONVERTER_VERSION, is read by services that never load torch)
    from gguf import GGUFReader

# Bump when the output of the conversion changes, so cached folders are regenerated.
# 2: the folder carries its record (tether/model/record.py), checked whenever a service loads it.
# 3: the file's Q4_1 / Q8_0 blocks are kept beside the fp32 weights (tether/model/rowquant.py).
CONVERTER_VERSION = 3

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# llama.cpp's pre-tokenizer splits for the vocabularies we convert (llama-vocab.cpp). "smollm" splits every
# digit alone, then applies GPT-2's split: the same as the HF tokenizer.json of SmolLM2 (Digits + ByteLevel).
_SPLITS = {
    "smollm": [r"\p{N}", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"],
    "gpt2": [r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"],
}
_CONTROL = 3  # llama.cpp token type of control tokens (<|im_start|>, <|endoftext|>, ...)


def _field(reader: "GGUFReader", key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's convert_hf_to_gguf permute() of Q/K rows.

    llama.cpp interleaves each head's two rotary halves (its RoPE rotates adjacent pairs); HF's rotate_half
    expects the halves contiguous. GGUF row order per head is (d/2, 2); HF's is (2, d/2).
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_config(reader: "GGUFReader") -> dict:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama-architecture GGUF files are converted; this one is {arch!r}")
    p = "llama."
    heads = int(_field(reader, p + "attention.head_count"))
    hidden = int(_field(reader, p + "embedding_length"))
    names = {t.name for t in reader.tensors}
    head_dim = int(_field(reader, p + "rope.dimension_count", hidden // heads))
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, p + "attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(_field(reader, p + "attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, p + "context_length")),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": False,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_ids(reader),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }


def _eos_ids(reader: "GGUFReader") -> list[int] | int:
    """The file's EOS, plus <|endoftext|> when the vocabulary has it: an instruct model ends a turn with
    its EOS (<|im_end|>), but a raw completion ends with <|endoftext|>, which would otherwise run on."""
    eos = int(_field(reader, "tokenizer.ggml.eos_token_id"))
    tokens = reader.fields["tokenizer.ggml.tokens"]
    end = next((i for i in range(min(32, len(tokens.data))) if tokens.contents(i) == "<|endoftext|>"), None)
    return [eos, end] if end is not None and end != eos else eos


def hf_tensor_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, i, part = base.split(".", 2)
        return f"model.layers.{i}.{_LAYER_NAMES[part]}.{suffix}"
    return f"{_TOP_NAMES[base]}.{suffix}"


def hf_weights(reader: "GGUFReader", cfg: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    import numpy as np
    import torch
    from gguf.quants import dequantize

    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        # GGUF lists dims fastest-first; dequantize returns the row-major array HF expects ([out, in]).
        arr = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32, order="C", copy=True)
        w = torch.from_numpy(arr.reshape([int(d) for d in reversed(t.shape)]))
        name = hf_tensor_name(t.name)
        if name.endswith("q_proj.weight"):
            w = unpermute_rows(w, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute_rows(w, cfg["num_key_value_heads"])
        out[name] = w.to(dtype).contiguous()
    return out


def gguf_blocks(reader: "GGUFReader", cfg: dict) -> dict[str, torch.Tensor]:
    """The file's Q4_1 and Q8_0 tensors as their raw blocks (uint8 [out, in / 32 * block bytes]), rows in the
    converted order, named `<HF weight name>.<kind>`: what tether/model/rowquant.py reads instead of the fp32."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType

    from tether.model import rowquant

    kinds = {GGMLQuantizationType.Q4_1: "q4_1", GGMLQuantizationType.Q8_0: "q8_0"}
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        kind = kinds.get(t.tensor_type)
        if kind is None or len(t.shape) != 2:
            continue
        b = torch.from_numpy(np.array(t.data, dtype=np.uint8, order="C", copy=True))
        name = hf_tensor_name(t.name)
        if name.endswith("q_proj.weight"):
            b = unpermute_rows(b, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            b = unpermute_rows(b, cfg["num_key_value_heads"])
        out[rowquant.blocks_name(name, kind)] = b.contiguous()
    return out


def hf_tokenizer(reader: "GGUFReader") -> tuple[HFTokenizer, list[str]]:
    """The byte-level BPE the file describes; returns it and its control tokens' spellings."""
    kind = _field(reader, "tokenizer.ggml.model")
    pre = _field(reader, "tokenizer.ggml.pre", "gpt2")
    if kind != "gpt2" or pre not in _SPLITS:
        raise ValueError(f"unsupported GGUF tokenizer {kind!r}/{pre!r}: byte-level BPE with "
                         f"pre-tokenizer {', '.join(_SPLITS)} is converted")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    alphabet = set(_bytes_to_unicode().values())
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _SPLITS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # Control tokens match whole in text (so a rendered chat template's <|im_start|> is one id) and are
    # skipped when decoding. A "control" spelling outside the byte alphabet would be a mislabel: not added.
    control = [t for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= alphabet]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    return tok, control


def convert(gguf_path: str | Path, dest: str | Path, dtype: str = "float32") -> Path:
    """Write the HF folder for `gguf_path` into `dest` (created; files overwritten)."""
    import gguf
    import torch
    from safetensors.torch import save_file

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(str(gguf_path))
    cfg = hf_config(reader)
    cfg["torch_dtype"] = dtype
    tok, control = hf_tokenizer(reader)
    tokens = _field(reader, "tokenizer.ggml.tokens")

    def spelled(key: str) -> str | None:
        i = _field(reader, key)
        return None if i is None else tokens[int(i)]

    save_file(hf_weights(reader, cfg, getattr(torch, dtype)), str(dest / "model.safetensors"),
              metadata={"format": "pt"})
    blocks = gguf_blocks(reader, cfg)
    if blocks:
        from tether.model.rowquant import BLOCKS_FILE
        save_file(blocks, str(dest / BLOCKS_FILE), metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    tok.save(str(dest / "tokenizer.json"))
    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spelled("tokenizer.ggml.bos_token_id"),
        "eos_token": spelled("tokenizer.ggml.eos_token_id"),
        "pad_token": spelled("tokenizer.ggml.padding_token_id"),
        "unk_token": spelled("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "additional_special_tokens": control,
        "model_max_length": cfg["max_position_embeddings"],
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2, ensure_ascii=False))
    (dest / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
         "pad_token_id": cfg["pad_token_id"]}, indent=2))
    (dest / "CONVERTED_FROM").write_text(json.dumps(
        {"gguf": Path(gguf_path).name, "converter_version": CONVERTER_VERSION, "dtype": dtype}, indent=2))
    return dest
