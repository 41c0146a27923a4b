"""The llama.cpp baseline (tether/loadtest/llama_cpp_server.py, llama_cpp_client.py) without llama.cpp: its
command line, its skip reasons, its process's life (a stand-in `llama_cpp.server` module on PYTHONPATH that
speaks the same OpenAI streaming API), the sampling it sends and how it counts tokens. The one test that
needs llama-cpp-python itself skips when it is not installed."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tether.loadtest import llama_cpp_client, llama_cpp_server, loadgen
from tether.loadtest.llama_cpp_client import LlamaCppStreamClient
from tether.loadtest.llama_cpp_server import LlamaCppServer
from tether.loadtest.workloads import BenchRequest

# A stand-in for llama-cpp-python's server: parses the flags tether passes, answers /v1/models and streams
# /v1/completions as llama_cpp/server/app.py does (one chunk per token, then a chunk with the finish reason,
# then [DONE]); each answer's text is one "w" per token up to max_tokens, and it logs every request body.
FAKE_SERVER = textwrap.dedent('''
    import argparse, json, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    p = argparse.ArgumentParser()
    for flag in ("--model", "--n_threads", "--n_threads_batch", "--n_ctx", "--interrupt_requests", "--host", "--port"):
        p.add_argument(flag, required=True)
    a = p.parse_args()
    if a.model == "exit":
        sys.exit("no such model")
    print("argv", json.dumps(sys.argv[1:]), flush=True)

    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"object": "list", "data": [{"id": a.model, "object": "model", "owned_by": "me"}]})
            self.send_response(200); self.send_header("Content-Type", "application/json"); self.end_headers()
            self.wfile.write(body.encode())

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            print("request", json.dumps(req), flush=True)
            self.send_response(200); self.send_header("Content-Type", "text/event-stream"); self.end_headers()
            def chunk(text, finish):
                c = {"id": "c", "object": "text_completion", "created": 0, "model": a.model,
                     "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}
                self.wfile.write(f"data: {json.dumps(c)}\\n\\n".encode()); self.wfile.flush()
            for _ in range(req["max_tokens"]):
                chunk("w", None)
            chunk("", "length")
            self.wfile.write(b"data: [DONE]\\n\\n")

        def log_message(self, *args):
            pass

    ThreadingHTTPServer((a.host, int(a.port)), H).serve_forever()
''')


@pytest.fixture
def fake_llama_cpp(tmp_path, monkeypatch) -> Path:
    pkg = tmp_path / "fake" / "llama_cpp" / "server"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "app.py").write_text("")
    (pkg / "__main__.py").write_text(FAKE_SERVER)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "fake"), os.environ.get("PYTHONPATH", "")]))
    return tmp_path


def test_the_command_runs_llama_cpp_server_on_the_gguf_with_the_stages_threads():
    cmd = llama_cpp_server.server_command("/venv/bin/python", Path("/m/model.gguf"), 4, 8123, 8192, 77)
    assert cmd[:2] == ["/venv/bin/python", "-c"] and "run_module('llama_cpp.server'" in cmd[2]
    assert cmd[3] == "77"   # the bench's pid, popped by the launcher before the server parses its flags
    flags = dict(zip(cmd[4::2], cmd[5::2]))
    assert flags == {"--model": "/m/model.gguf", "--n_threads": "4", "--n_threads_batch": "4", "--n_ctx": "8192",
                     "--interrupt_requests": "false", "--host": "127.0.0.1", "--port": "8123"}


def test_only_the_default_model_has_a_gguf():
    assert llama_cpp_server.gguf_of("tiny") is None
    reason = llama_cpp_server.skip_reason("/no/such/python", "tiny")
    assert "has no GGUF" in reason     # the model is checked first: no process is started for it


def _script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def test_the_import_check_names_a_missing_interpreter_or_package(tmp_path):
    assert "does not exist" in llama_cpp_server.import_check(str(tmp_path / "python"))
    broken = _script(tmp_path / "broken", "echo \"ModuleNotFoundError: No module named 'llama_cpp'\" >&2; exit 1\n")
    reason = llama_cpp_server.import_check(broken)
    assert "No module named 'llama_cpp'" in reason and llama_cpp_server.INSTALL_HINT in reason
    assert llama_cpp_server.import_check(_script(tmp_path / "ok", "exit 0\n")) == ""


def test_the_server_is_up_inside_the_block_and_gone_after_it(fake_llama_cpp):
    log = fake_llama_cpp / "logs" / "llama.log"
    server = LlamaCppServer(sys.executable, Path("model.gguf"), 3, 512, log, timeout_s=60)
    with pytest.raises(KeyboardInterrupt), server:
        assert server.proc is not None and server.proc.poll() is None
        assert server.base_url == f"http://127.0.0.1:{server.port}/v1"
        raise KeyboardInterrupt   # Ctrl-C in the middle of the baseline: the server still stops
    assert server.proc is not None and server.proc.poll() is not None
    assert server.display_command[:3] == [sys.executable, "-m", "llama_cpp.server"]
    argv = json.loads(next(line for line in log.read_text().splitlines() if line.startswith("argv"))[5:])
    assert argv[:2] == ["--model", "model.gguf"] and argv[argv.index("--n_threads") + 1] == "3"


def test_a_server_that_exits_at_start_fails_with_its_log(fake_llama_cpp):
    server = LlamaCppServer(sys.executable, Path("exit"), 1, 512, fake_llama_cpp / "llama.log", timeout_s=60)
    with pytest.raises(RuntimeError, match="exited with status 1: no such model"):
        server.__enter__()


def test_the_launcher_refuses_to_start_once_the_bench_is_gone(fake_llama_cpp):
    cmd = llama_cpp_server.server_command(sys.executable, Path("m"), 1, 1, 1, parent_pid=1)   # not our parent
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "the bench exited before" in done.stderr


def test_the_sampling_is_the_requests_own_in_llama_cpps_terms():
    greedy = BenchRequest(0, "synthetic", "p", 8, ignore_eos=True).params()
    assert llama_cpp_client.request_body(greedy, {2, 0}) == dict(
        temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repeat_penalty=1.0, logit_bias={"0": -100.0, "2": -100.0})
    sampled = BenchRequest(0, "single", "p", 8, temperature=0.8, top_k=40, top_p=0.9, seed=7).params()
    assert llama_cpp_client.request_body(sampled, {2}) == dict(temperature=0.8, top_p=0.9, top_k=40, min_p=0.0,
                                                               repeat_penalty=1.0, seed=7)


def test_tokens_are_the_budget_on_length_and_the_text_re_encoded_on_eos():
    def encode(text: str) -> list[int]:
        return list(range(len(text.split())))
    assert llama_cpp_client.output_tokens("a b c", "length", 64, encode) == 64
    assert llama_cpp_client.output_tokens("a b c", "stop", 64, encode) == 3


def test_the_load_generator_times_llama_cpp_through_its_openai_api(fake_llama_cpp):
    pytest.importorskip("openai")
    log = fake_llama_cpp / "llama.log"
    req = BenchRequest(0, "synthetic", "one two three", 5, ignore_eos=True)

    async def send(base_url: str):
        async with LlamaCppStreamClient(base_url, 30, lambda s: s.split(), {2}) as client:
            return await loadgen.run_request(client, req, "t", 0.0)   # type: ignore[arg-type]

    with LlamaCppServer(sys.executable, Path("model.gguf"), 1, 512, log, timeout_s=60) as server:
        rec = asyncio.run(send(server.base_url))
    assert rec.ok, rec.error
    assert (rec.output_tokens, rec.text, rec.finish_reason, rec.prompt_tokens) == (5, "wwwww", "length", 3)
    assert rec.ttft is not None and len(rec.itl) == 4 and rec.tpot is not None
    sent = json.loads(next(line for line in log.read_text().splitlines() if line.startswith("request"))[8:])
    assert sent["stream"] is True and sent["max_tokens"] == 5 and sent["logit_bias"] == {"2": -100.0}
    assert (sent["top_k"], sent["min_p"], sent["repeat_penalty"]) == (0, 0.0, 1.0)


def _real_python() -> str | None:
    """An interpreter with llama-cpp-python[server]: $TETHER_LLAMA_CPP_PYTHON, else this one, else none."""
    python = os.environ.get("TETHER_LLAMA_CPP_PYTHON") or sys.executable
    return None if llama_cpp_server.import_check(python) else python


def test_the_real_llama_cpp_server_streams_two_requests_at_once_to_their_budget(tmp_path):
    python = _real_python()
    if python is None:
        pytest.skip("llama-cpp-python[server] is not installed (set TETHER_LLAMA_CPP_PYTHON to its interpreter)")
    from tether.model import smollm2
    gguf = smollm2.tether_home() / "downloads" / Path(smollm2.WHEEL_MEMBER).name
    if not gguf.is_file():
        pytest.skip(f"the default model's GGUF is not downloaded ({gguf})")
    pytest.importorskip("openai")
    req = BenchRequest(0, "synthetic", "The capital of France is", 8, ignore_eos=True)

    async def send(base_url: str):
        async with LlamaCppStreamClient(base_url, 60, lambda s: [0] * len(s.split()), {0, 2}) as client:
            return await asyncio.gather(*(loadgen.run_request(client, req, "t", 0.0)   # type: ignore[arg-type]
                                          for _ in range(2)))

    with LlamaCppServer(python, gguf, 1, 2048, tmp_path / "llama.log") as server:
        records = asyncio.run(send(server.base_url))
    # Two at once: the second waits its turn (--interrupt_requests false) instead of cutting the first off.
    for rec in records:
        assert rec.ok, rec.error
        assert rec.output_tokens == 8 and rec.finish_reason == "length" and rec.text


def test_a_served_side_keeps_its_figures_and_says_what_failed():
    from tether.loadtest.records import RequestRecord
    from tether.loadtest.results import Side
    from tether.loadtest.runner import timed
    req = BenchRequest(0, "synthetic", "p", 5, ignore_eos=True)
    done = RequestRecord(req, "t", ttft=0.1, e2e=0.5, token_ids=[llama_cpp_client.NO_ID] * 5)
    refused = RequestRecord(req, "t", error_code="UNAVAILABLE", error="connection refused")
    side = Side()
    timed(side, loadgen.LevelRun(loadgen.Level("closed", concurrency=2), [done, refused], 1.0))
    assert side.runs == [5.0] and side.ttft_p50_ms == [100.0] and side.tpot_p50_ms == [pytest.approx(100.0)]
    assert side.error == "1 of 2 requests failed (UNAVAILABLE: connection refused)"


def test_llama_cpp_gets_the_stages_threads_in_total_unless_told_otherwise(tmp_path):
    from tether.loadtest.cli import build_parser, options_of
    flags = ["--stages", "3", "--threads", "2", "--pipelines", "2", "--baselines", "--out", str(tmp_path)]
    o = options_of(build_parser().parse_args(flags))
    assert (o.llama_cpp_threads, o.llama_cpp_python) == (12, sys.executable)
    assert o.llama_cpp_log == str(tmp_path / "logs" / "llama-cpp-server.log")
    o = options_of(build_parser().parse_args([*flags, "--llama-cpp-threads", "1", "--llama-cpp-python", "/v/python"]))
    assert (o.llama_cpp_threads, o.llama_cpp_python) == (1, "/v/python")
