"""What a hostile host does to a job's listening ports (run on that host, e.g. in a namespace).

``python -m tests.support.strangers attack KIND@HOST:PORT... [--idle N] [--replay FILE]``: for each
endpoint (``KIND`` the handshake purpose it serves: ``transport``, ``witness``, ``probe``), one
connection each of: random bytes (64 KiB), truncated handshakes (half a RESPONSE, then close; and
the challenge read, nothing sent, close), a RESPONSE captured from a real rank replayed
(``--replay``: 112 bytes in hex), a well-formed RESPONSE made with another job's secret, and a
frame header announcing 100 GB; then ``N`` idle connections at once, held for ``--hold``
seconds. Prints one JSON line: per endpoint and attack, what the job answered (the REFUSE's
reason, or how the connection ended).

``python -m tests.support.strangers sniff IFACE PORT SECONDS OUT [--ready FILE]``: the TCP payload sent *to*
``PORT`` on ``IFACE`` for ``SECONDS`` (a raw socket: root, inside the sender's namespace), each
connection's bytes in hex, written to ``OUT`` as JSON. What a rank says in a handshake, for a
replay.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import struct
import sys
import time
from typing import Dict, List

from commlib.rendezvous.handshake_core import (CHALLENGE_BYTES, REFUSALS, REPLY_BYTES, RESPONSE_BYTES,
                                               ClientHandshake)
from commlib.rendezvous.secret import secret_from_text
from commlib.transports.socket.framing import FrameCodec
from commlib.transports.socket.mesh import group_id

OTHER_JOB = secret_from_text("another job's secret, not this one", "a stranger")
HUNDRED_GB = 100 << 30


def _recv_exactly(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        try:
            chunk = sock.recv(count - len(data))
        except (ConnectionResetError, socket.timeout):
            break
        if not chunk:
            break
        data += chunk
    return data


def _ending(sock: socket.socket, challenge_unread: bool = False) -> str:
    """How the job ends a connection it should not serve: a REFUSE's reason, or a close."""
    try:
        if challenge_unread:  # the job speaks first: its challenge, whatever we sent
            _recv_exactly(sock, CHALLENGE_BYTES)
        data = _recv_exactly(sock, REPLY_BYTES)
    except OSError as error:
        return f"error {error}"
    if len(data) >= 8 and data[:4] == b"CLHS" and data[5] == 4:
        return f"refused: {REFUSALS.get(data[7], data[7])}"
    return "closed" if len(data) < REPLY_BYTES else f"answered {len(data)} bytes"


def _connect(host: str, port: int) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=30)
    sock.settimeout(30)
    return sock


def attack(endpoint: str, replay: bytes) -> Dict[str, str]:
    kind, where = endpoint.split("@", 1)
    host, port_text = where.rsplit(":", 1)
    port = int(port_text)
    results: Dict[str, str] = {}
    with _connect(host, port) as sock:  # random bytes
        sock.sendall(os.urandom(64 << 10))
        results["random bytes"] = _ending(sock, challenge_unread=True)
    with _connect(host, port) as sock:  # half a response: the job waits for the rest, then gives up
        challenge = _recv_exactly(sock, CHALLENGE_BYTES)
        sock.sendall(ClientHandshake(OTHER_JOB, kind).answer(challenge)[:RESPONSE_BYTES // 2])
        sock.shutdown(socket.SHUT_WR)
        results["truncated response"] = _ending(sock)
    with _connect(host, port) as sock:  # the challenge read, then gone
        _recv_exactly(sock, CHALLENGE_BYTES)
        results["gone after the challenge"] = "closed by us"
    if replay:
        with _connect(host, port) as sock:
            _recv_exactly(sock, CHALLENGE_BYTES)
            sock.sendall(replay)
            results["replayed response"] = _ending(sock)
    with _connect(host, port) as sock:  # well formed, but keyed with another job's secret
        challenge = _recv_exactly(sock, CHALLENGE_BYTES)
        sock.sendall(ClientHandshake(OTHER_JOB, kind, b"x" * 24).answer(challenge))
        results["another job's secret"] = _ending(sock)
    with _connect(host, port) as sock:  # a data frame's header announcing 100 GB, where a handshake is due
        codec = FrameCodec(True, OTHER_JOB.job_id, group_id("world"), 4 << 20)
        header = codec.data_header(1, 0, 0, (1 << 32) - 1, HUNDRED_GB)  # the longest frame of a 100 GB message
        sock.sendall(header + os.urandom(4096))
        results["100 GB frame"] = _ending(sock, challenge_unread=True)
    return results


def idle(endpoints: List[str], count: int, hold: float) -> Dict[str, int]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, count + 256)), hard))
    opened: List[socket.socket] = []
    failed = 0
    for index in range(count):
        _, where = endpoints[index % len(endpoints)].split("@", 1)
        host, port = where.rsplit(":", 1)
        try:
            opened.append(socket.create_connection((host, int(port)), timeout=10))
        except OSError:
            failed += 1
    time.sleep(hold)
    closed_by_job = 0
    for sock in opened:
        sock.setblocking(False)
        try:
            while True:
                data = sock.recv(1 << 16)
                if not data:
                    closed_by_job += 1
                    break
        except BlockingIOError:
            pass
        except OSError:
            closed_by_job += 1
        sock.close()
    return {"opened": len(opened), "failed": failed, "closed by the job": closed_by_job}


def sniff(interface: str, port: int, seconds: float, ready: str = "") -> Dict[str, str]:
    """Bytes sent to ``port`` per connection (source address and port), in order of arrival;
    ``ready``: a file made once the capture runs."""
    raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))
    raw.bind((interface, 0))
    raw.settimeout(0.2)
    if ready:
        open(ready, "w").close()
    flows: Dict[str, Dict[int, bytes]] = {}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            frame = raw.recv(1 << 16)
        except socket.timeout:
            continue
        if len(frame) < 34 or frame[12:14] != b"\x08\x00":  # IPv4 only
            continue
        ip = frame[14:]
        header = (ip[0] & 0x0F) * 4
        if ip[9] != 6:
            continue
        total = struct.unpack("!H", ip[2:4])[0]
        tcp = ip[header:total]
        source_port, destination_port, sequence = struct.unpack("!HHI", tcp[:8])
        payload = tcp[(tcp[12] >> 4) * 4:]
        if destination_port != port or not payload:
            continue
        flow = f"{socket.inet_ntoa(ip[12:16])}:{source_port}"
        flows.setdefault(flow, {})[sequence] = payload
    raw.close()
    return {flow: b"".join(chunks[key] for key in sorted(chunks)).hex() for flow, chunks in flows.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.strangers")
    sub = parser.add_subparsers(dest="command", required=True)
    hit = sub.add_parser("attack")
    hit.add_argument("endpoints", nargs="+")
    hit.add_argument("--idle", type=int, default=0)
    hit.add_argument("--hold", type=float, default=3.0)
    hit.add_argument("--replay", default="")
    look = sub.add_parser("sniff")
    look.add_argument("interface")
    look.add_argument("port", type=int)
    look.add_argument("seconds", type=float)
    look.add_argument("out")
    look.add_argument("--ready", default="")
    args = parser.parse_args(argv)
    if args.command == "sniff":
        flows = sniff(args.interface, args.port, args.seconds, args.ready)
        with open(args.out, "w") as handle:
            json.dump(flows, handle)
        return 0
    replay = bytes.fromhex(args.replay)
    report = {endpoint: attack(endpoint, replay) for endpoint in args.endpoints}
    if args.idle:
        report["idle"] = idle(args.endpoints, args.idle, args.hold)  # type: ignore[assignment]
    sys.stdout.write(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
