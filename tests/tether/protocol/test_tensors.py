"""Activation tensors on the wire: exact round trip and strict validation."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.protocol.tensors import WIRE_DTYPES, BadTensor, decode, encode
from tether.v1 import stage_pb2

FAST = settings(max_examples=300, deadline=None, database=None)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("rows,width", [(1, 8), (5, 64), (0, 16), (33, 3)])
def test_round_trip_is_bit_exact(dtype, rows, width):
    t = (torch.randn(rows, width, generator=torch.Generator().manual_seed(rows * 100 + width)) * 10).to(
        WIRE_DTYPES[dtype])
    msg = encode(t)
    assert msg.dtype == dtype and list(msg.shape) == [rows, width]
    assert len(msg.data) == t.numel() * t.element_size()
    wire = stage_pb2.Tensor.FromString(msg.SerializeToString())   # through protobuf bytes too
    back = decode(wire, rows=rows, width=width, dtype=dtype)
    assert back.dtype == t.dtype and back.shape == (rows, width)
    assert torch.equal(back.view(torch.uint8) if rows else back, t.view(torch.uint8) if rows else t)


def test_encode_is_little_endian_row_major():
    t = torch.tensor([[1.0, 2.0], [3.0, -0.5]])
    assert encode(t).data == b"".join(struct.pack("<f", v) for v in (1.0, 2.0, 3.0, -0.5))
    # a non-contiguous view is sent as its logical (row-major) values
    tt = t.t()
    assert not tt.is_contiguous()
    assert torch.equal(decode(encode(tt), rows=2, width=2, dtype="float32"), tt)


def test_decoded_tensor_does_not_alias_the_message():
    t = torch.ones(2, 4)
    msg = encode(t)
    back = decode(msg, rows=2, width=4, dtype="float32")
    back.add_(1)
    assert torch.equal(decode(msg, rows=2, width=4, dtype="float32"), t)


def test_encode_refuses_other_dtypes():
    with pytest.raises(ValueError, match="cannot go on the wire"):
        encode(torch.ones(2, 2, dtype=torch.int64))


@pytest.mark.parametrize("msg,match", [
    (stage_pb2.Tensor(dtype="bfloat16", shape=[3, 4], data=b"\0" * 24), "dtype 'bfloat16', expected 'float32'"),
    (stage_pb2.Tensor(dtype="", shape=[3, 4], data=b"\0" * 48), "dtype '', expected"),
    (stage_pb2.Tensor(dtype="int32", shape=[3, 4], data=b"\0" * 48), "dtype 'int32'"),
    (stage_pb2.Tensor(dtype="float32", shape=[4, 3], data=b"\0" * 48), r"shape \[4, 3\], expected \[3, 4\]"),
    (stage_pb2.Tensor(dtype="float32", shape=[12], data=b"\0" * 48), r"shape \[12\]"),
    (stage_pb2.Tensor(dtype="float32", shape=[1, 3, 4], data=b"\0" * 48), r"shape \[1, 3, 4\]"),
    (stage_pb2.Tensor(dtype="float32", shape=[], data=b"\0" * 48), r"shape \[\]"),
    (stage_pb2.Tensor(dtype="float32", shape=[3, 4], data=b"\0" * 47), "47 bytes for shape"),
    (stage_pb2.Tensor(dtype="float32", shape=[3, 4], data=b"\0" * 49), "49 bytes"),
    (stage_pb2.Tensor(dtype="float32", shape=[3, 4], data=b""), "0 bytes"),
    (stage_pb2.Tensor(), "dtype ''"),
])
def test_malformed_tensors_raise_bad_tensor(msg, match):
    with pytest.raises(BadTensor, match=match):
        decode(msg, rows=3, width=4, dtype="float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_raise_bad_tensor(dtype, bad):
    t = torch.zeros(4, 8, dtype=WIRE_DTYPES[dtype])
    t[2, 5] = bad
    with pytest.raises(BadTensor, match="NaN or Inf"):
        decode(encode(t), rows=4, width=8, dtype=dtype)


def test_float16_overflow_bit_pattern_is_caught():
    raw = bytearray(encode(torch.zeros(1, 2, dtype=torch.float16)).data)
    raw[2:4] = (0x7C00).to_bytes(2, "little")     # +inf in float16
    with pytest.raises(BadTensor):
        decode(stage_pb2.Tensor(dtype="float16", shape=[1, 2], data=bytes(raw)), rows=1, width=2, dtype="float16")


def test_bad_tensor_is_a_value_error():
    assert issubclass(BadTensor, ValueError)


@given(dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
       claimed=st.sampled_from(["float32", "bfloat16", "float16", "", "int8"]),
       rows=st.integers(0, 6), width=st.integers(1, 6),
       shape=st.one_of(st.none(), st.lists(st.integers(0, 8), max_size=3)),
       data=st.binary(max_size=200))
@FAST
def test_decode_arbitrary_bytes_is_bad_tensor_or_finite(dtype, claimed, rows, width, shape, data):
    msg = stage_pb2.Tensor(dtype=claimed, shape=[rows, width] if shape is None else shape, data=data)
    try:
        t = decode(msg, rows=rows, width=width, dtype=dtype)
    except BadTensor:
        return
    assert claimed == dtype
    assert isinstance(t, torch.Tensor)
    assert t.dtype == WIRE_DTYPES[dtype] and t.shape == (rows, width)
    assert bool(torch.isfinite(t).all())
    assert t.numel() * t.element_size() == len(data)


@given(dtype=st.sampled_from(["float32", "bfloat16", "float16"]), rows=st.integers(1, 5), width=st.integers(1, 5),
       data=st.data())
@FAST
def test_decode_right_sized_random_bytes(dtype, rows, width, data):
    """With the right dtype, shape and size, decode fails only on non-finite values, else returns the bytes."""
    size = rows * width * torch.empty((), dtype=WIRE_DTYPES[dtype]).element_size()
    raw = data.draw(st.binary(min_size=size, max_size=size))
    ref = torch.frombuffer(bytearray(raw), dtype=WIRE_DTYPES[dtype]).view(rows, width)
    msg = stage_pb2.Tensor(dtype=dtype, shape=[rows, width], data=raw)
    if torch.isfinite(ref).all():
        t = decode(msg, rows=rows, width=width, dtype=dtype)
        assert bytes(t.contiguous().view(torch.uint8).numpy().tobytes()) == raw
    else:
        with pytest.raises(BadTensor):
            decode(msg, rows=rows, width=width, dtype=dtype)
