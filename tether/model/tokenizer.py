"""Tokenizers: any Hugging Face tokenizer.json (through `tokenizers`), and the byte-level one of the presets.

The preset tokenizer maps each UTF-8 byte to the token id of the same value, so any text (Chinese included)
round-trips exactly, plus ChatML's two control tokens (<|im_start|>, <|im_end|>) so that presets render
conversations as a real instruct model does. It is written as a real tokenizer.json, so presets and
checkpoints share one path.

Control tokens: a raw prompt is the caller's whole text, so its control-token spellings are control tokens
(`encode`). A conversation is template text with the callers' message contents inside it; only the template's
own text may make control tokens (`encode_chat`), so a message cannot close its turn and forge another.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
IM_START_ID, IM_END_ID = 259, 260   # the preset's ChatML control tokens
CHATML_CONTROL = {"<|im_start|>": IM_START_ID, "<|im_end|>": IM_END_ID}
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


def byte_tokenizer() -> HFTokenizer:
    """The presets' tokenizer: a byte per token, plus ChatML's two control tokens."""
    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)} | CHATML_CONTROL
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    # BOS/EOS/PAD (256-258) stay model-only ids: registered as special tokens, their spellings typed in a
    # prompt ("<|eos|>") would become control tokens instead of plain bytes. Decoding skips ids it lacks.
    # ChatML's markers are control tokens (259, 260: in the vocabulary above, so they keep those ids), as in
    # SmolLM2: the chat template's markers are one id each, and a message's spelling of them stays bytes.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHATML_CONTROL])
    return tok


def write_byte_tokenizer(folder: Path) -> None:
    byte_tokenizer().save(str(folder / "tokenizer.json"))
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
        # The control tokens (special added tokens) by spelling, and a copy of `hf` that encodes them as plain
        # text: its own instance, since the switch is per tokenizer, not per call.
        self.controls = {t.content: i for i, t in hf.get_added_tokens_decoder().items() if t.special}
        self._as_text = HFTokenizer.from_str(hf.to_str())
        self._as_text.encode_special_tokens = True
        # Leftmost-longest, as the tokenizer matches added tokens.
        self._control_re = re.compile("|".join(re.escape(c) for c in sorted(self.controls, key=len, reverse=True))
                                      ) if self.controls else None

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if self.add_bos and self.bos_id is not None else ids

    def control_tokens(self, text: str) -> list[str]:
        """The control-token spellings `encode` would turn into control tokens in `text`, in order."""
        return self._control_re.findall(text) if self._control_re is not None else []

    def encode_chat(self, parts: Iterable[tuple[str, bool]]) -> list[int]:
        """Ids of the concatenation of `parts`, (text, trusted) pairs, where only trusted text (a chat
        template's own) makes control tokens; the rest is tokenized as plain text, control spellings included.

        The same ids as `encode` of the joined text whenever the untrusted parts hold no control spelling:
        the tokenizer splits at control tokens first and tokenizes what lies between them on its own, and so
        does this, with the untrusted text kept inside the stretches between them (so a message's first word
        merges with the template text before it exactly as in `encode`). Exception: a control token with
        lstrip/rstrip would swallow a message's adjacent whitespace in `encode`; here it does not.
        """
        ids: list[int] = [self.bos_id] if self.add_bos and self.bos_id is not None else []
        run: list[str] = []   # text since the last control token

        def flush() -> None:
            if run:
                ids.extend(self._as_text.encode("".join(run), add_special_tokens=False).ids)
                run.clear()

        for text, trusted in parts:
            if not trusted or self._control_re is None:
                run.append(text)
                continue
            at = 0
            for m in self._control_re.finditer(text):
                run.append(text[at:m.start()])
                flush()
                ids.append(self.controls[m.group()])
                at = m.end()
            run.append(text[at:])
        flush()
        return ids

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
