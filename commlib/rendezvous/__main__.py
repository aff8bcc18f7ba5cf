"""The TCP store server, standalone: ``python -m commlib.rendezvous --host ADDRESS --port PORT``.

The secret comes from ``COMMLIB_JOB_SECRET`` or ``COMMLIB_JOB_SECRET_FILE``; ``--open`` runs without
one (the store then trusts the network, as torch's TCPStore does).
"""

import argparse
import logging

from commlib.config import load_config
from commlib.rendezvous.secret import configured_secret
from commlib.rendezvous.tcp_store_server import TCPStoreServer


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="commlib's TCP store server (the secret: COMMLIB_JOB_SECRET(_FILE))")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=29500)
    parser.add_argument("--open", action="store_true", help="run without a job secret (trusts the network)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    config = load_config()
    secret = configured_secret(config)
    if secret is None and not args.open:
        parser.error("no job secret: set COMMLIB_JOB_SECRET or COMMLIB_JOB_SECRET_FILE, or pass --open")
    server = TCPStoreServer(args.host, args.port, secret, handshake_timeout=config.handshake_timeout,
                            max_value_bytes=config.store_max_value_bytes)
    logging.getLogger("commlib.store").info("serving %s (%s)", server.describe(),
                                            secret.describe() if secret else "open: no secret")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
