"""The ``megamoe`` console command.

    megamoe train [flags]     train the plain-PyTorch MoE GPT trainer (megamoe_plugin.train; ``megamoe train -h`` lists flags)
    megamoe bench [flags]     benchmarks (megamoe_plugin.bench)
    megamoe options           table of every MoE option: flag, type, default, help (--trainer megatron|fairseq)
    megamoe fairseq-user-dir  the folder to pass to fairseq-train / fairseq-generate --user-dir
    megamoe topology          a topology's levels and TA-MoE target pattern; --measure times it (torchrun)
    megamoe perf <command>    performance model: profiles, roofline, simulate (a trace), calibrate (perfmodel.cli)
    megamoe trace             run a trained checkpoint over held-out text: routing trace + heatmap (inference/)
    megamoe cache-sim         expert-buffering miss rates vs cache size on a trace, incl. Belady's MIN
    megamoe balance           greedy / anti-correlation expert placement from a trace -> --moe-placement-file
    megamoe reproduce <paper> a paper's tables and figures, each number labelled measured / predicted / paper
    megamoe results           the results pages' tables and figures from the shipped data (--check compares)
    megamoe cluster run ...   a torch.distributed job on an emulated multi-node cluster (network namespaces)
    megamoe doctor            does the plugin work with the installed Megatron? builds, runs, compares one MoE layer

Everything after the subcommand is handed to it unparsed (``parse_known_args``), so ``megamoe train -h`` shows the
trainer's own help.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import textwrap
from typing import List, Optional, Sequence

from .config import iter_options

__all__ = ["main", "options_table"]


def _option_rows(trainer: str = "core"):
    """(flag, type, default, help) of every MoE option as spelled for `trainer`: core (`megamoe train`),
    megatron (Megatron's own flags where the meaning is the same, else --moe-plugin-*) or fairseq (fairseq's moe
    branch names where the meaning is the same, else --moe-*)."""
    rows = []
    if trainer == "fairseq":
        from .fairseq_adapter.args import DERIVED, moe_fields
        for dest, typ, f in moe_fields():
            rows.append(("--" + dest.replace("_", "-"), typ.__name__, repr(f.default), f.metadata["help"]))
        for name, source in DERIVED.items():
            rows.append((source, "", "", f"{name}: taken from fairseq's own setting"))
        return rows
    if trainer == "megatron":
        from .megatron_adapter.args import DERIVED, SHARED, megatron_flag
        rows.append(("--moe-plugin", "bool", "False", "Use megamoe_plugin's router, dispatch and experts in "
                                                      "Megatron's MoE layers."))
    for opt in iter_options():
        help_text = opt["help"]
        if opt["choices"]:
            help_text += f" Choices: {', '.join(map(str, opt['choices']))}."
        flag, default = opt["flag"], repr(opt["default"])
        if trainer == "megatron" and opt["name"] in DERIVED:      # Megatron's own flag decides it: no type here
            source, how = DERIVED[opt["name"]]
            rows.append((f"{source} -> {opt['name']}", "", "", f"{how}. {help_text}"))
            continue
        if trainer == "megatron":
            flag = megatron_flag(opt["name"])
            if opt["name"] in SHARED:
                default, help_text = "Megatron's", f"{opt['name']}: {help_text}"
        if opt["type"] is bool and flag.startswith("--moe-"):
            flag = f"{flag} / --no-{flag[2:]}"
        rows.append((flag, opt["type"].__name__, default, help_text))
    return rows


def options_table(width: Optional[int] = None, trainer: str = "core") -> str:
    """The MoE options as a plain-text table (flag, type, default, help; choices appended to the help)."""
    rows = _option_rows(trainer)
    head = ("flag", "type", "default", "help")
    w = [max(len(r[i]) for r in rows + [head]) for i in range(3)]
    width = width or shutil.get_terminal_size((140, 24)).columns
    help_w = max(width - sum(w) - 6, 30)
    lines = [f"{head[0]:<{w[0]}}  {head[1]:<{w[1]}}  {head[2]:<{w[2]}}  {head[3]}",
             f"{'-' * w[0]}  {'-' * w[1]}  {'-' * w[2]}  {'-' * min(help_w, 40)}"]
    indent = " " * (sum(w) + 6)
    for flag, typ, default, help_text in rows:
        wrapped = textwrap.wrap(help_text, help_w) or [""]
        lines.append(f"{flag:<{w[0]}}  {typ:<{w[1]}}  {default:<{w[2]}}  {wrapped[0]}")
        lines.extend(indent + more for more in wrapped[1:])
    return "\n".join(lines)


def _options(argv: List[str]) -> int:
    p = argparse.ArgumentParser(prog="megamoe options", description="Print every MoE option (MoEConfig).")
    p.add_argument("--width", type=int, default=None, help="Line width of the table (default: the terminal's).")
    p.add_argument("--trainer", choices=("core", "megatron", "fairseq"), default="core",
                   help="Spell the flags as this trainer takes them: core (megamoe train), megatron "
                        "(pretrain_gpt.py / examples/megatron) or fairseq (fairseq-train --user-dir ...).")
    args = p.parse_args(argv)
    print(options_table(args.width, args.trainer))
    return 0


def _train(argv: List[str]) -> int:
    from . import train
    train.main(argv)
    return 0


def _bench(argv: List[str]) -> int:
    from . import bench
    bench.main(argv)
    return 0


def _topology(argv: List[str]) -> int:
    """Print a topology, its levels and TA-MoE's target dispatch pattern; --measure times it (under torchrun)."""
    import torch
    import torch.distributed as dist

    from .gates import target_dispatch_pattern
    from .topology import Topology

    p = argparse.ArgumentParser(prog="megamoe topology", description=_topology.__doc__)
    p.add_argument("--moe-topology", default="", help="Nested list; default: from WORLD_SIZE / LOCAL_WORLD_SIZE.")
    p.add_argument("--moe-topology-bandwidth-gbps", default="", help="Comma list per level, innermost first.")
    p.add_argument("--moe-topology-latency-us", default="", help="Comma list per level, innermost first.")
    p.add_argument("--measure", action="store_true", help="Ping-pong every rank pair over a gloo group (launch with "
                   "torchrun or megamoe cluster run): infer the nodes from the measured bandwidths (with "
                   "--moe-topology: keep that tree, measure its levels).")
    args = p.parse_args(argv)
    floats = lambda t: [float(v) for v in t.split(",")] if t else None   # noqa: E731
    kw = dict(bandwidth_gbps=floats(args.moe_topology_bandwidth_gbps), latency_us=floats(args.moe_topology_latency_us))
    try:
        topo = Topology.parse(args.moe_topology, **kw) if args.moe_topology else Topology.from_env(**kw)
    except ValueError as err:
        p.error(f"--moe-topology: {err}")
    if args.measure:
        dist.init_process_group("gloo")
        topo = topo.measure() if args.moe_topology else Topology.discover()
        if dist.get_rank() != 0:
            dist.destroy_process_group()
            return 0
        dist.destroy_process_group()
    print(topo)
    print("levels (0 = same rank):")
    print(topo.level_matrix())
    torch.set_printoptions(precision=3)
    print("TA-MoE target dispatch pattern (row i: where rank i's tokens should go):")
    print(target_dispatch_pattern(topo, smoothing=0.0).float())
    return 0


def _perf(argv: List[str]) -> int:
    from .perfmodel import cli as perf_cli
    return perf_cli.main(argv)


def _fairseq_user_dir(argv: List[str]) -> int:
    from .fairseq_adapter import user_dir
    argparse.ArgumentParser(prog="megamoe fairseq-user-dir",
                            description="Print the folder to pass to fairseq's --user-dir.").parse_args(argv)
    print(user_dir())
    return 0


def _trace(argv: List[str]) -> int:
    from . import trace_cli
    trace_cli.main(argv)
    return 0


def _cache_sim(argv: List[str]) -> int:
    from .inference import cli as inference_cli
    inference_cli.cache_sim_main(argv)
    return 0


def _balance(argv: List[str]) -> int:
    from .inference import cli as inference_cli
    inference_cli.balance_main(argv)
    return 0


def _cluster(argv: List[str]) -> int:
    from .cluster import cli as cluster_cli
    return cluster_cli.main(argv)


def _doctor(argv: List[str]) -> int:
    from .megatron_adapter import doctor
    return doctor.main(argv)


def _reproduce(argv: List[str]) -> int:
    from . import reproduce
    reproduce.main(argv)
    return 0


def _results(argv: List[str]) -> int:
    from . import results
    return results.main(argv)


_COMMANDS = {
    "train": (_train, "Train the small MoE GPT language model on the embedded corpus (plain PyTorch, no Megatron)."),
    "bench": (_bench, "Run the MoE benchmarks (megamoe_plugin.bench)."),
    "options": (_options, "Print the table of all MoE options: flag, type, default, help."),
    "fairseq-user-dir": (_fairseq_user_dir, "Print the folder to pass to fairseq-train's --user-dir."),
    "topology": (_topology, "Print (or --measure under torchrun) a topology and TA-MoE's target pattern."),
    "perf": (_perf, "Performance model: profiles, DDL-Roofline, trace simulation, calibration."),
    "trace": (_trace, "Run a trained checkpoint over held-out text; record its routing trace and a heatmap (004)."),
    "cache-sim": (_cache_sim, "Expert-buffering miss rates vs cache size on a trace: LIFO/FIFO/LRU/LFU/Belady (004)."),
    "balance": (_balance, "Greedy / anti-correlation expert placement from a trace; writes --moe-placement-file (004)."),
    "cluster": (_cluster, "An emulated multi-node cluster (network namespaces, shaped links): run a job on it."),
    "doctor": (_doctor, "Check the plugin against the installed Megatron: build, run and compare one MoE layer."),
    "reproduce": (_reproduce, "Regenerate a paper's tables and figures: fastermoe|tamoe|flexmoe|dynamoe|deployment."),
    "results": (_results, "Regenerate (or --check) the results pages' tables and figures from the shipped data."),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megamoe", allow_abbrev=False,
                                description="megamoe-plugin: MoE research systems for Megatron and fairseq.",
                                epilog="'megamoe <command> -h' shows a command's own flags.")
    sub = p.add_subparsers(dest="command", metavar="<command>", required=True)
    for name, (_, help_text) in _COMMANDS.items():
        # add_help=False: -h/--help goes through to the command's own parser
        sub.add_parser(name, help=help_text, description=help_text, add_help=False, allow_abbrev=False)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    ns, rest = parser.parse_known_args(argv[:1])
    rest += argv[1:]             # everything after the subcommand, untouched and in order
    func, _ = _COMMANDS[ns.command]
    try:
        return func(rest)
    except BrokenPipeError:          # output piped into `head` and the like: not an error
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
