"""`megamoe reproduce <paper>`: regenerate each paper's headline tables and figures from this repository.

    megamoe reproduce fastermoe|tamoe|flexmoe|dynamoe|deployment [--fast] [--out DIR]

Each paper is a module here with ``run(out_dir: str, fast: bool, log=print) -> dict`` that writes its tables
(``<name>.md``, every row labelled with how it was obtained: ``common.py``) and figures (``<name>.png``) into
``out_dir``, prints the tables, and returns {"tables": [paths], "figures": [paths]}. ``--fast`` is the CI mode:
small sizes on the shipped traces (``megamoe_plugin/data/traces``, made by ``examples/reproduce/make_traces.sh``).
"""
from __future__ import annotations

import argparse
import importlib
from typing import List, Optional

PAPERS = {
    "fastermoe": "FasterMoE (paper 003): performance model accuracy, shadowing, smart schedule, Hir gate",
    "tamoe": "TA-MoE (paper 002): even vs uneven dispatch on a two-level topology, topology-aware loss",
    "flexmoe": "FlexMoE (paper 001): cost-model error, token/expert efficiency, drops vs quality, scaling",
    "dynamoe": "DynaMoE (paper 000): static vs dynamic capacity trade-off, cached fraction over training",
    "deployment": "MoE deployment (paper 004): dynamic vs static gating, expert-cache miss rates, load balancing",
}


def main(argv: Optional[List[str]] = None) -> dict:
    p = argparse.ArgumentParser(prog="megamoe reproduce", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(f"  {k:<11} {v}" for k, v in PAPERS.items()))
    p.add_argument("paper", choices=sorted(PAPERS))
    p.add_argument("--fast", action="store_true", help="small sizes on the shipped traces (minutes; the CI test)")
    p.add_argument("--out", default=None, help="output folder (default: results/<paper>)")
    p.add_argument("--cluster-results", default=None, metavar="DIR",
                   help="tamoe, fastermoe: add the rows measured on the emulated cluster by `megamoe bench gates "
                        "--out DIR`; flexmoe: by `megamoe bench planners --out DIR` (Fig. 5); dynamoe: a comma "
                        "list of `megamoe bench capacity` results (folders or results.json files)")
    p.add_argument("--seeds", type=int, default=None, metavar="N",
                   help="dynamoe: run Fig. 9 over N seeds (default 3 in full mode, 1 with --fast)")
    args = p.parse_args(argv)
    if args.seeds is not None and (args.paper != "dynamoe" or args.seeds < 1):
        p.error("--seeds: a number >= 1, for dynamoe only")
    mod = importlib.import_module(f"{__name__}.{args.paper}")
    if args.cluster_results and args.paper not in ("tamoe", "fastermoe", "flexmoe", "dynamoe"):
        p.error("--cluster-results: for tamoe, fastermoe, flexmoe and dynamoe only")
    if args.paper == "dynamoe":
        return mod.run(args.out or f"results/{args.paper}", args.fast, seeds=args.seeds,
                       cluster_results=args.cluster_results)
    if args.cluster_results:
        return mod.run(args.out or f"results/{args.paper}", args.fast, cluster_results=args.cluster_results)
    return mod.run(args.out or f"results/{args.paper}", args.fast)
