"""Benchmarks: `megamoe bench layer` (MoE layer implementations, forward+backward, ratios from one run),
`megamoe bench megatron` (one megatron-core MoE transformer layer, ours vs megatron's, forward+backward),
`megamoe bench schedule` (plain vs smart schedule with expert parallelism, measured and predicted ratios) and
`megamoe bench placement` (static EP vs FasterMoE shadowing vs FlexMoE on a skewed trace: simulator predictions for
the papers' clusters and wall time measured on gloo processes here), `megamoe bench dynamic` (DynaMoE: static vs
dynamic capacity and assignment caching on a real-text LM run) and `megamoe bench inference` (paper 004: static vs
dynamic gating at inference, throughput and activation memory across batch sizes)."""
from typing import List, Optional


def main(argv: Optional[List[str]] = None):
    import sys
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: megamoe bench {layer,megatron,schedule,placement,dynamic,inference} [options]   "
              "(see: megamoe bench layer --help)")
        return None
    what, rest = argv[0], argv[1:]
    if what == "layer":
        from .layer import main as layer_main
        return layer_main(rest)
    if what == "megatron":
        from .megatron import main as megatron_main
        return megatron_main(rest)
    if what == "schedule":
        from .schedule import main as schedule_main
        return schedule_main(rest)
    if what == "placement":
        from .placement import main as placement_main
        return placement_main(rest)
    if what == "dynamic":
        from .dynamic import main as dynamic_main
        return dynamic_main(rest)
    if what == "inference":
        from .inference import main as inference_main
        return inference_main(rest)
    if what == "planners":
        from .planners import main as planners_main
        return planners_main(rest)
    if what == "gates":
        from .gates import main as gates_main
        return gates_main(rest)
    if what == "cluster":
        from .cluster import main as cluster_main
        return cluster_main(rest)
    raise SystemExit(f"megamoe bench: unknown benchmark {what!r}; known: layer, megatron, schedule, placement, "
                     "dynamic, inference, cluster, gates, planners")
