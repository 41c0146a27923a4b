"""`tether up --demo` (what `make run` shows a newcomer), against a real cluster: every demo request answered and
printed with its tags, and a random-weight preset's noise called noise."""

from __future__ import annotations

from tether.cli.cluster import LocalCluster
from tether.cli.up import DEMO_CHATS, DEMO_PROMPTS, run_demo
from tether.model.chat_template import load_chat_template
from tether.model.loader import resolve_model


def test_the_demo_prints_each_answer_with_its_tags_and_calls_a_presets_answers_noise(tmp_path, capsys):
    c = LocalCluster(model="tiny", stages=1, threads=1, log_dir=tmp_path, http=False).launch()
    try:
        c.wait_ready(180)
        capsys.readouterr()
        run_demo(c.target, "tiny")
    finally:
        c.stop()
    out = capsys.readouterr().out
    chats = load_chat_template(resolve_model("tiny")) is not None
    asked = len(DEMO_CHATS) + 1 if chats else len(DEMO_PROMPTS)   # the conversation's follow-up is one more
    assert out.count("\n  answer (") == out.count("\n  receipt: request ") == asked, out
    assert "language=zh task=qa length_limit=50chars domain=medical audience=elderly" in out, out
    assert "(tiny has random weights: its answers are noise." in out
    assert "SmolLM2-135M-Instruct is small" not in out
