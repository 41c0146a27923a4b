"""Every tunable default of tether lives here, so there is one obvious place to look.

Services expose these as command-line flags; the flags' defaults come from this module.
"""

import os

# 2: the payload digest binds every slot's MAC and row layout, not only its context hash.
PROTOCOL_VERSION = 2

# Ports. `tether up` fixes only what a user connects to (admission's gRPC and HTTP, /metrics when asked) and
# reserves them before it starts anything; its stages and coordinators take ports the kernel gives them and
# report them (tether/ports.py). The internal defaults are each service's own --port, which the containers of
# docker-compose.yml and deploy/k8s use (each service in its own network namespace: nothing else binds there).
ADMISSION_PORT = 50051
HTTP_PORT = 8000               # admission's OpenAI-compatible HTTP API (vLLM's default port)
HTTP_SSE_PING_S = 15.0         # an SSE comment line this often keeps idle proxies from closing a slow stream
HTTP_MAX_CONNECTIONS = 1024    # open HTTP connections + requests beyond which uvicorn answers 503 at once
HTTP_KEEPALIVE_S = 30.0        # an idle keep-alive HTTP connection is closed after this
COORDINATOR_PORT = 50061
STAGE_BASE_PORT = 50071        # the containers' stage i listens on this + i

# The model `tether up`, `make run` and `tether bench` serve: SmolLM2-135M-Instruct, converted once from its GGUF
# (tether/model/smollm2.py). The random presets tiny/small/base are for unit tests and kernel benchmarks.
DEFAULT_MODEL = "smollm2"

# Admission limits.
MAX_PROMPT_BYTES = 64 * 1024
MAX_PROMPT_TOKENS = 4096
MAX_OUTPUT_TOKENS = 2048
DEFAULT_MAX_TOKENS = 64
MAX_STOP_SEQUENCES = 8
MAX_STOP_BYTES = 128
MAX_CONCURRENT_REQUESTS = 256  # admission's global cap; beyond it: RESOURCE_EXHAUSTED
MAX_TEMPERATURE = 2.0
MAX_TENANT_CHARS = 64          # tenant names are cache namespaces and metric labels: keep them short
MAX_REQUEST_ID_CHARS = 128
MAX_MESSAGES = 256             # messages in one conversation; their contents share MAX_PROMPT_BYTES
OVERLOAD_RETRY_AFTER_S = 1.0   # RetryInfo delay admission suggests when it refuses for overload
READINESS_POLL_S = 1.0         # how often admission asks its coordinator whether it is serving
LOAD_REPORT_INTERVAL_S = 0.25  # how often each coordinator streams its load to admission (Coordinator.Watch)
DISCOVERY_INTERVAL_S = 5.0     # how often admission re-resolves `--coordinator dns:NAME:PORT` (pipelines come and go)
ROUTE_POLICIES = ("features", "least-loaded", "round-robin")   # admission's routing (services/admission/routing.py)
ROUTE_POLICY = "features"      # the default: by predicted cost, load, prefix affinity, KV room and roles
# A decode token costs about this many prefill tokens of work: one engine step per output token (what a step
# costs is mostly its fixed part on these models), against prompt tokens computed hundreds per step. Admission's
# router predicts a request's cost with it, the coordinator its pipeline's pending work (Coordinator.Watch).
DECODE_TOKEN_COST = 8.0
# A request whose client set no deadline gets this one (admission, and the coordinator for its own peers):
# a wedged request ends with DEADLINE_EXCEEDED instead of waiting forever.
MAX_REQUEST_LIFETIME_S = 600.0
TAG_BUDGET_S = 2.0             # tokenizing + tagging one prompt, off the event loop; past it: INVALID_ARGUMENT
TAG_WORKERS = 1                # processes that tokenize and tag large requests: at most one core of CPU goes to
                               # the front door, the rest to serving (services/admission/front_work.py)
TAG_INLINE_BYTES = 1024        # requests up to this size are tagged at once on the loop (< 1 ms): no queue
# The tag workers' queue (front_work.py): waiting jobs are taken one tenant at a time; waiting is overload
# (RESOURCE_EXHAUSTED + RetryInfo), never the prompt's fault, and never counted in TAG_BUDGET_S.
TAG_QUEUE_PER_TENANT = 4       # jobs one tenant may have waiting; past it, its next one is refused at once
TAG_QUEUE_MAX = 64             # jobs waiting in all
TAG_QUEUE_WAIT_S = 2.0         # a job not started by then is refused (RESOURCE_EXHAUSTED)
# Fair share of the concurrency cap (services/admission/limits.py ConcurrencyShares): once more than this share
# of the cap is in flight, each tenant wanting slots may hold at most an equal part of the cap.
FAIR_SHARE_CONTENDED = 0.5
FAIR_SHARE_WINDOW_S = 5.0      # a tenant refused a slot still counts as wanting one for this long

# Coordinator batching.
MAX_BATCH_SLOTS = 32        # requests per micro-batch
MAX_BATCH_TOKENS = 512      # rows per micro-batch; longer prompts are prefilled in chunks of what fits
# While at most this many requests are active, and every stage runs a micro-batch alone on more threads than
# under load (its handshake says so), the coordinator keeps ONE micro-batch in flight instead of one per stage:
# each stage then runs it on every core while the others wait. On 2 shared cores a step's linears are bound by
# memory, so 8 rows on 2 threads cost less than 4 rows on 1 (smollm2 bf16, AMD EPYC, served at 8 streams: 1.19x
# the output tokens/s, 16: 1.10x, 32: 1.03x); with fp32 on our kernels there, 32 streams alone gave 1.10x what two
# micro-batches of 16 did (docs/PERFORMANCE.md). 0: always one micro-batch per stage.
ALONE_MAX_REQUESTS = 32
# The same where the stages multiply 8-bit inputs (--linear-inputs q8, StageInfo.linear_inputs): one micro-batch
# alone still wins at 8 streams, two micro-batches at 32. smollm2, Intel Xeon with AMX, one cluster at a time
# (two kept up, sent to alternately; 4 pairs each): q8 alone 1.10-1.15x two micro-batches' output tokens/s at 8
# streams, two 1.06-1.15x alone at 32; float32 alone 1.00-1.10x at 8, even at 32 (0.97-1.05). Two clusters
# loaded side by side mislead here (their 4 stages share 2 cores, so a stage idling in one leaves its core to the
# other cluster): that way two micro-batches had looked 1.11x (q8, AMD EPYC) and 1.11-1.15x (float32) ahead at 8.
ALONE_MAX_REQUESTS_Q8 = 16
FRAME_TIMEOUT_S = 30.0      # a micro-batch unanswered this long is lost: its requests are synced and resumed
RECONNECT_INTERVAL_S = 1.0  # how often a coordinator retries the handshake of a broken pipeline
PEER_RECONNECT_BACKOFF_MAX_S = 2.0   # the longest a service-to-service channel waits between connection attempts
RECOVERY_WINDOW_S = 30.0    # in-flight requests wait this long for a broken pipeline to come back, then fail
MAX_REBUILDS = 5            # rebuilds + resumes of one request's state before it fails with ABORTED
# Admission continues a request a pipeline dropped (its Session broke, UNAVAILABLE, handed back while draining)
# on another pipeline after the tokens already passed on (docs/PROTOCOL.md "Resume"): at most this many times
# per request, each time waiting at most ADMISSION_RESUME_WAIT_S (and never past its deadline) for a pipeline.
ADMISSION_RESUME_HOPS = 4
ADMISSION_RESUME_WAIT_S = RECOVERY_WINDOW_S
DRAIN_S = 10.0                  # a draining coordinator (SIGTERM, Drain) lets its requests finish this long, then hands
                                # the rest back to admission to continue elsewhere, then exits
ADMISSION_RESUME_POLL_S = 0.2   # how often a dropped request asks the router again while no pipeline takes it
PRIORITY_AGING_STEPS = 100  # engine steps a waiting request waits to rise one priority class: nothing starves
RESERVE_KV_OUTPUT_TOKENS = 256   # a request with at least this output budget holds KV for all of it from the
                                 # start: it is never preempted for room it was always going to need

# Stage workers.
# A stage's KV pool, over all requests, in memory: the pool in positions follows from the slice's layers,
# KV heads, head size and dtype (--kv-capacity overrides it in positions). The prefix cache keeps freed
# blocks until the pool needs them, so a busy stage grows to this budget and stays there.
KV_MEMORY_MIB = 1024
MAX_FRAME_BYTES = 64 * 1024 * 1024
KV_LEASE_S = 300.0             # state idle longer than this is freed (a lost Release leaks nothing)

# Numerics every service, the reference and the benches default to (--dtype): "auto" is float32 on our own C
# kernels, whole layers in one call, where the machine builds them (tether/model/native.py); else bfloat16 where
# the CPU computes it natively and a start-up probe finds its kernels invariant unpadded; else float32 padded
# (tether/model/numerics.py). A pipeline's stages must all choose the same (the handshake refuses a mix).
# bf16 runs unpadded but on at least the probe's floor of rows (2 on smollm2: a 1-row down_proj has other bits;
# docs/PERFORMANCE.md, "Numerics per machine").
DTYPE = "auto"
# --linear-inputs (dtypes.LINEAR_INPUTS): "q8" rounds the linears' inputs to 8 bits, llama.cpp's arithmetic
LINEAR_INPUTS = "float32"

# The environment `tether up` (and the Dockerfile) gives its services, where the operator's does not say otherwise.
# OpenMP's waits: passive (no spinning) where the runtime is not GNU's, so that
# idle threads never starve the other services on the same cores; GNU libgomp's (torch's) threads spin this many
# turns (~0.1 ms by its own estimate) before sleeping: a step alone in the pipeline runs on every thread
# (`frames_in_flight`), and with no spin each of its ~200 parallel regions paid a futex wake (smollm2's 1-row step
# on 2 threads: 54 ms passive, 33 spinning 10,000 turns, 38 on 1 thread; an idle gap cost no measurable CPU).
# gRPC core's log threshold: its default prints INFO lines such as "Got goaway ... connection idle" each time a
# peer closes a connection idle for MAX_CONNECTION_IDLE_S (routine, not a fault); errors still print. Read when
# gRPC is imported, so it must be in the environment a service starts with.
SERVICE_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000", "GRPC_VERBOSITY": "ERROR"}

# Batch invariance (docs/ARCHITECTURE.md): a request's logits are bitwise independent of its batch
# neighbours, its prompt chunking and the pipeline split; always on (the plain kernels of
# tether/model/plain.py are a benchmark baseline only).
ATTENTION_BLOCK = 64           # positions per paged-KV block, and per attention tile and key block
# What a byte of the LM head's weight costs the last stage against a byte of a decoder layer's (`--layers
# I/N` splits a model so that its slowest stage is fastest: tether/model/config.py balanced_split). smollm2
# bf16, 1 thread, AMD EPYC: the head took 3.0-4.0 layers' time at 1-8 rows for 8.0 layers' bytes (sampling 4
# rows another 2.7, not counted): 30 layers split 17 + 13, not 15 + 15.
HEAD_COST_PER_LAYER_BYTE = 0.5

# gRPC message size per service: each server accepts what its own contract needs, no more. Stages carry
# activation frames; the coordinator takes token ids (MAX_PROMPT_TOKENS x <= 5 bytes) and small control
# messages; admission takes a prompt of at most MAX_PROMPT_BYTES plus its other fields.
GRPC_MAX_MESSAGE_BYTES = MAX_FRAME_BYTES + 1024 * 1024   # stages (and channels to them)
COORDINATOR_MAX_MESSAGE_BYTES = 1024 * 1024
ADMISSION_MAX_MESSAGE_BYTES = MAX_PROMPT_BYTES + 64 * 1024

# Connection management on every server: pings find dead peers in seconds; idle connections are closed.
# Admission (public) also ages connections out so clients rebalance; its grace lets a request run out its
# lifetime. Internal servers never age connections: their Forward streams are meant to live.
SERVER_KEEPALIVE_S = 20.0
SERVER_KEEPALIVE_TIMEOUT_S = 10.0
MAX_CONNECTION_IDLE_S = 300.0
ADMISSION_MAX_CONNECTION_AGE_S = 1800.0

# Where generated preset models live (override with TETHER_HOME).
TETHER_HOME_ENV = "TETHER_HOME"
PROBE_CACHE_ENV = "TETHER_PROBE_CACHE"   # "0": run the numerics probe in every process (tether/model/probe_cache.py)
NATIVE_KERNELS_ENV = "TETHER_NATIVE_KERNELS"   # "0": never build or use our C kernels (tether/model/native.py)
# "avx2": our C kernels keep to AVX2 where the CPU has AVX-512 (the same bits by construction): an AVX2-only CPU's
# kernels measured on this one (bench/llama_server_vs_tether.py --isa avx2); "native" (or unset): what cpuid finds
KERNELS_ISA_ENV = "TETHER_KERNELS_ISA"
KERNELS_ISAS = ("native", "avx2")
# "1": a LocalCluster forks its services from fork servers that imported torch (stages) or gRPC and telemetry
# (coordinator, admission) once (tether/forkserver/), not a fresh interpreter each; the tests set it (a stage's
# start saves ~5 CPU-s of import on a 2-core AMD EPYC without AVX-512).
FORK_SERVER_ENV = "TETHER_FORK_SERVER"
# "0": a stage's KV pool is not made resident at start (--no-kv-prefault's default; the tests set it: they start
# ~120 stages, each ~0.4 s of page faults a GiB, and none soaks)
KV_PREFAULT_ENV = "TETHER_KV_PREFAULT"


def kv_prefault() -> bool:
    """--kv-prefault's default: on unless $TETHER_KV_PREFAULT is "0"."""
    return os.environ.get(KV_PREFAULT_ENV, "1") != "0"


# Hostile input on the stage protocol (docs/PROTOCOL.md): a stage serves at most this many Forward streams at
# once (RESOURCE_EXHAUSTED beyond) and closes a stream with no frame in and no reply out for STREAM_IDLE_S
# (DEADLINE_EXCEEDED). A coordinator whose pipeline sits idle longer sees its stream closed and reopens it.
MAX_FORWARD_STREAMS = 16      # over all peers
MAX_STREAMS_PER_PEER = 8      # from one peer address (advertised at handshake)
STREAM_IDLE_S = 60.0
# What one frame may ask of a stage: advertised at handshake, enforced by the stage itself (BAD_FRAME beyond).
STAGE_MAX_FRAME_ROWS = 1024   # >= the coordinator's MAX_BATCH_TOKENS
STAGE_MAX_FRAME_SLOTS = 64    # >= the coordinator's MAX_BATCH_SLOTS
RELAY_PENDING_MAX = 1024      # frames a stage remembers waiting for downstream replies, per stream

# Supervised loops (tether/supervise.py): an unexpected error restarts the loop after this pause.
LOOP_RESTART_S = 1.0

# Fault injection (tether/faults/): off unless a spec is given by --faults or this environment variable.
FAULTS_ENV = "TETHER_FAULTS"

# Supervision (`tether up`): a child that dies is restarted with the same command and ports after an
# exponential backoff (base doubling to the cap), reset once it has stayed up SUPERVISE_STABLE_S. More than
# SUPERVISE_MAX_RESTARTS crashes of one child within SUPERVISE_WINDOW_S: the launcher gives up and stops all.
SUPERVISE_BACKOFF_BASE_S = 0.5
SUPERVISE_BACKOFF_CAP_S = 10.0
SUPERVISE_STABLE_S = 30.0
SUPERVISE_MAX_RESTARTS = 5
SUPERVISE_WINDOW_S = 60.0

# Telemetry (tether/telemetry/). Every service serves Prometheus metrics on --metrics-port (0: off, the
# default). These are the ports `tether up --metrics`, docker-compose.yml and deploy/k8s use: the gRPC port's
# last digits on 9xxx (admission 50051 -> 9051, coordinator 50061 -> 9061, stage i 50071+i -> 9071+i).
ADMISSION_METRICS_PORT = 9051
COORDINATOR_METRICS_PORT = 9061
STAGE_METRICS_BASE_PORT = 9071
# Tenants are a label of admission's per-tenant counter; past this many distinct tenants in one process the
# rest are counted under "_other", so a client inventing tenant names cannot grow the metrics without bound.
METRICS_MAX_TENANTS = 64
METRICS_PORT = 0                 # a service's --metrics-port when not given: off
# --metrics-host: /metrics shows load, tenants and pipelines, so it binds loopback unless a deployment whose
# Prometheus scrapes over the network says otherwise (docker-compose.yml and deploy/k8s bind 0.0.0.0 and
# restrict the port: no published port, a NetworkPolicy).
METRICS_HOST = "127.0.0.1"
# A scrape never reaches a service's serving state more than once per this many seconds, however many
# scrapers ask (the stage's Stats runs on its model thread): collectors serve a snapshot at most this old.
METRICS_SNAPSHOT_MAX_AGE_S = 1.0
# /metrics is served by at most this many threads; a connection beyond them is answered 503 at once, and
# one that sends nothing is closed after the timeout, so a scrape flood holds a bounded number of threads.
METRICS_HTTP_WORKERS = 4
METRICS_HTTP_TIMEOUT_S = 5.0
LOG_FORMATS = ("text", "json")   # --log-format: json is one object per line (tether/telemetry/logs.py)
LOG_FORMAT = "text"

# Transport security (tether/security/, docs/PROTOCOL.md "Transport security"). Every service takes --tls-ca,
# --tls-cert and --tls-key (defaults from these environment variables; never gRPC's GRPC_DEFAULT_SSL_ROOTS_FILE_PATH,
# usually the public roots). Without a certificate a service speaks plaintext and says so once at start.
TLS_CA_ENV = "TETHER_TLS_CA"
TLS_CERT_ENV = "TETHER_TLS_CERT"
TLS_KEY_ENV = "TETHER_TLS_KEY"
TLS_TRUST_DOMAIN = "tether.local"   # identities are spiffe://tether.local/<role>[/<name>] URI SANs
# A service's certificate also carries the DNS name <role>[-<name>].id.tether.local, and no other certificate
# does: every channel between services verifies the server under the name of the role it expects (SECURITY.md).
TLS_SERVER_NAME_DOMAIN = f"id.{TLS_TRUST_DOMAIN}"
TLS_CA_DAYS = 3650                  # `tether certs init`: the local CA's lifetime
TLS_CERT_DAYS = 365                 # and each service certificate's
TLS_CLIENT_AUTH = ("none", "require")   # admission's --tls-client-auth (internal services always require)
