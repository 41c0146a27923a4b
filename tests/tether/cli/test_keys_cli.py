"""`tether keys`: a fresh key and the tenants-file lines that admit it (and nothing else), its digest on demand."""

import io
import tomllib

import pytest

from services.admission.auth import ApiKeys, Principal, key_digest
from tether.cli import keys


def run(capsys, *argv: str) -> tuple[str, str]:
    keys.main(list(argv))
    out = capsys.readouterr()
    return out.out, out.err


def test_new_prints_a_key_and_the_toml_that_admits_it(capsys):
    out, _ = run(capsys, "new", "--tenant", "acme")
    lines = out.splitlines()
    key = lines[1]
    assert key.startswith("tk_") and len(key) >= 3 + 43                   # 32 random bytes, url-safe base64
    data = tomllib.loads("\n".join(lines[2:]))
    assert data["tenants"]["acme"]["api_keys_sha256"] == [key_digest(key)]
    got = ApiKeys.from_config(data).authenticate([("authorization", f"Bearer {key}")])
    assert got == Principal("acme", ("standard", "sheddable"))
    again, _ = run(capsys, "new", "--tenant", "acme")
    assert again.splitlines()[1] != key                                     # fresh every time


def test_priorities_and_dotted_names(capsys):
    out, err = run(capsys, "new", "--tenant", "acme.eu", "--priorities", "sheddable,critical", "--quiet")
    key, digest = out.strip(), err.strip()
    assert digest == key_digest(key)
    text = keys.toml_lines("acme.eu", digest, ["critical", "sheddable"])
    data = tomllib.loads(text)
    assert ApiKeys.from_config(data).by_digest[digest] == Principal("acme.eu", ("critical", "sheddable"))


def test_hash_reads_the_key_from_stdin(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("tk_some-key\n"))
    out, _ = run(capsys, "hash")
    assert out.strip() == key_digest("tk_some-key")


@pytest.mark.parametrize("argv", [["new"], ["new", "--tenant", "a b"], ["new", "--tenant", "x", "--priorities", "vip"],
                                  []])
def test_bad_usage_exits_with_a_message(argv, capsys):
    with pytest.raises(SystemExit):
        keys.main(argv)
