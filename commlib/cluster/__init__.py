"""``python -m commlib.cluster``: many hosts on one machine (network namespaces with their own
host names, joined by a switch), for testing what crosses a network."""

from commlib.cluster.cluster import Cluster

__all__ = ["Cluster"]
