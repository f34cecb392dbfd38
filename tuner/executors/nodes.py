"""Where a trial's ranks run when they span machines: `NodePart` is one node's share of a trial
(torchrun's node rank, node count and rendezvous address), and `rank_env` gives each rank
torchrun's environment. Ranks are laid out node-major: node k holds global ranks
k*L .. k*L+L-1 for L ranks per node, so the device mesh's innermost (tensor-parallel) groups
stay inside a node whenever tp divides L (a feasibility rule)."""

from __future__ import annotations

import contextlib
import fcntl
import socket
import struct
from dataclasses import dataclass
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at `host` now (the OS picks it; closed again at once), in the
    address family of `host` (IPv6 too, bracketed or not). `""`: on every interface, as rank 0's
    rendezvous store binds it; a port free on one address may be taken on another."""
    if host == "":
        return _free_everywhere()
    family, kind, proto, _, sockaddr = socket.getaddrinfo(host.strip("[]"), 0, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as s:
        s.bind(sockaddr)
        return s.getsockname()[1]


def _free_everywhere() -> int:
    """A port free on every IPv4 and IPv6 address (a dual-stack `::`), or every IPv4 one where the
    machine has no IPv6."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET6) as s:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s.bind(("::", 0))
        return s.getsockname()[1]
    with socket.socket(socket.AF_INET) as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


_SIOCGIFADDR = 0x8915  # Linux: an interface's (primary) IPv4 address


def interface_of(ip: str) -> str | None:
    """The name of this host's network interface that holds `ip` (IPv4 or IPv6), or None."""
    try:
        packed = socket.inet_pton(socket.AF_INET6 if ":" in ip else socket.AF_INET, ip.strip("[]"))
    except OSError:
        return None
    if len(packed) == 16:  # /proc/net/if_inet6: ADDRESS-IN-HEX INDEX PREFIX SCOPE FLAGS NAME
        with contextlib.suppress(OSError):
            for line in Path("/proc/net/if_inet6").read_text().splitlines():
                fields = line.split()
                if len(fields) == 6 and fields[0] == packed.hex():
                    return fields[5]
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                answer = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                if answer[20:24] == packed:
                    return name
    return None


@dataclass(frozen=True)
class NodePart:
    node_rank: int  # torchrun's GROUP_RANK / --node-rank
    nnodes: int
    master_addr: str  # node 0's address; rank 0's TCPStore listens there
    master_port: int

    def local_world(self, world: int) -> int:
        if world % self.nnodes:
            raise ValueError(f"{world} ranks do not split evenly over {self.nnodes} nodes")
        return world // self.nnodes

    def ranks(self, world: int) -> range:
        """The global ranks this node runs."""
        local = self.local_world(world)
        return range(self.node_rank * local, (self.node_rank + 1) * local)

    def to_arg(self) -> str:
        return f"{self.node_rank},{self.nnodes},{self.master_addr},{self.master_port}"

    @classmethod
    def from_arg(cls, text: str) -> NodePart:
        node_rank, nnodes, addr, port = text.split(",")
        return cls(int(node_rank), int(nnodes), addr, int(port))


SINGLE_HOST = "127.0.0.1"


def rank_env(rank: int, world: int, port: int, node: NodePart | None = None) -> dict[str, str]:
    """torchrun's environment for global rank `rank` of `world` (one host when `node` is None)."""
    local_world = world if node is None else node.local_world(world)
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank % local_world),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(local_world),
        "GROUP_RANK": str(0 if node is None else node.node_rank),
        "NNODES": str(1 if node is None else node.nnodes),
        "MASTER_ADDR": SINGLE_HOST if node is None else node.master_addr,
        "MASTER_PORT": str(port if node is None else node.master_port),
        "PYTHONUNBUFFERED": "1",
        "PYTHONFAULTHANDLER": "1",
    }
