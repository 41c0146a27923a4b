"""`tether keys`: make API keys for tenants, and the tenants-file lines that let them in.

Admission stores no key, only its SHA-256 (services/admission/auth.py says why a plain hash is right for
random keys). `tether keys new --tenant acme` prints a fresh key once, for the tenant, and the TOML to add to
admission's `--tenants FILE`; `tether keys hash` prints the digest of an existing key read from stdin.
"""

from __future__ import annotations

import argparse
import re
import secrets
import sys

from tether import settings
from tether.priority import PRIORITIES

KEY_PREFIX = "tk_"      # recognisable in a leaked file or a secret scanner's rules
KEY_BYTES = 32          # 256 random bits: no guessing, no brute force of its hash
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")   # a TOML bare key; a dotted tenant name must be quoted


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(KEY_BYTES)


def toml_lines(tenant: str, digest: str, priorities: list[str] | None) -> str:
    """The [tenants.NAME] table that admits a key of `tenant`."""
    name = tenant if _BARE_KEY.fullmatch(tenant) else f'"{tenant}"'
    lines = [f"[tenants.{name}]", f'api_keys_sha256 = ["{digest}"]']
    if priorities:
        lines.append("priorities = [" + ", ".join(f'"{p}"' for p in priorities) + "]")
    return "\n".join(lines)


def _tenant(text: str) -> str:
    if not 1 <= len(text) <= settings.MAX_TENANT_CHARS or not re.fullmatch(r"[A-Za-z0-9_.-]+", text):
        raise argparse.ArgumentTypeError(f"a tenant is 1 to {settings.MAX_TENANT_CHARS} characters of "
                                         f"[A-Za-z0-9_.-]; got {text!r}")
    return text


def _priorities(text: str) -> list[str]:
    values = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in values if p not in PRIORITIES]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"a comma-separated list of {', '.join(PRIORITIES)}; got {text!r}")
    return [p for p in PRIORITIES if p in values]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tether keys", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="API keys for admission. Once any key is listed in admission's --tenants FILE, every call "
                    "needs 'authorization: Bearer <key>' (SDK: api_key= or $TETHER_API_KEY; CLI: --api-key) and "
                    "runs as the key's tenant, with the priorities that tenant may use.",
        epilog="examples:\n"
               "  tether keys new --tenant acme                 # a key and its [tenants.acme] lines\n"
               "  tether keys new --tenant ops --priorities critical,standard,sheddable\n"
               "  tether keys hash < key.txt                    # the digest of an existing key")
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    new = sub.add_parser("new", help="print a fresh key and the tenants-file lines that admit it",
                         description="Print a fresh random key (shown once: hand it to the tenant; admission keeps "
                                     "only its SHA-256) and the TOML for admission's --tenants FILE. Several keys "
                                     "of one tenant (e.g. while rotating) go in the same api_keys_sha256 list.")
    new.add_argument("--tenant", required=True, type=_tenant, help="the tenant the key acts as")
    new.add_argument("--priorities", type=_priorities, default=None, metavar="P,P",
                     help="priorities the tenant may use, of critical, standard, sheddable (default in admission: "
                          "standard,sheddable; critical only when listed)")
    new.add_argument("--quiet", action="store_true", help="print only the key (the digest to stderr)")
    sub.add_parser("hash", help="print the SHA-256 of a key read from stdin (what the tenants file stores)",
                   description="Read one key from stdin (so it stays out of the shell's history) and print the "
                               "hex SHA-256 that api_keys_sha256 lists.")
    return p


def main(argv: list[str] | None = None) -> None:
    from services.admission.auth import key_digest
    args = build_parser().parse_args(argv)
    if args.action == "hash":
        key = sys.stdin.readline().strip()
        if not key or any(c.isspace() for c in key):
            raise SystemExit("tether keys hash: give one key (a single word) on stdin")
        print(key_digest(key))
        return
    key = new_key()
    digest = key_digest(key)
    if args.quiet:
        print(key)
        print(digest, file=sys.stderr)
        return
    print(f"# API key of tenant {args.tenant}: shown only now; give it to the tenant (TETHER_API_KEY) and keep no copy")
    print(key)
    print(f"# add to admission's --tenants FILE (merge into an existing [tenants.{args.tenant}] table) and restart it:")
    print(toml_lines(args.tenant, digest, args.priorities))
