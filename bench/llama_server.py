"""llama.cpp's own C++ `llama-server`, built from the llama.cpp source vendored in the pinned llama-cpp-python
sdist, cached under the tether home, and run on a GGUF for a comparison (bench/llama_server_vs_tether.py).

Never a runtime dependency of tether: it needs cmake and a C/C++ compiler, and the build (ggml, llama, the
server) takes a while on a small machine; without them it says why and exits with SKIP (77, automake's
"skipped"). The binary is cached as <tether home>/llama-server/<version>-<key>/llama-server, where the key is a
short hash of the CPU flags ggml's native build depends on (GGML_NATIVE=ON: -march=native) and of the cmake
options, so a second run reuses it and a different CPU (or option) builds its own.

    .venv/bin/python bench/llama_server.py build            # build (or find) the binary; print its path
    .venv/bin/python bench/llama_server.py serve --np 8     # start it on smollm2's GGUF; Ctrl-C stops it

From other code: `with LlamaServer(binary, gguf, threads=2, parallel=8) as s:` the server is up at s.base_url
(/health answered 200); stopped (SIGTERM, then SIGKILL) on the way out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path

from tether import settings
from tether.model.numerics import cpu_flags
from tether.model.presets import tether_home
from tether.loadtest.server_process import ServerProcess

VERSION = "0.3.36"                       # llama-cpp-python, whose sdist vendors llama.cpp
PACKAGE = f"llama-cpp-python=={VERSION}"
SKIP = 77                                # exit status of a run that cannot build (no cmake, no compiler)

# What GGML_NATIVE=ON's -march=native (and ggml's own CPU feature checks) change with: x86 SIMD and its
# extensions, aarch64's SIMD/dot-product/matrix flags. Other flags (hypervisor, rdrand, ...) do not change the
# binary, so they stay out of the key.
RELEVANT_FLAG = re.compile(r"^(sse\d?\w*|ssse3|avx\w*|amx\w*|fma\w*|f16c|bmi\d|popcnt|movbe|gfni|vaes|vpclmulqdq|"
                           r"sha_ni|asimd\w*|neon|sve\w*|i8mm|bf16|fphp|dotprod|sme\d*)$")

# cmake options: the server alone, native code, no network at configure or build time (no curl/openssl, no
# web UI download from Hugging Face, no npm), one static binary (so the cached copy needs no build folder).
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",              # the brief's flag; this llama.cpp replaced curl with LLAMA_OPENSSL
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
)

# What each instruction-set choice builds: "native" is -march=native; "avx2" keeps ggml to AVX2 / FMA / F16C on
# a CPU that has more (an AVX2-only CPU's llama-server measured on this one, beside tether's kernels kept to AVX2).
ISAS = settings.KERNELS_ISAS
AVX2_OPTIONS = ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
                "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF")
# A native build on a CPU with AMX compiles ggml's AMX matmul, which segfaulted in its first product
# (ggml_backend_amx_mul_mat, during llama-server's warm-up) on the AMX Xeon measured (family 6 model 167,
# 2026-12-06; AMX itself works there: a tile product in C gives the right sums), as llama.cpp#20824 reports on
# other machines (closed stale, no fix). What runs there is llama-server without it: -march=native less AMX (an
# explicit -mno-* wins over -march's defaults in GCC and Clang, wherever it stands on the command line).
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
NO_AMX_OPTIONS = (f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}")


def cmake_options(isa: str = "native", flags: Iterable[str] | None = None) -> tuple[str, ...]:
    """CMAKE_OPTIONS for an instruction-set choice (ISAS) on a CPU with these /proc/cpuinfo flags (None: this
    one's)."""
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {', '.join(ISAS)}; got {isa!r}")
    if isa == "native":
        amx = "amx_int8" in (cpu_flags() if flags is None else set(flags))
        return CMAKE_OPTIONS + NO_AMX_OPTIONS if amx else CMAKE_OPTIONS
    return tuple(o for o in CMAKE_OPTIONS if not o.startswith("-DGGML_NATIVE=")) + AVX2_OPTIONS


class Unavailable(RuntimeError):
    """llama-server cannot be built or run here; the message says why."""


def relevant_flags(flags: Iterable[str]) -> list[str]:
    """The flags a native build depends on, sorted."""
    return sorted(f for f in set(flags) if RELEVANT_FLAG.match(f))


def cache_key(flags: Iterable[str], options: Iterable[str] = CMAKE_OPTIONS, version: str = VERSION) -> str:
    """'<version>-<12 hex>': the hash covers the relevant CPU flags and the cmake options (order-free for the
    flags, ordered for the options, as cmake reads them)."""
    text = json.dumps({"flags": relevant_flags(flags), "options": list(options)}, sort_keys=True)
    return f"{version}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def binary_path(flags: Iterable[str] | None = None, home: Path | None = None, isa: str = "native") -> Path:
    """Where the binary for this CPU (and instruction-set choice) is (or will be) cached."""
    flags = cpu_flags() if flags is None else list(flags)
    key = cache_key(flags, cmake_options(isa, flags))
    return (home or tether_home()) / "llama-server" / key / "llama-server"


def missing_tools() -> str:
    """Why the build cannot run here ("" when it can)."""
    missing = [name for name, found in (("cmake", shutil.which("cmake")),
                                        ("a C compiler (cc/gcc/clang)", os.environ.get("CC") or shutil.which("cc")
                                         or shutil.which("gcc") or shutil.which("clang")),
                                        ("a C++ compiler (c++/g++/clang++)", os.environ.get("CXX")
                                         or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")))
               if not found]
    return f"missing {', '.join(missing)} to build llama-server" if missing else ""


def configure_command(source: Path, build: Path, generator: str | None, isa: str = "native") -> list[str]:
    return ["cmake", "-S", str(source), "-B", str(build), *(["-G", generator] if generator else []),
            *cmake_options(isa)]


def build_command(build: Path, jobs: int) -> list[str]:
    return ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)]


def _run(cmd: list[str], log, cwd: Path | None = None) -> None:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    done = subprocess.run(["nice", "-n", "10", *cmd] if shutil.which("nice") else cmd, cwd=cwd, stdout=log,
                          stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise Unavailable(f"{' '.join(cmd[:3])} ... failed with status {done.returncode} (log: {log.name})")


def build(jobs: int = 2, python: str = sys.executable, quiet: bool = False, isa: str = "native") -> Path:
    """The cached llama-server for this CPU and `isa` (ISAS), built now if absent: the pinned sdist downloaded
    with pip (a source archive only, never built by pip), unpacked, llama.cpp configured and built. Raises
    Unavailable."""
    path = binary_path(isa=isa)
    if path.is_file() and os.access(path, os.X_OK):
        return path
    why = missing_tools()
    if why:
        raise Unavailable(why)
    path.parent.mkdir(parents=True, exist_ok=True)
    log_path = path.parent / "build.log"
    say = (lambda m: None) if quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".build-") as tmp, open(log_path, "w") as log:
        tmp_dir = Path(tmp)
        say(f"llama-server: downloading the {PACKAGE} sdist (log: {log_path}) ...")
        _run([python, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", PACKAGE, "-d", str(tmp_dir)], log)
        archive = next(tmp_dir.glob("llama_cpp_python-*.tar.gz"), None)
        if archive is None:
            raise Unavailable(f"pip download left no llama_cpp_python sdist in {tmp_dir}")
        with tarfile.open(archive) as tar:
            tar.extractall(tmp_dir, filter="data")
        source = tmp_dir / archive.name.removesuffix(".tar.gz") / "vendor" / "llama.cpp"
        if not (source / "CMakeLists.txt").is_file():
            raise Unavailable(f"the sdist has no vendor/llama.cpp ({source})")
        out = tmp_dir / "build"
        generator = "Ninja" if shutil.which("ninja") else None
        say(f"llama-server: configuring llama.cpp ({' '.join(cmake_options(isa))}) ...")
        _run(configure_command(source, out, generator, isa), log)
        say(f"llama-server: building with {jobs} job(s); this takes a while ...")
        t0 = time.monotonic()
        _run(build_command(out, jobs), log)
        built = out / "bin" / "llama-server"
        if not built.is_file():
            raise Unavailable(f"the build produced no {built}")
        staged = path.parent / ".llama-server.tmp"
        shutil.copy2(built, staged)
        os.replace(staged, path)   # atomic: a reader sees no binary or a whole one
        (path.parent / "flags.txt").write_text(" ".join(relevant_flags(cpu_flags())) + "\n")
        say(f"llama-server: built in {time.monotonic() - t0:.0f} s: {path}")
    return path


# --- running it -------------------------------------------------------------------------------------------

def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_command(binary: Path, gguf: Path, threads: int, parallel: int, port: int, ctx_per_slot: int = 1024,
                   host: str = "127.0.0.1", extra: tuple[str, ...] = ()) -> list[str]:
    """llama-server on `gguf`: `threads` threads for prompts and decode alike (-t, -tb), `parallel` slots (-np,
    one per concurrent request), continuous batching (-cb), a context of `ctx_per_slot` tokens per slot (-c is
    the total, split among the slots), on host:port. --no-webui: nothing but the API. Everything else is
    llama-server's default (flash attention auto, batch 2048 / ubatch 512, prompt cache on)."""
    return [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-np", str(parallel), "-cb",
            "-c", str(ctx_per_slot * parallel), "--host", host, "--port", str(port), "--no-webui", *extra]


def system_info(log_text: str) -> str:
    """llama-server's 'system_info: ...' line (its CPU features and thread counts), "" when not logged."""
    for line in log_text.splitlines():
        if "system_info:" in line:
            return line[line.index("system_info:") + len("system_info:"):].strip()
    return ""


TRACE = ("-lv", "4")   # llama.cpp logs its system_info (CPU features built in and used) at trace verbosity


def probe_system_info(binary: Path, gguf: Path, threads: int, log_path: Path) -> str:
    """llama-server's system_info on `threads` threads: started once at trace verbosity, no request sent, then
    stopped (the measured servers run at the default verbosity)."""
    with LlamaServer(binary, gguf, threads, 1, log_path, extra=TRACE) as server:
        return server.system_info()


def die_with_parent() -> list[str]:
    """A prefix that makes the server get SIGTERM when the process that started it dies, even by SIGKILL (Linux
    PR_SET_PDEATHSIG through util-linux's setpriv, which then execs the server: same pid); [] without setpriv."""
    return ["setpriv", "--pdeathsig", "TERM", "--"] if shutil.which("setpriv") else []


class LlamaServer(ServerProcess):
    """`with LlamaServer(binary, gguf, threads, parallel, log_path) as s:` llama-server up at s.base_url."""

    name = "llama-server"
    stop_grace_s = 15.0
    popen_options = {"start_new_session": True}

    def __init__(self, binary: Path, gguf: Path, threads: int, parallel: int, log_path: Path,
                 ctx_per_slot: int = 1024, timeout_s: float = 120.0, extra: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.command = server_command(binary, gguf, threads, parallel, self.port, ctx_per_slot, extra=extra)
        self.log_path, self.timeout_s = log_path, timeout_s
        self.root = f"http://127.0.0.1:{self.port}"
        self.base_url = self.root + "/v1"

    def launch_command(self) -> list[str]:
        return [*die_with_parent(), *self.command]

    def ready(self) -> bool:
        """/health answers 200 (503 while the model loads)."""
        with urllib.request.urlopen(f"{self.root}/health", timeout=2) as r:
            return r.status == 200

    def system_info(self) -> str:
        return system_info(self.log_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build (or find) the cached binary and print its path")
    s = sub.add_parser("serve", help="start llama-server on smollm2's GGUF until Ctrl-C")
    for q in (b, s):
        q.add_argument("--jobs", type=int, default=2)
        q.add_argument("--isa", choices=ISAS, default="native",
                       help="native: -march=native; avx2: ggml kept to AVX2/FMA/F16C (default: %(default)s)")
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--np", type=int, default=1, help="parallel slots")
    s.add_argument("--gguf", type=Path, default=None, help="default: smollm2's (tether/model/smollm2.py)")
    args = p.parse_args()
    try:
        binary = build(args.jobs, isa=args.isa)
    except Unavailable as e:
        print(f"llama_server: skipped: {e}", file=sys.stderr)
        sys.exit(SKIP)
    if args.cmd == "build":
        print(binary)
        return
    gguf = args.gguf
    if gguf is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tether.model import smollm2
        gguf = smollm2.gguf_file()
    with tempfile.TemporaryDirectory() as tmp, \
            LlamaServer(binary, gguf, args.threads, args.np, Path(tmp) / "llama-server.log", extra=TRACE) as server:
        print(f"llama-server at {server.base_url} ({server.system_info()}); Ctrl-C stops it", flush=True)
        try:
            while server.proc and server.proc.poll() is None:
                time.sleep(1)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
