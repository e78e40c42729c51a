"""Element transfer between workers and clients: a registry of protocols."""

# Registers the "shm" protocol (client factory and worker server) wherever the
# transfer package is imported, as the worker and the reader both do.
from dataservice.transfer import shm as _shm  # noqa: E402,F401
