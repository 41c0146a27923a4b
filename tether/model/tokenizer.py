"""Tokenizers: any Hugging Face tokenizer.json (through `tokenizers`), and the byte-level one of the presets.

The preset tokenizer maps each UTF-8 byte to the token id of the same value, so any text (Chinese included)
round-trips exactly. It is written as a real tokenizer.json, so presets and checkpoints share one path.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
BYTE_VOCAB_SIZE = 272  # 256 bytes + specials, padded to a multiple of 16


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte (what the ByteLevel pre-tokenizer emits)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def write_byte_tokenizer(folder: Path) -> None:
    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    # BOS/EOS/PAD (256-258) stay model-only ids: registered as special tokens, their spellings typed in a
    # prompt ("<|eos|>") would become control tokens instead of plain bytes. Decoding skips ids it lacks.
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>", "add_bos_token": False}))


class Tokenizer:
    """Text <-> token ids, plus the ids that end a sequence."""

    def __init__(self, hf: HFTokenizer, eos_ids: tuple[int, ...] = (), bos_id: int | None = None,
                 add_bos: bool = False) -> None:
        self.hf = hf
        self.eos_ids = frozenset(eos_ids)
        self.bos_id = bos_id
        self.add_bos = add_bos and bos_id is not None

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if self.add_bos else ids

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)


def load_tokenizer(folder: str | Path, eos_ids: tuple[int, ...] = (), bos_id: int | None = None) -> Tokenizer:
    folder = Path(folder)
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no tokenizer.json")
    cfg_path = folder / "tokenizer_config.json"
    tcfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    # Llama tokenizers add BOS in their post-processor already; only add it here when the config asks
    # and the tokenizer itself does not.
    hf = HFTokenizer.from_file(str(path))
    adds_itself = hf.post_processor is not None
    return Tokenizer(hf, eos_ids, bos_id, add_bos=bool(tcfg.get("add_bos_token")) and not adds_itself)
