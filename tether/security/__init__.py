"""Transport security: TLS configuration (tls), a local CA and service certificates (certs), the peer's identity
from its client certificate (identity) and who may call what (authz). docs/PROTOCOL.md, "Transport security"."""
