"""bench/llama_server.py and bench/llama_server_vs_tether.py's pure parts: the binary's cache key from the CPU
flags, llama-server's command line, each side's request body, and the arithmetic ceiling's round. Nothing is
built or started here."""

from __future__ import annotations

import os

from pathlib import Path

import pytest

from bench import arithmetic_ceiling, llama_server
from bench.chat_clients import chat_body
from bench.llama_server_vs_tether import TARGETS, ceiling_text, median_step, served_output_len, verdict

AVX512 = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni hypervisor rdrand"


def test_cache_key_depends_on_simd_flags_only_and_not_their_order():
    flags = AVX512.split()
    key = llama_server.cache_key(flags)
    assert key.startswith(f"{llama_server.VERSION}-") and len(key) == len(llama_server.VERSION) + 13
    assert llama_server.cache_key(reversed(flags)) == key
    assert llama_server.cache_key([*flags, "nx", "smep", "constant_tsc"]) == key      # not in the binary
    assert llama_server.cache_key([f for f in flags if f != "avx512_vnni"]) != key          # another -march=native
    assert llama_server.cache_key([*flags, "amx_tile"]) != key
    assert llama_server.cache_key(flags, version="0.3.37") != key
    assert llama_server.cache_key(flags, [*llama_server.CMAKE_OPTIONS, "-DGGML_OPENMP=OFF"]) != key


def test_relevant_flags_keep_x86_and_arm_simd():
    assert llama_server.relevant_flags(AVX512.split()) == [
        "avx", "avx2", "avx512_vnni", "avx512bw", "avx512f", "avx512vl", "f16c", "fma", "sse", "sse2", "sse4_1",
        "sse4_2", "ssse3"]
    assert llama_server.relevant_flags("fp asimd asimddp sve i8mm sme2 cpuid".split()) == [
        "asimd", "asimddp", "i8mm", "sme2", "sve"]


def test_cpu_flags_and_binary_path(tmp_path: Path):
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: {AVX512}\n\nprocessor\t: 1\nflags\t\t: sse\n")
    flags = llama_server.cpu_flags(info)
    assert "avx512f" in flags and "sse" in flags
    assert llama_server.cpu_flags(tmp_path / "missing") == frozenset()
    path = llama_server.binary_path(flags, home=tmp_path)
    assert path == tmp_path / "llama-server" / llama_server.cache_key(flags) / "llama-server"


def test_build_and_configure_commands_stay_offline():
    cmd = llama_server.configure_command(Path("/src"), Path("/b"), "Ninja")
    assert cmd[:7] == ["cmake", "-S", "/src", "-B", "/b", "-G", "Ninja"]
    for option in ("-DLLAMA_BUILD_SERVER=ON", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
                   "-DLLAMA_BUILD_TESTS=OFF", "-DCMAKE_BUILD_TYPE=Release"):
        assert option in cmd
    assert "-G" not in llama_server.configure_command(Path("/src"), Path("/b"), None)
    assert llama_server.build_command(Path("/b"), 2) == ["cmake", "--build", "/b", "--target", "llama-server", "-j", "2"]


def test_an_avx2_build_keeps_ggml_to_avx2_and_is_cached_apart(tmp_path):
    """--isa avx2: no -march=native, AVX-512 off, AVX2/FMA/F16C on, everything else as the native build; its own
    cache folder, so the native binary is never taken for it (or the other way round)."""
    native, avx2 = llama_server.cmake_options("native", AVX512.split()), llama_server.cmake_options("avx2")
    assert native == llama_server.CMAKE_OPTIONS
    assert "-DGGML_NATIVE=ON" not in avx2 and {"-DGGML_NATIVE=OFF", "-DGGML_AVX512=OFF", "-DGGML_AVX2=ON",
                                                 "-DGGML_FMA=ON", "-DGGML_F16C=ON"} <= set(avx2)
    assert set(native) - {"-DGGML_NATIVE=ON"} <= set(avx2)
    cmd = llama_server.configure_command(Path("/src"), Path("/b"), None, "avx2")
    assert "-DGGML_AVX512=OFF" in cmd and "-DGGML_NATIVE=ON" not in cmd
    flags = AVX512.split()
    assert llama_server.binary_path(flags, home=tmp_path, isa="avx2") != llama_server.binary_path(flags, home=tmp_path)
    with pytest.raises(ValueError, match="avx2"):
        llama_server.cmake_options("avx512")


def test_missing_tools_names_what_is_missing(monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(llama_server.shutil, "which", lambda name: None if name == "cmake" else f"/usr/bin/{name}")
    assert llama_server.missing_tools() == "missing cmake to build llama-server"
    monkeypatch.setattr(llama_server.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert llama_server.missing_tools() == ""


def test_server_command_threads_slots_batching_and_context():
    cmd = llama_server.server_command(Path("/bin/llama-server"), Path("/m.gguf"), threads=2, parallel=8, port=4321)
    assert cmd[:3] == ["/bin/llama-server", "-m", "/m.gguf"]
    args = dict(zip(cmd[3::], cmd[4::]))
    assert args["-t"] == "2" and args["-tb"] == "2" and args["-np"] == "8"
    assert args["-c"] == str(8 * 1024)          # the total context, split among the 8 slots
    assert args["--host"] == "127.0.0.1" and args["--port"] == "4321"
    assert "-cb" in cmd and "--no-webui" in cmd
    traced = llama_server.server_command(Path("/b"), Path("/m"), 2, 1, 1, extra=llama_server.TRACE)
    assert traced[-2:] == ["-lv", "4"]


def test_system_info_line():
    log = "load ...\nmain: system_info: n_threads = 2 (n_threads_batch = 2) / 2 | CPU : AVX512 = 1 |\nready\n"
    assert llama_server.system_info(log) == "n_threads = 2 (n_threads_batch = 2) / 2 | CPU : AVX512 = 1 |"
    assert llama_server.system_info("nothing") == ""


def test_chat_body_same_sampling_each_side_its_own_fields():
    greedy = dict(max_tokens=64, temperature=0.0, top_k=0, top_p=0.0, seed=0, ignore_eos=True)
    t, ls = chat_body(greedy, "tether"), chat_body(greedy, "llama-server")
    assert "top_p" not in t and ls["top_p"] == 1.0          # tether's "off" is no top_p; llama.cpp's default is 0.95
    assert t["extra_body"] == {"top_k": 0, "ignore_eos": True}
    assert ls["extra_body"] == {"top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0, "ignore_eos": True}
    for body in (t, ls):
        assert body["max_tokens"] == 64 and body["temperature"] == 0.0 and "seed" not in body
        assert body["stream_options"] == {"include_usage": True}
    sampled = dict(max_tokens=32, temperature=0.8, top_k=40, top_p=0.9, seed=7, ignore_eos=False)
    t, ls = chat_body(sampled, "tether"), chat_body(sampled, "llama-server")
    assert t["top_p"] == ls["top_p"] == 0.9 and t["seed"] == ls["seed"] == 7
    assert "ignore_eos" not in t["extra_body"] and "ignore_eos" not in ls["extra_body"]
    assert t["extra_body"]["top_k"] == ls["extra_body"]["top_k"] == 40


def test_a_native_build_on_an_amx_cpu_leaves_ggml_s_amx_out_and_is_cached_apart(tmp_path):
    """ggml's AMX matmul segfaulted on the AMX Xeon measured: -march=native less AMX there, its own binary."""
    flags = AVX512.split()
    amx = llama_server.cmake_options("native", [*flags, "amx_tile", "amx_int8", "amx_bf16"])
    assert set(amx) - set(llama_server.CMAKE_OPTIONS) == set(llama_server.NO_AMX_OPTIONS)
    assert all("-mno-amx-int8" in o for o in llama_server.NO_AMX_OPTIONS)
    assert not set(llama_server.cmake_options("native", flags)) & set(llama_server.NO_AMX_OPTIONS)
    assert llama_server.cmake_options("avx2", [*flags, "amx_int8"]) == llama_server.cmake_options("avx2", flags)
    assert llama_server.binary_path([*flags, "amx_int8"], home=tmp_path) != llama_server.binary_path(flags, home=tmp_path)


def test_the_arithmetic_ceiling_prefills_one_prompt_per_output_len_tokens_of_a_round():
    # 8 streams: 20 ms of decode rows + 5 of head + 8/64 of an 80 ms prefill = a 35 ms round of 8 tokens
    assert arithmetic_ceiling.Round(8, 20.0, 5.0, 80.0).tok_s(64) == pytest.approx(8 / 0.035)
    # one stream: every token pays 1/64 of its prompt
    assert arithmetic_ceiling.Round(1, 6.0, 1.5, 64.0).tok_s(64) == pytest.approx(1 / 0.0085)
    # longer answers spread the prompt thinner
    assert arithmetic_ceiling.Round(8, 20.0, 5.0, 80.0).tok_s(128) > arithmetic_ceiling.Round(8, 20.0, 5.0, 80.0).tok_s(64)


def test_the_ceiling_prefills_as_many_whole_prompts_a_call_as_a_micro_batch_holds():
    from tether import settings
    # smollm2's synthetic 64 tokens in its chat template are 94: 512 // 94 = 5 prompts a call at 8 streams
    assert arithmetic_ceiling.prompts_per_call(8, 94) == settings.MAX_BATCH_TOKENS // 94 == 5
    assert arithmetic_ceiling.prompts_per_call(1, 94) == 1                          # one stream: one prompt at a time
    assert arithmetic_ceiling.prompts_per_call(3, 94) == 3
    assert arithmetic_ceiling.prompts_per_call(32, settings.MAX_BATCH_TOKENS + 1) == 1   # a long one: in chunks
    assert arithmetic_ceiling.prompts_per_call(64, 2) == settings.MAX_BATCH_SLOTS     # slots bound it too


def test_the_ceiling_counts_a_prompt_as_admission_renders_it():
    from tether import reference
    from tether.model.loader import resolve_model
    lm = reference.load("tiny")
    prompts = ["one two", "a longer prompt of several more words than that", "three words here"]
    rendered = [reference.render_chat(lm, [("user", p)])[1] for p in prompts]
    served = sorted(len(ids) for ids in rendered)
    assert served[1] > len(lm.tokenizer.encode(prompts[2]))       # the chat template's tokens count too
    tokens, shared = arithmetic_ceiling.chat_prompt_tokens(resolve_model("tiny"), prompts)
    assert tokens == served[1]                                    # the median
    # every prompt starts with the template's tokens up to its text: the prefix cache serves those
    assert 0 < shared == len(os.path.commonprefix(rendered)) < served[0]
    one = arithmetic_ceiling.chat_prompt_tokens(resolve_model("tiny"), prompts[:1])
    assert one == (len(rendered[0]), len(rendered[0]) - 1)        # one prompt alone: all but its last token


def test_the_ceiling_counts_the_multiply_adds_of_a_round_and_of_a_prompt():
    from tether.model.config import ModelConfig
    cfg = ModelConfig(vocab_size=10, hidden_size=4, intermediate_size=8, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=2)
    # a layer's linears: q, o 4 x 4; k, v 4 x 2; gate, up, down 4 x 8 = 144 multiply-adds a row
    # one decode row at 3 positions: + 2 x 4 x 3 of attention a layer; the head 4 x 10
    assert arithmetic_ceiling.model_gflop(cfg, 1, 3, head_rows=1) == pytest.approx(2 * (2 * (144 + 24) + 40) / 1e9)
    # a 3-token prompt attends over 1 + 2 + 3 positions; its head is not counted
    assert arithmetic_ceiling.model_gflop(cfg, 3, 0, causal=True) == pytest.approx(2 * 2 * (3 * 144 + 48) / 1e9)
    # ... and after 5 cached positions over 6 + 7 + 8
    assert arithmetic_ceiling.model_gflop(cfg, 3, 5, causal=True) == pytest.approx(2 * 2 * (3 * 144 + 8 * 21) / 1e9)
    r = arithmetic_ceiling.Round(8, 20.0, 5.0, 80.0, 94, decode_gflop=2.5, prefill_gflop=16.0)
    assert r.rates() == pytest.approx((100.0, 200.0))


def test_the_report_takes_each_part_of_tethers_served_step_as_its_median_over_the_runs():
    runs = [dict(step_ms=40.0, busy_ms=[15.0, 20.0], sampling_ms=3.0, rest_ms=5.0), None,
            dict(step_ms=44.0, busy_ms=[16.0, 21.0], sampling_ms=2.0, rest_ms=7.0),
            dict(step_ms=50.0, busy_ms=[14.0, 25.0], sampling_ms=4.0, rest_ms=11.0)]
    assert median_step(runs) == dict(step_ms=44.0, busy_ms=[15.0, 21.0], sampling_ms=3.0, rest_ms=7.0)
    assert median_step([None, None]) is None and median_step([]) is None


def test_a_row_under_its_target_says_whether_the_arithmetic_or_the_serving_falls_short():
    assert TARGETS == {1: 1.0, 8: 2.0, 32: 2.0}
    assert verdict(2.05, 2.30, 2.0) == "met (2×)" and verdict(1.008, 1.59, 1.0) == "met (1×)"
    # the ceiling over the target: the serving's share of it is what falls short (2.0 / 2.07, 1.53 / 2.07)
    assert verdict(1.53, 2.07, 2.0) == "short of 2×: needs 97% of the ceiling served, 74% was"
    # the ceiling under the target: no serving reaches it
    assert verdict(1.44, 1.90, 2.0) == "short of 2×: the arithmetic alone allows 1.90×"
    assert verdict(1.44, None, 2.0) == "short of 2× (no ceiling timed)"
    assert verdict(3.0, 3.3, None) == "–" and verdict(None, 2.0, 2.0) == "–"   # no target there; no ratio


def test_a_chat_rows_ceiling_takes_the_answers_length_tether_served():
    # each run's output tokens over its completed requests, the median over the runs
    runs = [dict(output_tokens=4468, completed=64), dict(output_tokens=4465, completed=64),
            dict(output_tokens=3881, completed=62), dict(output_tokens=0, completed=0)]
    assert served_output_len(runs) == round(4465 / 64) == 70
    assert served_output_len([dict(output_tokens=1, completed=4)]) == 1            # never a zero-length answer
    assert served_output_len([dict(output_tokens=0, completed=0)]) is None and served_output_len([]) is None


def test_chats_prompts_arrive_one_at_a_time_synthetics_together():
    # the tiny model in this process: chat's ceiling prefills one prompt a call, synthetic's waves as many as fit
    apart, = arithmetic_ceiling.measure([4], 1, 12, 8, "float32", model_name="tiny", repeats=1, together=False)
    waves, = arithmetic_ceiling.measure([4], 1, 12, 8, "float32", model_name="tiny", repeats=1)
    assert apart.prompts_a_call == 1 and waves.prompts_a_call == arithmetic_ceiling.prompts_per_call(4, 12) == 4
    assert apart.prompt_tokens == waves.prompt_tokens == 12 and apart.prefill_ms > 0 and waves.prefill_ms > 0
    text = ceiling_text("chat", apart, 70)
    assert text.startswith("chat at 4 streams: decode ") and "+ 4/70 x prefill" in text and "(1 a call; " in text
