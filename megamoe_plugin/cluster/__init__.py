"""The emulated multi-node cluster: network namespaces as nodes, shaped veth links as their NICs, a torchrun-like
launcher (``megamoe cluster run``). See netns.py (the network), launcher.py (the job), cli.py (the command)."""
from .launcher import run_job
from .netns import ClusterError, EmulatedCluster, leftovers, parse_bandwidth, remove_leftovers, unavailable

__all__ = ["run_job", "ClusterError", "EmulatedCluster", "leftovers", "parse_bandwidth", "remove_leftovers",
           "unavailable"]
