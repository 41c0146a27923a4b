"""The GGUF conversion's pure parts, without the model file: row unpermutation and tensor names."""

from __future__ import annotations

import torch

from tether.model.gguf_convert import hf_tensor_name, unpermute_rows


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute, as llama.cpp applies it to Q and K weights."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_undoes_llama_cpp_permute():
    for heads, head_dim, hidden in ((9, 64, 576), (3, 64, 576), (4, 8, 5)):
        w = torch.randn(heads * head_dim, hidden)
        permuted = llama_cpp_permute(w, heads)
        assert not torch.equal(permuted, w)
        assert torch.equal(unpermute_rows(permuted, heads), w)


def test_unpermute_puts_rotary_halves_back_together():
    """GGUF interleaves each head's two RoPE halves row by row; HF keeps them contiguous."""
    rows = torch.arange(8.0)[:, None]                    # one head of dim 8: GGUF order x0 y0 x1 y1 ...
    assert unpermute_rows(rows, 1).flatten().tolist() == [0, 2, 4, 6, 1, 3, 5, 7]


def test_tensor_names_map_to_hugging_face_llama():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.17.attn_q.weight") == "model.layers.17.self_attn.q_proj.weight"
    assert hf_tensor_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_tensor_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
