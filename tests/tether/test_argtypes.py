"""tether/argtypes.py: the shared argparse value types."""

import argparse

import pytest

from tether.argtypes import positive_int


def test_positive_int_takes_one_and_more():
    assert positive_int("1") == 1
    assert positive_int("32") == 32


@pytest.mark.parametrize("text", ["0", "-3"])
def test_positive_int_refuses_less_than_one_in_words(text):
    with pytest.raises(argparse.ArgumentTypeError, match=f"must be at least 1; got {text}"):
        positive_int(text)


def test_positive_int_is_a_usage_error_on_the_command_line(capsys):
    p = argparse.ArgumentParser(prog="x")
    p.add_argument("--n", type=positive_int)
    with pytest.raises(SystemExit):
        p.parse_args(["--n", "0"])
    assert "argument --n: must be at least 1; got 0" in capsys.readouterr().err
