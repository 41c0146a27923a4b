"""tether's logits in each dtype (and float32 with q8 linear inputs) against Hugging Face transformers in float32,
on the same checkpoint.

For each prompt of a small Chinese and English set (tether/loadtest/data/single.jsonl, chat-rendered), the
context is the prompt plus transformers' own greedy continuation (fp32), so every position is one a served
greedy request could reach. Reported per dtype: the max and mean |logit difference| over every position,
and greedy agreement (argmax equal) over every position and over the continuation only.

    .venv/bin/python bench/accuracy.py --prompts 8 --new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tether.model import numerics, smollm2  # noqa: E402
from tether.model.chat_template import load_chat_template, render_conversation  # noqa: E402
from tether.model.llama import SlotRows  # noqa: E402
from tether.model.loader import load_model_tokenizer, load_slice, resolve_model  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "tether" / "loadtest" / "data" / "single.jsonl"


def prompts(n: int) -> list[tuple[str, str]]:
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    zh = [r for r in rows if r["lang"] == "zh"][: (n + 1) // 2]
    en = [r for r in rows if r["lang"] == "en"][: n // 2]
    return [(r["lang"], r["prompt"]) for r in zh + en]


def main() -> None:
    import transformers

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8, help="prompts, half Chinese, half English (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy continuation length (default: %(default)s)")
    p.add_argument("--dtypes", default="float32,float32+q8,bfloat16",
                   help="tether dtypes to compare, each with +q8 for --linear-inputs q8 (default: %(default)s)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON figures here")
    args = p.parse_args()
    folder = resolve_model(smollm2.NAME)
    gguf = smollm2.gguf_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                          dtype=torch.float32).eval()
    tok, template = load_model_tokenizer(folder), load_chat_template(folder)
    contexts = []
    for lang, text in prompts(args.prompts):
        ids = tok.encode(render_conversation(template, [("user", text)]))
        with torch.no_grad():
            full = hf.generate(torch.tensor([ids]), max_new_tokens=args.new_tokens, do_sample=False)[0]
            want = hf(input_ids=full[None], use_cache=False).logits[0].float()
        contexts.append((lang, full, len(ids), want))
    result = {}
    for dtype in args.dtypes.split(","):
        name, _, inputs = dtype.partition("+")
        model = load_slice(folder, dtype=name, inputs=inputs or "float32")
        worst, total, count, agree, agree_new, new = 0.0, 0.0, 0, 0, 0, 0
        for _, full, prompt_len, want in contexts:
            kv = model.new_kv()
            kv.ensure(full.numel())
            got = model.logits(model(full, [SlotRows(kv, 0, full.numel())]))
            diff = (got - want).abs()
            worst, total, count = max(worst, float(diff.max())), total + float(diff.sum()), count + diff.numel()
            same = got.argmax(-1) == want.argmax(-1)
            agree += int(same.sum())
            agree_new += int(same[prompt_len - 1:-1].sum())
            new += same[prompt_len - 1:-1].numel()
        positions = sum(c[1].numel() for c in contexts)
        result[dtype] = dict(max_abs_logit_diff=worst, mean_abs_logit_diff=total / count,
                             greedy_agreement=agree / positions, greedy_agreement_continuation=agree_new / new,
                             positions=positions, continuation_positions=new, padded=model.rows.padded)
        print(f"{dtype}{'' if model.rows.padded else ' (unpadded)'}: max |logit diff| {worst:.4f}, mean {total / count:.5f}; "
              f"argmax agrees at {agree}/{positions} positions, {agree_new}/{new} of the continuation", flush=True)
    print(f"({len(contexts)} prompts: {sum(c[0] == 'zh' for c in contexts)} zh, {sum(c[0] == 'en' for c in contexts)} en; "
          f"auto chooses {numerics.resolve('auto', model.cfg)} here)")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
