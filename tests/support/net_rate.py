"""python tests/net_rate.py receive PORT BYTES | send ADDRESS PORT BYTES

A tiny TCP transfer for measuring a link's rate between two hosts of a cluster. The receiver
prints ``MBIT/S <rate>`` measured from the first byte to the last, so process start-up and the
connection set-up do not count; only the link's rate (and TCP's own ramp-up) does.
"""

import socket
import sys
import time

CHUNK = 1 << 16


def receive(port: int, total: int) -> None:
    with socket.create_server(("", port)) as server:
        print("LISTENING", flush=True)
        connection, _ = server.accept()
        with connection:
            received, first = 0, None
            while received < total:
                data = connection.recv(CHUNK)
                if not data:
                    break
                if first is None:
                    first = time.perf_counter()
                received += len(data)
            seconds = time.perf_counter() - first if first is not None else 0.0
    if received < total:
        sys.exit(f"receiver: connection closed after {received} of {total} bytes")
    print(f"MBIT/S {received * 8 / seconds / 1e6:.2f} ({received} bytes in {seconds:.3f} s)", flush=True)


def send(address: str, port: int, total: int) -> None:
    deadline = time.monotonic() + 20
    while True:
        try:
            connection = socket.create_connection((address, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    payload = b"\0" * CHUNK
    with connection:
        connection.settimeout(60)
        sent = 0
        while sent < total:
            sent += connection.send(payload[:min(CHUNK, total - sent)])


if __name__ == "__main__":
    if sys.argv[1] == "receive":
        receive(int(sys.argv[2]), int(sys.argv[3]))
    else:
        send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
