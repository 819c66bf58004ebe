"""The ready line `serve` and `controlplane` print: a client reads the scheme from it."""

from pagedserve.controlplane.cli import ready_line


def test_plaintext_ports_are_http() -> None:
    assert ready_line("127.0.0.1", 50051, 8000, tls=False) == (
        "pagedserve gRPC on 127.0.0.1:50051  HTTP on http://127.0.0.1:8000"
    )


def test_tls_ports_say_https_and_what_a_client_needs() -> None:
    line = ready_line("0.0.0.0", 50051, 8443, tls=True)
    assert line.startswith("pagedserve gRPC on 0.0.0.0:50051  HTTP on https://0.0.0.0:8443")
    assert "http://" not in line and "TLS" in line
