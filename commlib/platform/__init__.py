"""What commlib needs of the machine it runs on: how many ranks share its cores, waiting
without starving them (timer slack, polling MPI requests with a deadline), and the addresses
of its network interfaces.

The lowest layer: it imports nothing of commlib but :mod:`commlib.errors`.
"""
