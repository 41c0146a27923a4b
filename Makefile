# tether — the two commands a newcomer needs are `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROTOS := $(wildcard protos/tether/v1/*.proto)
GEN := $(patsubst protos/%.proto,%_pb2.py,$(PROTOS))

# bench-llama-server: the stages' --linear-inputs (float32 or q8), and the instruction sets both sides use (native,
# or avx2: an AVX2-only CPU's code on this one)
LINEAR_INPUTS ?= float32
ISA ?= native
# ... and its workloads: synthetic 64 / 64 (every answer its full length, prompts in waves) and chat (answers end at
# their own EOS, prompts one at a time)
WORKLOADS ?= synthetic,chat

.PHONY: help setup proto run lint test test-fast bench bench-chaos bench-llama-server bench-front-door bench-memory bench-overload bench-prefix soak clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*##/\t/'

# --no-compile: pip byte-compiles every file it installs one at a time (torch, transformers: ~60 s of a fresh
# setup's ~95 s here); BYTECODE below does it on every core instead.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --no-compile -e '.[test]'
	touch $(STAMP)

# Byte code for the installed packages, written once. Python would otherwise compile a module on its first
# import, but not keep it where PYTHONDONTWRITEBYTECODE is set (this machine's environment, the Dockerfile's):
# then every process compiled torch from source again, ~4 of a stage's ~8 s start on tiny, and `make test` starts
# ~220 services. A few files of torch's own tests do not compile under this Python: ignored (never imported).
BYTECODE := $(VENV)/.bytecode
$(BYTECODE): $(STAMP)
	$(BIN)/python -m compileall -q -j 0 $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') > /dev/null || true
	touch $@

# The default model (SmolLM2-135M-Instruct): fetched and converted once into the models cache; redone when the
# converter changes (a new converter version writes a new folder beside the old).
MODEL_STAMP := $(VENV)/.model-smollm2
$(MODEL_STAMP): $(STAMP) tether/model/gguf_convert.py tether/model/smollm2.py
	$(BIN)/python -m tether.model
	touch $@

setup: $(STAMP) $(BYTECODE) proto $(MODEL_STAMP)  ## virtualenv, packages (byte-compiled), generated gRPC code and the default model

proto: $(STAMP) $(GEN)  ## generate Python code from protos/ (grpcio-tools)

tether/v1/%_pb2.py: protos/tether/v1/%.proto $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $<

run: setup  ## start the local cluster on the default model (SmolLM2-135M-Instruct) and show it answering
	$(BIN)/tether up --demo

lint: $(STAMP) proto  ## ruff (a small rule set that finds bugs) and mypy (services/ and tether/), as pyproject.toml sets them
	$(BIN)/ruff check .
	$(BIN)/mypy

# Three test processes (pytest-xdist), each test file whole on one of them (the shared cluster is started once per
# process): a service test waits on processes and sockets part of the time, so on 2 cores two workers left the CPU
# ~16% idle and three leave it ~4% (pytest 465-643 s with three, quiet machine; with the fork servers, on an AMD
# EPYC without AVX-512: 543 s with three, 578 s with four). TEST_WORKERS=0 runs everything
# in this process (a debugger, or -x on the first failure). The last line is the whole command's wall time, from
# make's start: venv, packages, model and lint included. `make lint` runs first. Failures print Python's own
# tracebacks (--tb=native): pytest's long form parses each frame's source with `ast`, which on CPython 3.11.7 can
# raise "SystemError: AST constructor recursion depth mismatch" (cpython gh-106905), and that turned one failing
# test into an INTERNALERROR that stopped the whole run without naming it (a fresh clone's run, 2026-12-06).
TEST_WORKERS ?= 3
MAKE_STARTED := $(shell date +%s)
test: setup lint  ## lint and types first (they fail it), then the whole suite (unit + services on loopback) in TEST_WORKERS processes, longest files first; prints its wall time
	@$(BIN)/python -m compileall -q -j 0 tether services tests bench > /dev/null   # our own byte code, as BYTECODE
	@$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15 --tb=native; rc=$$?; \
	echo "make test: $$(( $$(date +%s) - $(MAKE_STARTED) )) s wall from make's start (setup included), exit $$rc"; exit $$rc

# On the default model (SmolLM2-135M), 2 stages: this machine's 2 cores saturate near 0.3 req/s, so the sweep stays low.
bench: setup  ## load sweep with audit and baselines on the default model, against a cluster this target starts (~15 min)
	$(BIN)/python -m tether.cli.main bench --spawn --sweep 0.1,0.2,0.4 --num-requests 12 --audit --baselines --baseline-requests 12 --batch-size 8 --slo ttft:3000,tpot:300 --out bench-out

bench-chaos: setup  ## every fault kind alone, stamp checks on and off: injected / detected / recovered / failed / wrong
	$(BIN)/python -m tether.cli.main bench --spawn --model tiny --chaos all --concurrency 8 --num-requests 24 --out bench-out/chaos

bench-front-door: setup  ## a small request's latency idle vs while 4 and 8 clients send adversarial prompts at the cap (exit 1 past 2x)
	$(BIN)/python -m bench.front_door --out bench-out/front-door/report.json --log-dir bench-out/front-door/logs

bench-memory: setup  ## stage RSS after 1,000 and 10,000 short requests on tiny (exit 1 past +10%; a few minutes, not in `make test`)
	$(BIN)/python -m bench.memory --out bench-out/memory/report.json --log-dir bench-out/memory/logs

bench-overload: setup  ## two pipelines at 2x their saturating rate: priorities, a tenant over its bucket, a pipeline killed (~6 min)
	$(BIN)/python -m bench.overload --out bench-out/overload/report.json --log-dir bench-out/overload/logs

bench-prefix: setup  ## prefix cache: multiturn on tiny with and without the cache, 3 interleaved pairs: TTFT p50 ratio, hit rate (~4 min)
	$(BIN)/python -m tether.cli.main bench --spawn --model tiny --workload multiturn --concurrency 8 --num-requests 32 --compare-prefix-cache --compare-repeats 3 --audit --out bench-out/prefix

bench-llama-server: setup  ## tether's HTTP face vs llama.cpp's llama-server (continuous batching) on the default model's GGUF, 1/8/32 streams, synthetic and chat (builds it once, ~10 min; then ~13 min); LINEAR_INPUTS=q8 for llama.cpp's arithmetic, ISA=avx2 for both sides kept to AVX2, WORKLOADS=synthetic for one
	$(BIN)/python bench/llama_server_vs_tether.py --workloads $(WORKLOADS) --concurrency 1,8,32 --requests 8,16,32 --repeats 3 --linear-inputs $(LINEAR_INPUTS) --isa $(ISA)

soak: setup  ## a few hundred concurrent streams for ~5 minutes with random cancels, every answer checked; RSS at start, after 1 min, at the end (exit 1 past +10% after 1 min)
	$(BIN)/python -m bench.soak --out bench-out/soak/report.json --log-dir bench-out/soak/logs

clean:  ## remove the virtualenv, generated code and caches
	rm -rf $(VENV) tether/v1/*_pb2*.py tether/v1/*_pb2.pyi .pytest_cache
