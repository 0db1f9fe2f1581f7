#!/usr/bin/env bash
# Full-mode reproduction of every paper: runs `megamoe reproduce <paper>` for each, then assembles
# docs/results.md from the written tables (the figures are copied to docs/figures/<paper>/) and stamps each
# regenerated paper's section with the date and commit; the page's opening (title, summary, references) is kept,
# and `megamoe results` then rewrites the summary from the new tables. The emulated cluster's measured rows come
# from the shipped results of `megamoe bench gates` and `megamoe bench planners` (docs/data/; re-measure them with
# root, see docs/cluster.md, and point CLUSTER_GATES / CLUSTER_PLANNERS at the new folders), DynaMoE's from
# `megamoe bench capacity` (CLUSTER_CAPACITY, a comma list). DynaMoE's Fig. 7 comes from examples/dynamic/spec_vs_coop.py.
#   examples/reproduce/all.sh                 # all papers
#   PAPERS="tamoe dynamoe" examples/reproduce/all.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PAPERS=${PAPERS:-"tamoe fastermoe flexmoe dynamoe deployment"}
OUT=${OUT:-results}
CLUSTER_GATES=${CLUSTER_GATES:-docs/data/bench_gates}
CLUSTER_PLANNERS=${CLUSTER_PLANNERS:-docs/data/bench_planners_fixed_speed/fig5}
CLUSTER_CAPACITY=${CLUSTER_CAPACITY:-docs/data/bench_capacity_fixed_speed.json,docs/data/bench_capacity_2048/results.json,docs/data/bench_capacity_caching/results.json}
mkdir -p "$OUT"
START=$(date +%s)
for p in $PAPERS; do
  echo "== megamoe reproduce $p"
  case $p in
    tamoe|fastermoe) extra=(--cluster-results "$CLUSTER_GATES") ;;
    flexmoe) extra=(--cluster-results "$CLUSTER_PLANNERS") ;;
    dynamoe) extra=(--cluster-results "$CLUSTER_CAPACITY") ;;
    *) extra=() ;;
  esac
  megamoe reproduce "$p" --out "$OUT/$p" "${extra[@]}" | tee "$OUT/$p.log"
  if [ "$p" = dynamoe ]; then
    echo "== DynaMoE Fig. 7: examples/dynamic/spec_vs_coop.py"
    python examples/dynamic/spec_vs_coop.py | tee "$OUT/dynamoe_fig7.txt"
  fi
done
MINUTES=$(( ($(date +%s) - START + 59) / 60 ))
echo "all.sh: $MINUTES minutes for: $PAPERS"
python - "$OUT" "$MINUTES" "$PAPERS" <<'PY'
import datetime, glob, os, shutil, subprocess, sys
out, minutes, papers = sys.argv[1], sys.argv[2], sys.argv[3]
doc = "docs/results.md"
text = open(doc).read() if os.path.exists(doc) else "# Reproduced tables and figures\n"
names = {"tamoe": "TA-MoE (paper 002)", "fastermoe": "FasterMoE (paper 003)", "flexmoe": "FlexMoE (paper 001)",
         "dynamoe": "DynaMoE (paper 000)", "deployment": "MoE deployment (paper 004)"}
headings = {p: f"\n## {title}: `megamoe reproduce {p}`\n" for p, title in names.items()}
first = min((text.index(h) for h in headings.values() if h in text), default=len(text))
parts = [text[:first].rstrip("\n") + "\n"]       # title, summary and references: kept
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "megamoe_plugin"],
                       capture_output=True, text=True).stdout.strip()
stamp = (f"*Generated {datetime.date.today()} at commit `{commit}`{' (with uncommitted changes)' if dirty else ''} "
         f"by `examples/reproduce/all.sh` (full mode; {minutes} minutes for: {papers}) on 2 CPU cores.*\n")
for p, heading in headings.items():
    tables = sorted(glob.glob(os.path.join(out, p, "*.md")))
    if not tables:
        # a paper not run this time (PAPERS=...) keeps its section, and its stamp, as its last run wrote it
        if heading in text:
            start = text.index(heading)
            stop = text.find("\n## ", start + 1)
            parts.append(text[start:stop if stop > 0 else None].rstrip("\n") + "\n")
        continue
    parts += [heading, stamp]
    for t in tables:
        parts.append(open(t).read())
    fig7 = os.path.join(out, "dynamoe_fig7.txt")
    if p == "dynamoe" and os.path.exists(fig7):
        parts.append("### Fig. 7: specification vs cooperation loss (`python examples/dynamic/spec_vs_coop.py`, "
                     "measured here (CPU))\n\n```\n" + open(fig7).read().strip() + "\n```\n")
    figs = sorted(glob.glob(os.path.join(out, p, "*.png")))
    if figs:
        dst = os.path.join("docs", "figures", p)
        os.makedirs(dst, exist_ok=True)
        for f in figs:
            shutil.copy(f, dst)
            parts.append(f"![{os.path.basename(f)}](figures/{p}/{os.path.basename(f)})\n")
open(doc, "w").write("\n".join(parts))
print("wrote", doc)
PY
megamoe results
