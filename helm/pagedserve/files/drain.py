"""A data plane's preStop hook: drain it, then return so Kubernetes sends SIGTERM.

`DataPlaneService.Drain(wait=true)` stops the data plane from taking new requests (control
planes see it draining and route elsewhere) and returns once no request remains; running
streams finish meanwhile. Mounted from the chart's ConfigMap and run with the image's python:

    python /etc/pagedserve/hooks/drain.py --address 127.0.0.1:50052 --timeout 285 \\
        [--token-file /etc/pagedserve/dataplane-token/token] \\
        [--ca-file ca.crt --server-name '$POD_NAME.<service>.<ns>.svc.cluster.local'] \\
        [--cert-file tls.crt --key-file tls.key]

The hook authenticates like a control plane: the shared token (`--token-file`, sent as call
metadata) and/or the client certificate of mutual TLS.

`--server-name` (environment variables expanded) is the name the data plane's certificate
is checked against, since the hook dials the loopback address. Exit status: 0 when drained
(or when nothing listens any more), 1 when requests remained at the timeout or the call
failed (a TLS mismatch, say); Kubernetes stops the pod either way and records a failed hook.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import grpc

from pagedserve.common.tls import read_token_file, token_metadata
from pagedserve.protos.pagedserve.v1 import dataplane_pb2, dataplane_pb2_grpc


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="drain.py", description="drain a pagedserve data plane")
    parser.add_argument("--address", required=True, help="the data plane's gRPC HOST:PORT")
    parser.add_argument("--timeout", type=float, required=True, help="seconds to wait for streams to end")
    parser.add_argument("--token-file", default=None, help="the shared data-plane token's file")
    parser.add_argument("--ca-file", default=None, help="TLS: the CA of the data plane's certificate")
    parser.add_argument("--server-name", default=None, help="TLS: the name to check its certificate for")
    parser.add_argument("--cert-file", default=None, help="mutual TLS: client certificate")
    parser.add_argument("--key-file", default=None, help="mutual TLS: its private key")
    args = parser.parse_args(argv)
    if (args.cert_file is None) != (args.key_file is None):
        parser.error("give both --cert-file and --key-file, or neither")
    if args.cert_file and not args.ca_file:
        parser.error("--cert-file needs --ca-file")
    return args


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    if not args.ca_file:
        return grpc.insecure_channel(args.address)

    def read(path: str | None) -> bytes | None:
        return None if path is None else Path(path).read_bytes()

    credentials = grpc.ssl_channel_credentials(
        root_certificates=read(args.ca_file),
        private_key=read(args.key_file),
        certificate_chain=read(args.cert_file),
    )
    options = []
    if args.server_name:
        options.append(("grpc.ssl_target_name_override", os.path.expandvars(args.server_name)))
    return grpc.secure_channel(args.address, credentials, options=options)


def drain(args: argparse.Namespace) -> int:
    start = time.monotonic()
    metadata = token_metadata(read_token_file(args.token_file) if args.token_file else None)
    with open_channel(args) as channel:
        stub = dataplane_pb2_grpc.DataPlaneServiceStub(channel)
        try:
            response = stub.Drain(
                dataplane_pb2.DrainRequest(wait=True), timeout=args.timeout, metadata=metadata
            )
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            details = (exc.details() if isinstance(exc, grpc.Call) else None) or ""
            if code == grpc.StatusCode.UNAVAILABLE and "refused" in details.lower():
                print(f"drain: nothing listens on {args.address} (already stopped)", file=sys.stderr)
                return 0
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                print(f"drain: requests still running after {args.timeout:g} s", file=sys.stderr)
                return 1
            print(f"drain: {args.address}: {exc}", file=sys.stderr)
            return 1
    elapsed = time.monotonic() - start
    print(f"drain: {response.num_remaining} request(s) left after {elapsed:.1f} s", file=sys.stderr)
    return 0 if response.num_remaining == 0 else 1


def main(argv: list[str] | None = None) -> int:
    return drain(parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
