"""The configuration of jobs without MPI: parsed in commlib/config.py, handed to the transport."""

import pytest

from commlib.config import Config
from commlib.transports.socket import SocketOptions, TLSFiles


def test_the_socket_fields_parse_from_the_environment():
    config = Config.from_env({"COMMLIB_SOCKET_FRAME_CHECKS": "0", "COMMLIB_SOCKET_FRAME_BYTES": "65536",
                              "COMMLIB_SOCKET_IFNAME": "eth0", "COMMLIB_HANDSHAKE_TIMEOUT": "2.5",
                              "COMMLIB_STORE_MAX_VALUE_BYTES": "1024", "COMMLIB_SOCKET_TLS": "1",
                              "COMMLIB_SOCKET_TLS_CERT": "/c.pem", "COMMLIB_SOCKET_TLS_KEY": "/k.pem",
                              "COMMLIB_SEGMENT_BYTES": "4096"})
    assert (config.socket_frame_checks, config.socket_frame_bytes, config.socket_interface,
            config.handshake_timeout, config.store_max_value_bytes) == (False, 65536, "eth0", 2.5, 1024)
    options = SocketOptions.from_config(config)
    assert options == SocketOptions(frame_checks=False, frame_bytes=65536, segment_bytes=4096, interface="eth0",
                                    handshake_timeout=2.5, tls=TLSFiles("/c.pem", "/k.pem"))
    assert SocketOptions.from_config(Config()) == SocketOptions()


@pytest.mark.parametrize("environ,named", [
    ({"COMMLIB_SOCKET_FRAME_BYTES": "100"}, "COMMLIB_SOCKET_FRAME_BYTES"),
    ({"COMMLIB_SOCKET_FRAME_BYTES": str(1 << 32)}, "4 GiB"),
    ({"COMMLIB_SOCKET_FRAME_CHECKS": "maybe"}, "COMMLIB_SOCKET_FRAME_CHECKS"),
    ({"COMMLIB_SOCKET_TLS": "1"}, "COMMLIB_SOCKET_TLS_CERT"),
    ({"COMMLIB_HANDSHAKE_TIMEOUT": "0"}, "COMMLIB_HANDSHAKE_TIMEOUT"),
])
def test_bad_values_name_their_variable(environ, named):
    with pytest.raises(ValueError, match=named):
        Config.from_env(environ)
