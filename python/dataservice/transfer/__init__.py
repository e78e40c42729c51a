"""Element transfer between workers and clients: a registry of protocols."""

# Registers the "shm" protocol (the client's factory, shm.py, and the worker's
# server, shm_server.py) wherever the transfer package is imported, as the worker
# and the reader both do.
from dataservice.transfer import shm as _shm  # noqa: E402,F401
from dataservice.transfer import shm_server as _shm_server  # noqa: E402,F401
