"""Every environment variable commlib reads, read in one place into one frozen object.

==========================  ========================================================  =========
variable                    meaning                                                   default
==========================  ========================================================  =========
``COMMLIB_ALGO``            force the allreduce algorithm chosen by ``"auto"``        (unset)
``COMMLIB_ALGO_<NAME>``     force ``<NAME>``'s algorithm chosen by ``"auto"``, for     (unset)
                            ``BROADCAST``, ``REDUCE``, ``ALLGATHER``,
                            ``REDUCE_SCATTER``, ``ALLTOALL``, ``ALLTOALLV``,
                            ``GATHER``, ``SCATTER``, ``BARRIER`` (e.g.
                            ``COMMLIB_ALGO_ALLGATHER=bruck``)
``COMMLIB_DEBUG``           ``1``: exchange a fingerprint before every collective      ``0``
``COMMLIB_TIMEOUT``         default group timeout in seconds                          ``300``
``COMMLIB_SEGMENT_BYTES``   pipeline segment size of ring/tree/rabenseifner            ``1 MiB``
``COMMLIB_GPU_TRANSPORT``   GPU transport: ``nccl``, or ``host_staged`` (ranks may      ``nccl``
                            share a GPU; bytes go through host memory and MPI)
``COMMLIB_CRASH_WITNESS``   ``0``: no per-host witness process naming a rank killed    ``1``
                            by a signal (see :mod:`commlib.reliability.crash_witness`)
``COMMLIB_SHM``             ``0``: no shared memory between the ranks of a host (no     ``1``
                            symmetric buffers, no ``shm_*`` algorithms: MPI only)
``COMMLIB_SHM_HEAP_BYTES``  address space per rank for symmetric buffers (sparse:     ``8 GiB``
                            memory is used only for what is allocated)
``COMMLIB_SHM_SLOT_BYTES``  each of a rank's two small-message slots (``shm_oneshot``  ``256 KiB``
                            rounds); larger messages go round by round
``COMMLIB_SHM_STAGING_BYTES`` each of a rank's two staging halves (``shm_twoshot``     ``16 MiB``
                            rounds, plain buffers are copied there)
``COMMLIB_SHM_CMA``         ``0``: no cross-memory copies (``process_vm_readv``) in     ``1``
                            ``shm_direct``'s two-rank broadcast, scatter and gather,
                            even where they work
``COMMLIB_COST_MODEL``      a cost model JSON (``python -m commlib.costmodel fit``):    (unset)
                            ``"auto"`` picks its cheapest prediction for groups that
                            span hosts
``COMMLIB_JOB_SECRET``      this job's secret (16 characters or more), the same on      (unset)
                            every rank: connections to the store and between ranks
                            prove it (see :mod:`commlib.rendezvous.secret`)
``COMMLIB_JOB_SECRET_FILE`` a file (mode 0600, owned by this user) holding the secret  (unset)
``COMMLIB_STORE``           where ranks launched without MPI meet: ``tcp://HOST:PORT``   ``env://``
                            (rank 0 serves it), ``file:///path``, ``env://``
                            (``MASTER_ADDR``/``MASTER_PORT``)
``COMMLIB_HANDSHAKE_TIMEOUT`` seconds a connection may take to authenticate           ``10``
``COMMLIB_STORE_MAX_VALUE_BYTES`` largest value the TCP store accepts (its frames are  ``64 MiB``
                            bounded by it)
``COMMLIB_SOCKET_IFNAME``   the interface (name, or one of its addresses) the socket    (unset)
                            transport listens on; default: the one that reaches the
                            store, loopback when every rank shares the host
``COMMLIB_SOCKET_FRAME_CHECKS`` ``0``: frames carry only their length (no job, group,   ``1``
                            sequence number, step checks); every rank must agree
``COMMLIB_SOCKET_FRAME_BYTES`` largest payload of one frame (a message is sent in      ``4 MiB``
                            frames of at most this)
``COMMLIB_SOCKET_TLS``      ``1``: the socket transport's links run TLS (needs the      ``0``
                            certificate and key below)
``COMMLIB_SOCKET_TLS_CERT`` PEM certificate of this rank (may be one for every rank)   (unset)
``COMMLIB_SOCKET_TLS_KEY``  its PEM private key                                       (unset)
``COMMLIB_SOCKET_TLS_CA``   PEM certificates peers must be signed by                   the cert
==========================  ========================================================  =========

Tests change behaviour through arguments (``commlib.init(debug=True)``, ``segment_bytes=``),
never by mutating module globals; ``Config.from_env`` takes a mapping so it can be tested too.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, Mapping, Optional, Tuple

__all__ = ["Config", "load_config", "GPU_TRANSPORTS", "OVERRIDABLE_COLLECTIVES"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse_bool(name: str, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"{name}={text!r}: expected one of 1/0, true/false, yes/no, on/off")


def _parse_positive_float(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected a number of seconds") from None
    if not value > 0:
        raise ValueError(f"{name}={text!r}: expected a positive number of seconds")
    return value


def _parse_int(name: str, text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={text!r}: expected an integer >= {minimum}")
    return value


def _parse_choice(name: str, text: str, choices) -> str:
    value = text.strip()
    if value not in choices:
        raise ValueError(f"{name}={text!r}: expected one of {', '.join(choices)}")
    return value


GPU_TRANSPORTS = ("nccl", "host_staged")
# The collectives with a COMMLIB_ALGO_<NAME> override (allreduce's is COMMLIB_ALGO).
OVERRIDABLE_COLLECTIVES = ("broadcast", "reduce", "allgather", "reduce_scatter", "alltoall", "alltoallv",
                           "gather", "scatter", "barrier")


@dataclasses.dataclass(frozen=True)
class Config:
    algorithm_override: Optional[str] = None
    debug: bool = False
    timeout: float = 300.0
    segment_bytes: int = 1 << 20
    gpu_transport: str = "nccl"
    crash_witness: bool = True
    shm: bool = True
    shm_heap_bytes: int = 8 << 30
    shm_slot_bytes: int = 256 << 10
    shm_staging_bytes: int = 16 << 20
    shm_cross_memory: bool = True
    cost_model: Optional[str] = None
    # ((collective, algorithm), ...) from COMMLIB_ALGO_<COLLECTIVE>, sorted; a tuple keeps it frozen.
    collective_algorithms: Tuple[Tuple[str, str], ...] = ()
    # -- jobs without MPI: the job secret, the store and the socket transport ------------------
    # The secret never shows in a repr (configs get printed in error reports).
    job_secret: Optional[str] = dataclasses.field(default=None, repr=False)
    job_secret_file: Optional[str] = None
    store: Optional[str] = None
    handshake_timeout: float = 10.0
    store_max_value_bytes: int = 64 << 20
    socket_interface: Optional[str] = None
    socket_frame_checks: bool = True
    socket_frame_bytes: int = 4 << 20
    socket_tls: bool = False
    socket_tls_cert: Optional[str] = None
    socket_tls_key: Optional[str] = None
    socket_tls_ca: Optional[str] = None

    def algorithm_override_for(self, collective: str) -> Optional[str]:
        """The algorithm ``"auto"`` means for ``collective`` by configuration, or None."""
        if collective == "allreduce":
            return self.algorithm_override
        for name, algorithm in self.collective_algorithms:
            if name == collective:
                return algorithm
        return None

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "Config":
        values: Dict[str, Any] = {}
        if environ.get("COMMLIB_ALGO"):
            values["algorithm_override"] = environ["COMMLIB_ALGO"].strip()
        if "COMMLIB_DEBUG" in environ:
            values["debug"] = _parse_bool("COMMLIB_DEBUG", environ["COMMLIB_DEBUG"])
        if "COMMLIB_TIMEOUT" in environ:
            values["timeout"] = _parse_positive_float("COMMLIB_TIMEOUT", environ["COMMLIB_TIMEOUT"])
        if "COMMLIB_SEGMENT_BYTES" in environ:
            values["segment_bytes"] = _parse_int("COMMLIB_SEGMENT_BYTES", environ["COMMLIB_SEGMENT_BYTES"], 1)
        if environ.get("COMMLIB_GPU_TRANSPORT"):
            values["gpu_transport"] = _parse_choice("COMMLIB_GPU_TRANSPORT", environ["COMMLIB_GPU_TRANSPORT"],
                                                    GPU_TRANSPORTS)
        if "COMMLIB_CRASH_WITNESS" in environ:
            values["crash_witness"] = _parse_bool("COMMLIB_CRASH_WITNESS", environ["COMMLIB_CRASH_WITNESS"])
        if "COMMLIB_SHM" in environ:
            values["shm"] = _parse_bool("COMMLIB_SHM", environ["COMMLIB_SHM"])
        if "COMMLIB_SHM_CMA" in environ:
            values["shm_cross_memory"] = _parse_bool("COMMLIB_SHM_CMA", environ["COMMLIB_SHM_CMA"])
        for name, field, minimum in (("COMMLIB_SHM_HEAP_BYTES", "shm_heap_bytes", 0),
                                     ("COMMLIB_SHM_SLOT_BYTES", "shm_slot_bytes", 8),
                                     ("COMMLIB_SHM_STAGING_BYTES", "shm_staging_bytes", 8)):
            if name in environ:
                values[field] = _parse_int(name, environ[name], minimum)
        overrides = tuple((collective, environ[f"COMMLIB_ALGO_{collective.upper()}"].strip())
                          for collective in OVERRIDABLE_COLLECTIVES
                          if environ.get(f"COMMLIB_ALGO_{collective.upper()}", "").strip())
        if overrides:
            values["collective_algorithms"] = overrides
        if environ.get("COMMLIB_COST_MODEL", "").strip():
            values["cost_model"] = environ["COMMLIB_COST_MODEL"].strip()
        values.update(_sockets_from_env(environ))
        return cls(**values)


def _sockets_from_env(environ: Mapping[str, str]) -> Dict[str, Any]:
    """The fields of jobs without MPI (job secret, store, socket transport) from ``environ``."""
    values: Dict[str, Any] = {}
    if environ.get("COMMLIB_JOB_SECRET"):
        values["job_secret"] = environ["COMMLIB_JOB_SECRET"]
    for name, field in (("COMMLIB_JOB_SECRET_FILE", "job_secret_file"), ("COMMLIB_SOCKET_IFNAME", "socket_interface"),
                        ("COMMLIB_SOCKET_TLS_CERT", "socket_tls_cert"), ("COMMLIB_SOCKET_TLS_KEY", "socket_tls_key"),
                        ("COMMLIB_SOCKET_TLS_CA", "socket_tls_ca")):
        if environ.get(name, "").strip():
            values[field] = environ[name].strip()
    if environ.get("COMMLIB_STORE", "").strip():
        values["store"] = environ["COMMLIB_STORE"].strip()
    if "COMMLIB_HANDSHAKE_TIMEOUT" in environ:
        values["handshake_timeout"] = _parse_positive_float("COMMLIB_HANDSHAKE_TIMEOUT",
                                                            environ["COMMLIB_HANDSHAKE_TIMEOUT"])
    if "COMMLIB_STORE_MAX_VALUE_BYTES" in environ:
        values["store_max_value_bytes"] = _parse_int("COMMLIB_STORE_MAX_VALUE_BYTES",
                                                     environ["COMMLIB_STORE_MAX_VALUE_BYTES"], 1)
    if "COMMLIB_SOCKET_FRAME_CHECKS" in environ:
        values["socket_frame_checks"] = _parse_bool("COMMLIB_SOCKET_FRAME_CHECKS",
                                                    environ["COMMLIB_SOCKET_FRAME_CHECKS"])
    if "COMMLIB_SOCKET_FRAME_BYTES" in environ:
        frame_bytes = _parse_int("COMMLIB_SOCKET_FRAME_BYTES", environ["COMMLIB_SOCKET_FRAME_BYTES"], 4096)
        if frame_bytes >= 1 << 32:  # a frame's length is 32 bits on the wire
            raise ValueError(f"a frame of {frame_bytes} bytes (COMMLIB_SOCKET_FRAME_BYTES): expected less than 4 GiB")
        values["socket_frame_bytes"] = frame_bytes
    if "COMMLIB_SOCKET_TLS" in environ:
        values["socket_tls"] = _parse_bool("COMMLIB_SOCKET_TLS", environ["COMMLIB_SOCKET_TLS"])
    if values.get("socket_tls") and not (values.get("socket_tls_cert") and values.get("socket_tls_key")):
        raise ValueError("COMMLIB_SOCKET_TLS=1 needs COMMLIB_SOCKET_TLS_CERT and COMMLIB_SOCKET_TLS_KEY "
                         "(PEM files; one self-signed pair may serve every rank)")
    return values


def load_config() -> Config:
    """The configuration of this process, read from ``os.environ`` at call time."""
    return Config.from_env(os.environ)
