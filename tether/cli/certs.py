"""`tether certs init DIR`: a local CA and one certificate per service, for `tether up --tls`, docker-compose or k8s."""

from __future__ import annotations

import argparse
from pathlib import Path

from tether.security import certs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tether certs",
        description="Make a local certificate authority (DIR/ca.pem, ca.key) and a certificate + key per service "
                    "(DIR/NAME.pem, NAME.key): admission, coordinator, stage-0..N-1, operator and client. Each "
                    "names its service in a URI SAN (spiffe://tether.local/admission, /coordinator, /stage/<i>, "
                    "/operator, /client/<name>), which is what the services authorize by. Service certificates "
                    "(admission, coordinator, stages) may serve and call: they carry their server name "
                    "(<role>[-<i>].id.tether.local, which the other services verify them under) and the host "
                    "names they are reached by (localhost, 127.0.0.1, ::1, their docker-compose and k8s names, "
                    "and every --host). operator and client certificates may only call (clientAuth) and carry no "
                    "host name. Keys are written 0600. Files already in DIR are kept: a second run adds what is "
                    "missing under the same CA (a folder made before server names existed needs a fresh one).",
        epilog="Give each service its files with --tls-ca DIR/ca.pem --tls-cert DIR/NAME.pem --tls-key DIR/NAME.key "
               "(or TETHER_TLS_CA/CERT/KEY). operator may call Stats on the coordinator and the stages (tether "
               "bench, dashboards) and drain a coordinator (tether drain --tls-dir DIR); client is for callers of the public port when it requires certificates.")
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    init = sub.add_parser("init", help="make the CA and the certificates",
                          description="Make the CA and every service's certificate in DIR.")
    init.add_argument("dir", type=Path, metavar="DIR", help="folder to write into (made if missing, mode 0700)")
    init.add_argument("--stages", type=int, default=4, metavar="N",
                      help="stage certificates stage-0 .. stage-(N-1) (default: %(default)s)")
    init.add_argument("--host", action="append", default=[], metavar="NAME",
                      help="one more DNS name or IP address on every service certificate (repeatable)")
    init.add_argument("--client", action="append", default=[], metavar="NAME",
                      help="one more client certificate client-NAME (identity spiffe://tether.local/client/NAME) "
                           "besides `client` (client/default) (repeatable)")
    return p


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.stages < 1:
        parser.error("--stages must be at least 1")
    issued = certs.init(args.dir, stages=args.stages, hosts=args.host,
                        clients=["client", *(f"client-{n}" for n in args.client)])
    print(f"CA: {certs.ca_path(args.dir)}")
    for i in issued:
        print(f"  {i.name:<12} {i.identity:<40} {'written' if i.created else 'kept'}  {i.cert}")
