"""How a group's ranks find each other before any transport exists.

The contract (:mod:`.interface`) and its implementations: :mod:`.mpi` (an MPI communicator) and
:mod:`.store_rendezvous` (a key-value store: :mod:`.tcp_store`, :mod:`.file_store`, or a torch
store through :mod:`.torch_store`). The job secret (:mod:`.secret`) and the handshake every
connection starts with (:mod:`.handshake`) live here too: they come before any transport.
"""

from commlib.rendezvous.file_store import FileStore
from commlib.rendezvous.handshake import AuthenticationError, RefusalLog, authenticate
from commlib.rendezvous.interface import Rendezvous
from commlib.rendezvous.secret import JobSecret, configured_secret, generate_secret, share_secret
from commlib.rendezvous.store import Store
from commlib.rendezvous.store_rendezvous import StoreRendezvous
from commlib.rendezvous.tcp_store import TCPStore, open_tcp_store
from commlib.rendezvous.tcp_store_server import TCPStoreServer
from commlib.rendezvous.torch_store import TorchStore

__all__ = ["Rendezvous", "StoreRendezvous", "Store", "TCPStore", "TCPStoreServer", "open_tcp_store", "FileStore",
           "TorchStore", "JobSecret", "configured_secret", "generate_secret", "share_secret", "authenticate",
           "AuthenticationError", "RefusalLog"]
