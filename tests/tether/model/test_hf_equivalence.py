"""The independent check: tether's decoder gives Hugging Face transformers' logits on the same weights.

Random-weight Llama / Qwen2 / Mistral models (GQA, Qwen2's q/k/v biases, tied embeddings) are built with
transformers, saved as safetensors, loaded into tether with load_slice, and compared at every position: the
whole model, a 2-stage split, and incremental decode against HF's full forward.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tether.model.config import ModelConfig  # noqa: E402
from tether.model.llama import ModelSlice, SlotRows  # noqa: E402
from tether.model.loader import load_slice  # noqa: E402
from tether.model.tokenizer import write_byte_tokenizer  # noqa: E402

ATOL = RTOL = 1e-5
LENGTHS = (1, 7, 33, 100)
VOCAB = 300

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-6, attn_implementation="eager")

VARIANTS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=3)),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=2, tie_word_embeddings=True)),
    "llama_mha_4layers": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=4, num_key_value_heads=4)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_hidden_layers=3)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_hidden_layers=2, sliding_window=None)),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Replace HF's init (zero biases, unit norms) with random values so that every parameter matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.3 * noise)
            else:
                p.copy_(0.15 * noise)


def build(folder, variant: str, seed: int = 0, **overrides):
    cfg_name, model_name, extra = VARIANTS[variant]
    cfg = getattr(transformers, cfg_name)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    hf = getattr(transformers, model_name)(cfg).eval()
    _randomize(hf, seed)
    hf.save_pretrained(folder, safe_serialization=True)
    write_byte_tokenizer(folder)
    return hf


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = build(folder, request.param, seed=len(request.param))
    return request.param, folder, hf


def prompt(n: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n))


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=ids[None], use_cache=False).logits[0].float()


def run(model: ModelSlice, x: torch.Tensor, kv) -> torch.Tensor:
    n = x.shape[0]
    kv.ensure(kv.length + n)
    out = model(x, [SlotRows(kv, kv.length, n)])
    kv.length += n
    return out


def test_config_is_read_from_the_hf_folder(pair):
    variant, folder, hf = pair
    cfg = ModelConfig.from_folder(folder)
    c = hf.config
    assert cfg.architecture == VARIANTS[variant][1]
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (
        c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        c.num_attention_heads, c.num_key_value_heads, c.hidden_size // c.num_attention_heads)
    assert cfg.attention_bias == (variant == "qwen2")
    assert cfg.tie_word_embeddings == (variant == "llama_tied")
    if variant == "llama_tied":
        from safetensors import safe_open
        with safe_open(str(folder / "model.safetensors"), framework="pt") as st:
            assert "lm_head.weight" not in st.keys()        # the head really comes from the embedding


@pytest.mark.parametrize("n", LENGTHS)
def test_whole_model_logits_match_hf(pair, n):
    _, folder, hf = pair
    ids = prompt(n)
    want = hf_logits(hf, ids)
    assert want.abs().max() > 1.0                            # not a degenerate near-zero comparison
    m = load_slice(folder)
    got = m.logits(run(m, ids, m.new_kv()))
    assert got.shape == want.shape == (n, VOCAB)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("n", LENGTHS)
def test_two_stage_split_logits_match_hf(pair, n):
    _, folder, hf = pair
    ids = prompt(n)
    want = hf_logits(hf, ids)
    layers = hf.config.num_hidden_layers
    for cut in range(1, layers):
        s0, s1 = load_slice(folder, 0, cut), load_slice(folder, cut, layers)
        assert s0.has_embedding and not s0.has_head and s1.has_head and not s1.has_embedding
        hidden = run(s0, ids, s0.new_kv())
        got = s1.logits(run(s1, hidden, s1.new_kv()))
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("n", [4, 7, 33, 100])
def test_incremental_decode_matches_hf_full_forward(pair, n):
    """Prefill n-3 tokens, then 3 single-token steps: every position matches HF's one full forward."""
    _, folder, hf = pair
    ids = prompt(n)
    want = hf_logits(hf, ids)
    layers = hf.config.num_hidden_layers
    whole = load_slice(folder)
    s0, s1 = load_slice(folder, 0, 1), load_slice(folder, 1, layers)
    kv, kv0, kv1 = whole.new_kv(), s0.new_kv(), s1.new_kv()
    chunks = [ids[: n - 3], ids[n - 3: n - 2], ids[n - 2: n - 1], ids[n - 1:]]
    rows, split_rows = [], []
    for c in chunks:
        rows.append(whole.logits(run(whole, c, kv)))
        split_rows.append(s1.logits(run(s1, run(s0, c, kv0), kv1)))
    torch.testing.assert_close(torch.cat(rows), want, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(torch.cat(split_rows), want, atol=ATOL, rtol=RTOL)


def test_two_requests_batched_match_hf(pair):
    _, folder, hf = pair
    a, b = prompt(7), prompt(33)
    m = load_slice(folder)
    kva, kvb = m.new_kv(), m.new_kv()
    kva.ensure(7)
    kvb.ensure(33)
    got = m.logits(m(torch.cat([a, b]), [SlotRows(kva, 0, 7), SlotRows(kvb, 0, 33)]))
    torch.testing.assert_close(got[:7], hf_logits(hf, a), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got[7:], hf_logits(hf, b), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_non_default_rope_theta_matches_hf(tmp_path, variant):
    hf = build(tmp_path, variant, seed=3, rope_theta=1000.0)
    saved = json.loads((tmp_path / "config.json").read_text())
    theta = saved.get("rope_theta", (saved.get("rope_parameters") or {}).get("rope_theta"))
    assert theta == 1000.0
    m = load_slice(tmp_path)
    assert m.cfg.rope_theta == 1000.0
    ids = prompt(33)
    torch.testing.assert_close(m.logits(run(m, ids, m.new_kv())), hf_logits(hf, ids), atol=ATOL, rtol=RTOL)


def test_top_level_rope_theta_is_honoured(tmp_path):
    """Older checkpoints keep rope_theta at the top level of config.json: tether must use it."""
    hf = build(tmp_path, "llama", seed=4, rope_theta=1000.0)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = 1000.0
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = load_slice(tmp_path)
    assert m.cfg.rope_theta == 1000.0
    ids = prompt(33)
    torch.testing.assert_close(m.logits(run(m, ids, m.new_kv())), hf_logits(hf, ids), atol=ATOL, rtol=RTOL)


def test_unsupported_rope_scaling_is_refused(tmp_path):
    build(tmp_path, "llama", seed=5)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported rope_scaling"):
        load_slice(tmp_path)


def test_unsupported_architecture_is_refused(tmp_path):
    build(tmp_path, "llama", seed=6)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_slice(tmp_path)


def test_unsupported_rope_parameters_are_refused(tmp_path):
    build(tmp_path, "llama", seed=7)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("rope_scaling", None)
    cfg["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported rope"):
        load_slice(tmp_path)


@pytest.mark.parametrize("variant,extra", [
    ("mistral", dict(sliding_window=8)),
    ("qwen2", dict(sliding_window=8, use_sliding_window=True, max_window_layers=0)),
])
def test_sliding_window_is_honoured_or_refused(tmp_path, variant, extra):
    hf = build(tmp_path, variant, seed=8, **extra)
    try:
        m = load_slice(tmp_path)
    except ValueError as e:
        assert "sliding" in str(e)
        return
    ids = prompt(33)
    torch.testing.assert_close(m.logits(run(m, ids, m.new_kv())), hf_logits(hf, ids), atol=ATOL, rtol=RTOL)
