"""Who is calling: API keys mapped to tenants, and what each tenant may ask for (pure: no I/O, no gRPC server).

Keys live in the tenants file (`--tenants FILE`, the same TOML as the rate limits), stored as their SHA-256:

    [tenants.acme]
    api_keys_sha256 = ["9f86d081884c7d65...", "..."]   # `tether keys new --tenant acme` prints a key and its line
    priorities = ["critical", "standard", "sheddable"]  # default: ["standard", "sheddable"]

A caller sends `authorization: Bearer <key>` gRPC metadata. Once any key is configured, every call must carry
a known key: its tenant is the request's tenant (a request naming another one is PERMISSION_DENIED; an empty
one gets the key's), and its priority must be one the tenant may use ("" means standard). Without any key
configured admission trusts the request body's tenant, as before (and says so at start).

Plain SHA-256, not a password hash (bcrypt, scrypt, argon2): the keys are 256-bit random tokens, not
something a person chose, so a stolen file of hashes cannot be brute-forced whatever the hash's speed; a slow
hash would only cost every request its CPU. The lookup is by digest in a dict; its timing could at most tell
an attacker something about a digest, from which no key follows (the preimage is 256 random bits), so no
constant-time comparison is needed on this path.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from tether import settings
from tether.priority import PRIORITIES, Priority

AUTH_FIELDS = frozenset({"api_keys_sha256", "priorities"})   # keys of a [tenants.NAME] table read here
DEFAULT_PRIORITIES = (Priority.STANDARD, Priority.SHEDDABLE)   # critical jumps every queue: only for tenants that list it
BEARER = "bearer"
MAX_KEY_CHARS = 512                       # a key is ~46 characters; anything far longer is not one of ours
_HEX64 = re.compile(r"[0-9a-f]{64}")
_TENANT = re.compile(r"[A-Za-z0-9_.-]+")  # the request body's tenant rule (validate.py), non-empty
_KEY = re.compile(r"[\x21-\x7e]+")        # printable ASCII without spaces (RFC 6750 token68 and more)
HOW = "send gRPC metadata 'authorization: Bearer <key>' (SDK: api_key= or TETHER_API_KEY; CLI: --api-key)"


@dataclass(frozen=True)
class Principal:
    """An authenticated caller: the tenant its key belongs to and the priorities that tenant may use."""

    tenant: str
    priorities: tuple[Priority, ...]


@dataclass(frozen=True)
class AuthError:
    """A refusal: the gRPC status, a message for the caller (never the key), a metrics reason."""

    code: grpc.StatusCode
    message: str
    reason: str    # missing | malformed | unknown_key | tenant | priority


def key_digest(key: str) -> str:
    """The hex SHA-256 of a key as the tenants file stores it."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class ApiKeys:
    """Key digests -> principals. Empty (`active` False): nobody is authenticated, the body's tenant stands."""

    def __init__(self, principals: dict[str, Principal] | None = None) -> None:
        self.by_digest = dict(principals or {})

    @property
    def active(self) -> bool:
        return bool(self.by_digest)

    @classmethod
    def from_config(cls, data: dict, where: str = "tenants file") -> "ApiKeys":
        """The keys of a parsed tenants file (`limits.read_tenants_file`); ValueError names a bad entry."""
        defaults = data.get("defaults", {})
        if isinstance(defaults, dict) and AUTH_FIELDS & set(defaults):
            raise ValueError(f"{where} [defaults]: {sorted(AUTH_FIELDS & set(defaults))} belong in a "
                             f"[tenants.NAME] table: a key is one tenant's")
        by_digest: dict[str, Principal] = {}
        for name, section in data.get("tenants", {}).items():
            if not isinstance(section, dict) or not AUTH_FIELDS & set(section):
                continue     # not a table (limits.py says so) or a tenant with limits only
            at = f"{where} [tenants.{name}]"
            if "api_keys_sha256" not in section:
                raise ValueError(f"{at}: priorities without api_keys_sha256: a tenant's priorities are enforced "
                                 f"only for callers authenticated by one of its keys")
            if len(name) > settings.MAX_TENANT_CHARS or not _TENANT.fullmatch(name):
                raise ValueError(f"{at}: a tenant with keys must be named with 1 to {settings.MAX_TENANT_CHARS} "
                                 f"characters of [A-Za-z0-9_.-] (quote a dotted name: [tenants.\"a.b\"])")
            principal = Principal(name, _priorities(section.get("priorities", list(DEFAULT_PRIORITIES)), at))
            for digest in _digests(section["api_keys_sha256"], at):
                other = by_digest.get(digest)
                if other is not None:
                    raise ValueError(f"{at}: key digest {digest[:12]}... is also listed for tenant "
                                     f"{other.tenant!r}; a key belongs to one tenant")
                by_digest[digest] = principal
        return cls(by_digest)

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Principal | AuthError:
        """The principal of the call's `authorization: Bearer <key>` metadata, or why not."""
        values = [v for k, v in metadata or () if k.lower() == "authorization"]
        if not values:
            return AuthError(grpc.StatusCode.UNAUTHENTICATED, f"missing API key: {HOW}", "missing")
        if len(values) > 1:
            return AuthError(grpc.StatusCode.UNAUTHENTICATED,
                             f"{len(values)} authorization headers; send exactly one: {HOW}", "malformed")
        key = _bearer(values[0])
        if key is None:
            return AuthError(grpc.StatusCode.UNAUTHENTICATED,
                             f"the authorization metadata is not 'Bearer <key>': {HOW}", "malformed")
        principal = self.by_digest.get(key_digest(key))
        if principal is None:
            return AuthError(grpc.StatusCode.UNAUTHENTICATED,
                             "unknown API key (revoked, mistyped or for another deployment)", "unknown_key")
        return principal


def authorize(principal: Principal, requested_tenant: str, requested_priority: str) -> str | AuthError:
    """The tenant a request runs as (the key's), or a refusal. `requested_priority` is normalized ("" already
    made "standard"); an invalid one is left to validation, which names the allowed values."""
    if requested_tenant and requested_tenant != principal.tenant:
        return AuthError(grpc.StatusCode.PERMISSION_DENIED,
                         f"this API key belongs to tenant {principal.tenant!r}; it cannot send requests as tenant "
                         f"{requested_tenant[:80]!r} (leave tenant empty to use the key's)", "tenant")
    if requested_priority in PRIORITIES and requested_priority not in principal.priorities:
        return AuthError(grpc.StatusCode.PERMISSION_DENIED,
                         f"tenant {principal.tenant!r} may not send {requested_priority} requests; its priorities "
                         f"are {', '.join(principal.priorities)} (an empty priority means standard)", "priority")
    return principal.tenant


def _bearer(value: str | bytes) -> str | None:
    """The key of 'Bearer <key>' (the scheme in any case, RFC 7235), None when garbled."""
    if isinstance(value, bytes):   # a '-bin' key would be bytes; authorization is text, but be safe
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    scheme, _, key = value.strip().partition(" ")
    key = key.strip()
    if scheme.lower() != BEARER or not key or len(key) > MAX_KEY_CHARS or not _KEY.fullmatch(key):
        return None
    return key


def _digests(value: object, where: str) -> list[str]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: api_keys_sha256 must be a non-empty list of hex SHA-256 digests "
                         f"(`tether keys new --tenant NAME` prints one)")
    out = []
    for i, d in enumerate(value):
        if not isinstance(d, str) or not _HEX64.fullmatch(d.strip().lower()):
            # The entry is not shown: it may be a key pasted by mistake, and this message reaches the logs.
            raise ValueError(f"{where}: api_keys_sha256[{i}] is not 64 hex digits: store the key's SHA-256 "
                             f"(`tether keys hash`), never the key itself")
        out.append(d.strip().lower())
    return out


def _priorities(value: object, where: str) -> tuple[Priority, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(p, str) for p in value):
        raise ValueError(f"{where}: priorities must be a non-empty list of {', '.join(PRIORITIES)}")
    bad = [p for p in value if p not in PRIORITIES]
    if bad:
        raise ValueError(f"{where}: unknown priorities {bad}; allowed: {', '.join(PRIORITIES)}")
    return tuple(p for p in PRIORITIES if p in value)   # canonical order, no duplicates
