"""Greedy answers: tether's reference against llama.cpp's llama-server on the default model's own GGUF.

Each chat prompt is answered greedily (EOS honoured) by `tether.reference.chat` in the given linear inputs and by
llama-server (built from the pinned llama.cpp, bench/llama_server.py; its min_p and repeat penalty off, as in
bench/llama_server_vs_tether.py), one request at a time. Prints, per prompt, whether the two texts are
identical and where they part, then the count. q8 computes the linears as llama.cpp does (8-bit inputs against
the file's groups); attention, the norms and llama.cpp's f16 KV cache still differ, so answers part where two
tokens are close.

    .venv/bin/python bench/llama_server_answers.py --linear-inputs q8
    .venv/bin/python bench/llama_server_answers.py --linear-inputs float32 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import llama_server  # noqa: E402
from bench.chat_clients import SIDE_EXTRA  # noqa: E402
from tether import reference  # noqa: E402
from tether.model import dtypes, smollm2  # noqa: E402

PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one sentence.",
           "请用不超过50字向老人解释血糖仪读数", "List three uses of a paperclip.", "How do I reverse a list in Python?",
           "用一句话介绍长城。", "Why is the sky blue?", "Translate 'good morning' to Spanish.", "What is 12 times 13?")


def llama_answer(base_url: str, prompt: str, max_tokens: int) -> str:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0.0,
            **SIDE_EXTRA["llama-server"]}
    req = urllib.request.Request(f"{base_url}/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)["choices"][0]["message"]["content"]


def parted_at(a: str, b: str) -> int:
    """The first character where `a` and `b` differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--linear-inputs", choices=dtypes.LINEAR_INPUTS, default="q8",
                   help="what tether's linears multiply (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2, help="llama-server's threads")
    p.add_argument("--isa", choices=llama_server.ISAS, default="native", help="which llama-server build")
    args = p.parse_args()
    try:
        binary = llama_server.build(isa=args.isa)
    except llama_server.Unavailable as e:
        print(f"llama_server_answers: skipped: {e}", file=sys.stderr)
        sys.exit(llama_server.SKIP)
    same = 0
    with tempfile.TemporaryDirectory() as tmp, \
            llama_server.LlamaServer(binary, smollm2.gguf_file(), args.threads, 1, Path(tmp) / "llama.log") as ls:
        for prompt in PROMPTS:
            theirs = llama_answer(ls.base_url, prompt, args.max_tokens).strip()
            ours = reference.chat([("user", prompt)], smollm2.NAME, max_tokens=args.max_tokens,
                                  inputs=args.linear_inputs).text.strip()
            if ours == theirs:
                same += 1
                print(f"same      {prompt!r}: {ours[:60]!r}")
            else:
                at = parted_at(ours, theirs)
                print(f"parts at {at:3d} {prompt!r}:\n    tether       {ours[:120]!r}\n    llama-server {theirs[:120]!r}")
    print(f"tether ({args.linear_inputs} linear inputs) and llama-server: {same} of {len(PROMPTS)} greedy answers "
          f"identical ({args.max_tokens} tokens at most)")


if __name__ == "__main__":
    main()
