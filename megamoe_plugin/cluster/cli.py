"""``megamoe cluster run | check | cleanup``: the emulated multi-node cluster from the command line.

    megamoe cluster run --nodes 2 --procs-per-node 2 --inter-node-bandwidth 100MB/s -- megamoe train ...
    megamoe cluster run --cpu-share 0.45 ...   # every rank a fixed-speed device (its own cgroup; default auto)
    megamoe cluster check            # can the emulation run here? (root, ip, tc, namespaces, tbf, cgroups)
    megamoe cluster cleanup          # remove namespaces/links/cgroups left by runs whose launcher was killed
"""
from __future__ import annotations

import argparse
import sys
from typing import List

DEFAULT_INTER_BANDWIDTH = "100MB/s"   # an MoE layer step of the bench spends 30-60% in the all-to-all


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megamoe cluster", description="An emulated multi-node cluster on one Linux "
                                "machine: network namespaces as nodes, token-bucket-shaped veth links as their NICs.")
    sub = p.add_subparsers(dest="action", metavar="<action>", required=True)
    r = sub.add_parser("run", help="run a torch.distributed program on N emulated nodes x G processes",
                       description="Run a torch.distributed program (everything after --) on N emulated nodes x G "
                                   "processes with torchrun's environment, GLOO_SOCKET_IFNAME and the cluster's "
                                   "topology (MEGAMOE_TOPOLOGY*). Needs root.")
    r.add_argument("--nodes", type=int, default=2, help="emulated nodes (network namespaces)")
    r.add_argument("--procs-per-node", default="2", help="processes (ranks) per node: one count, or one per node "
                   "for an asymmetric cluster (e.g. 2,1,1 with --nodes 3)")
    r.add_argument("--inter-node-bandwidth", default=DEFAULT_INTER_BANDWIDTH,
                   help="each node's link, per direction (e.g. 25MB/s, 200Mbit)")
    r.add_argument("--intra-node-bandwidth", default=None,
                   help="shape traffic between processes of one node too (default: unshaped loopback)")
    r.add_argument("--cpu-share", default="auto",
                   help="each rank's CPU share in cores, enforced by its own cgroup (CFS quota, 10 ms period) so a "
                   "rank is a fixed-speed device that cannot borrow the cores its idle peers leave: one value, one "
                   "per rank (a smaller one emulates a slower device), 'auto' (0.9 x cores / ranks, uncapped with a "
                   "warning where cgroups are unavailable) or 'off'")
    r.add_argument("--master-port", type=int, default=29500, help="rendezvous port on node 0 (port+1: the probe)")
    r.add_argument("--log-dir", default=None, help="every rank's output (default ./cluster_logs/<run id>)")
    r.add_argument("--timeout", type=float, default=3600.0, help="stop the job after this many seconds")
    r.add_argument("--no-probe", action="store_true", help="skip the start-up probes (link bandwidths, layer split)")
    r.add_argument("--no-split", action="store_true", help="skip measuring a reference MoE layer step's compute / "
                   "all-to-all split at start-up (a few seconds)")
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- program and its arguments")
    sub.add_parser("check", help="say whether the emulation can run here", description="Say whether the emulated "
                   "cluster can run on this machine (root, ip/tc, namespaces, veth, tbf), and why not.")
    c = sub.add_parser("cleanup", help="remove what killed runs left behind", description="Remove the namespaces, "
                       "veth pairs, bridges and CPU cgroups (named mmoe*) of runs whose launcher is gone.")
    c.add_argument("--all", action="store_true", help="also those of runs still alive")
    return p


def main(argv: List[str]) -> int:
    from . import cpu_caps, netns
    from .launcher import run_job

    p = build_parser()
    args = p.parse_args(argv)
    if args.action == "check":
        why = netns.unavailable()
        print(why or "the emulated cluster can run here (root, ip, tc, network namespaces, veth, tbf)")
        caps_why = cpu_caps.unavailable()
        found = cpu_caps.controller_root()
        print(f"fixed-speed ranks (--cpu-share): {caps_why}" if caps_why else
              f"fixed-speed ranks (--cpu-share) available: cgroup {found[0]} cpu controller at {found[1]}")
        return 1 if why else 0
    if args.action == "cleanup":
        removed = netns.remove_leftovers(all_runs=args.all)
        print("\n".join(f"removed {r}" for r in removed) or "nothing to remove")
        return 0
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        p.error("run: give the program after --, e.g. megamoe cluster run -- megamoe train")
    from .launcher import layout
    try:
        counts = [int(v) for v in str(args.procs_per_node).split(",")]
        procs = counts[0] if len(counts) == 1 else counts
        layout(args.nodes, procs)
    except ValueError:
        p.error(f"run: --procs-per-node {args.procs_per_node!r}: one count >= 1, or --nodes counts separated by commas")
    try:
        inter = netns.parse_bandwidth(args.inter_node_bandwidth)
        intra = netns.parse_bandwidth(args.intra_node_bandwidth) if args.intra_node_bandwidth else None
    except ValueError as err:
        p.error(f"run: {err}")
    world = sum(len(g) for g in layout(args.nodes, procs))
    try:
        shares = cpu_caps.parse_shares(args.cpu_share, world)
    except ValueError as err:
        p.error(f"run: {err}")
    why = netns.unavailable()
    if why:
        print(f"megamoe cluster: {why}", file=sys.stderr)
        return 2
    caps_why = cpu_caps.unavailable() if shares else None
    if caps_why and args.cpu_share.strip().lower() != "auto":
        print(f"megamoe cluster: --cpu-share {args.cpu_share}: {caps_why}", file=sys.stderr)
        return 2
    if caps_why:
        print(f"megamoe cluster: warning: ranks run uncapped and share the cores ({caps_why})", file=sys.stderr)
        shares = None
    return run_job(cmd, args.nodes, procs, inter, intra, args.master_port, args.log_dir,
                   args.timeout, not args.no_probe, split=not (args.no_probe or args.no_split), cpu_shares=shares)
