"""tether/model/native.py: what the kernels' build takes in."""

from __future__ import annotations

from tether.model import native


def test_every_kernel_source_and_header_is_built_and_keys_the_build():
    """A C file in kernels/ left out of SOURCES would never be compiled (its functions missing at load), and a
    header left out of HEADERS would not rebuild the library when edited."""
    assert sorted(p.name for p in native.SOURCES) == sorted(p.name for p in native.KERNELS.glob("*.c"))
    assert sorted(p.name for p in native.HEADERS) == sorted(p.name for p in native.KERNELS.glob("*.h"))
