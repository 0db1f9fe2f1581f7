"""Benchmarks (``megamoe bench <name> -h`` for each one's flags): every number they print is measured in one run,
with ratios from interleaved rounds; see BENCHMARKS.md for the results on this project's machines."""
from typing import List, Optional


BENCHMARKS = {
    "layer": ("layer", "MoE layer implementations on identical inputs, forward+backward (CPU, or --device cuda)"),
    "megatron": ("megatron", "one megatron-core MoE transformer layer: ours vs megatron-core's, forward+backward"),
    "schedule": ("schedule", "plain vs smart schedule with expert parallelism, measured and predicted ratios"),
    "placement": ("placement", "static EP vs FasterMoE shadowing vs FlexMoE on a skewed trace (model + gloo)"),
    "dynamic": ("dynamic", "DynaMoE: static vs dynamic capacity and assignment caching on a real-text LM run"),
    "inference": ("inference", "paper 004: static vs dynamic gating at inference, throughput and memory"),
    "cluster": ("cluster", "a reference MoE layer on the emulated cluster: compute / all-to-all split, predictions"),
    "gates": ("gates", "gshard / ta_moe / hir trained on the emulated cluster: off-node share, time to target"),
    "planners": ("planners", "static / capacity / shadow / flexmoe / eplb placement on the emulated cluster"),
    "capacity": ("capacity", "DynaMoE: static capacity factors vs dynamic capacity vs dropless on the emulated cluster"),
}


def usage() -> str:
    width = max(map(len, BENCHMARKS))
    lines = ["usage: megamoe bench <benchmark> [options]      (megamoe bench <benchmark> -h: its options)", "",
             "benchmarks:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in BENCHMARKS.items()]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None):
    import importlib
    import sys
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return None
    what, rest = argv[0], argv[1:]
    if what not in BENCHMARKS:
        raise SystemExit(f"megamoe bench: unknown benchmark {what!r}; known: {', '.join(BENCHMARKS)}")
    module = importlib.import_module(f"{__name__}.{BENCHMARKS[what][0]}")
    return module.main(rest)
