"""A synthetic parallel corpus for translation smoke tests: a deterministic string transformation.

Source: space-separated symbols ``a``..``z`` (3-12 per sentence). Target: the source reversed with every symbol
shifted by one letter (``a b c`` -> ``d c b``). A translation model learns it in a few hundred CPU updates, so a
tiny MoE transformer can be trained and decoded with ``fairseq-generate`` in a test. Written as
``{train,valid,test}.{src,tgt}`` for ``fairseq-preprocess --source-lang src --target-lang tgt``.
"""
from __future__ import annotations

import random
import string
from pathlib import Path
from typing import Dict, List, Tuple

SYMBOLS = string.ascii_lowercase


def transform(tokens: List[str]) -> List[str]:
    """The target of a source sentence: reversed, each symbol shifted by one (z wraps to a)."""
    return [SYMBOLS[(SYMBOLS.index(t) + 1) % len(SYMBOLS)] for t in reversed(tokens)]


def make_pairs(n: int, seed: int, min_len: int = 3, max_len: int = 12) -> List[Tuple[str, str]]:
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        src = [rng.choice(SYMBOLS) for _ in range(rng.randint(min_len, max_len))]
        pairs.append((" ".join(src), " ".join(transform(src))))
    return pairs


def write_parallel_corpus(out_dir, n_train: int = 2000, n_valid: int = 100, n_test: int = 50,
                          seed: int = 0) -> Dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for i, (split, n) in enumerate((("train", n_train), ("valid", n_valid), ("test", n_test))):
        pairs = make_pairs(n, seed * 1000 + i)
        for side, idx in (("src", 0), ("tgt", 1)):
            path = out / f"{split}.{side}"
            path.write_text("".join(p[idx] + "\n" for p in pairs), encoding="utf-8")
            written[path.name] = path
    return written


def main(argv=None) -> None:
    import argparse
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--train", type=int, default=2000)
    p.add_argument("--valid", type=int, default=100)
    p.add_argument("--test", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    for name, path in write_parallel_corpus(a.out_dir, a.train, a.valid, a.test, a.seed).items():
        print(path)


if __name__ == "__main__":
    main()
