"""A trial over two Ray nodes that are two hosts to the network (the worker node in a network
namespace of its own, `conftest_ray.two_host_cluster`): its ranks must meet at addresses the other
node reaches, which a loopback cluster, where every address is this host's, cannot tell apart."""

from __future__ import annotations

import pytest
from conftest_ray import can_make_network_namespaces, collect, tiny_spec, two_host_cluster

from tuner.executors.nodes import interface_of
from tuner.executors.ray_executor import RayExecutor

needs_namespaces = pytest.mark.skipif(not can_make_network_namespaces(), reason="needs root and `ip netns`")


def test_the_interface_of_an_address_is_found_and_a_foreign_address_has_none():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.77") is None and interface_of("not an address") is None


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    with two_host_cluster(tmp_path_factory) as (address, _):
        ex = RayExecutor(address=address, lease_dir=str(tmp_path_factory.mktemp("leases")))
        try:
            yield ex
        finally:
            ex.close()


@pytest.mark.slow
@needs_namespaces
def test_a_two_node_trial_meets_on_the_nodes_addresses_not_where_the_host_name_resolves(two_hosts, tmp_path):
    """gloo binds where the host's name resolves, 127.0.0.1 here (127.0.1.1 on a stock Debian): each
    rank told its peer on the other node an address of its own stack, and the trial waited out its
    timeout. Bound to the interface of the node's Ray address, the ranks meet."""
    spec = tiny_spec(tmp_path, "across", ranks=2, nodes=2, steps=3, timeout_s=45)

    two_hosts.submit(spec)
    [result] = collect(two_hosts, {"across"}, timeout_s=150)

    assert result.status == "ok", result.error
    assert result.nodes == 2 and len(set(result.rank_nodes)) == 2
    ips = {p["ray_node_ip"] for p in result.extra["placement"]}
    assert len(ips) == 2 and all(ip.startswith("10.213.") for ip in ips), ips  # the two stacks
