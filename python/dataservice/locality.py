"""Host identity, which decides locality (API.md "Locality").

A worker is *local* to a client when both report the same host id: by default
the machine's boot id, hostname and network namespace, so two containers or
network namespaces on one machine are different hosts. The environment variable
`DATASERVICE_HOST_ID` overrides it.
"""

from __future__ import annotations

import functools
import os
import socket

HOST_ID_ENV = "DATASERVICE_HOST_ID"


@functools.cache
def _default_host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = "no-boot-id"
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = "no-netns"
    return f"{boot_id}/{socket.gethostname()}/{netns}"


def host_id() -> str:
    """This process's host id: $DATASERVICE_HOST_ID, else boot id/hostname/netns."""
    return os.environ.get(HOST_ID_ENV) or _default_host_id()
