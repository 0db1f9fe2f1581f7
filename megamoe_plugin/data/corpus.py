"""Embedded default corpus: multi-domain text read at run time from the local machine.

Nothing here ships text.  The corpus is built on the fly from files that are already
present on every machine that can run this project:

* ``python-code`` -- the ``.py`` sources of the running interpreter's standard library
  (``sysconfig.get_paths()['stdlib']``), without ``site-packages``/``dist-packages``,
  test suites (``test/``, ``tests/``, ``idle_test/``), ``idlelib``, ``encodings`` (mostly
  generated codec tables), ``__pycache__`` and build-configuration folders.
* ``python-docs`` -- English prose shipped with the standard library: the help topics of
  ``pydoc_data/topics.py`` (one document per topic) plus the few ``.rst``/``.txt`` files
  outside the excluded folders.
* ``fortunes-<lang>`` -- optional, only where Debian's fortune files exist
  (``/usr/share/games/fortunes``): files at the top level are ``fortunes-en`` (except the
  few known non-English ones Debian puts there: ``chinese``/``song100``/``tang300`` are
  ``zh``, ``brasil``/``mario.*`` are ``pt``), files in a language sub-folder (``fr/``,
  ``de/``, ``zh_CN/`` ...) are ``fortunes-<language>``; ``off/`` (offensive) and encoding
  variants (``eo-iso3/``, ``*.u8``) are skipped.  One document per fortune.

Every document carries a domain label so that later work can check whether experts
specialise per domain.

Determinism: sources are discovered in sorted order; the split of a document
(train/valid/test) is a pure function of its key (a hash of ``domain:relative/path`` or
``domain:relative/path#item``) and does not depend on the seed; the seed only decides which
documents are kept under the ``max_bytes`` cap and in what order they appear.  Under a cap
the documents are drawn domain-balanced (the domain with the fewest bytes so far is served
next), so a small CPU run still sees every domain.

Tokenization is byte level (:class:`ByteTokenizer`): ids 0..255 are the UTF-8 bytes,
followed by a few special ids (``<eod>`` ends every document in the token stream).

Sample indexing is stable: for a split with token tensor ``t`` and a sequence length ``T``,
sample ``i`` is ``t[i*T : i*T + T + 1]`` (input = first ``T`` tokens, target = last ``T``).

Nothing is cached in the repository; pass ``cache_dir`` to :func:`build_corpus` to keep a
JSON cache of the selected documents in a directory of your choosing.
"""

from __future__ import annotations

import ast
import fnmatch
import hashlib
import json
import os
import random
import sys
import sysconfig
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch

__all__ = [
    "SPLITS",
    "DOMAIN_PYTHON_CODE",
    "DOMAIN_PYTHON_DOCS",
    "FORTUNES_PREFIX",
    "DEFAULT_FORTUNES_DIR",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_DOC_BYTES",
    "EOD_ID",
    "PAD_ID",
    "VOCAB_SIZE",
    "ByteTokenizer",
    "Document",
    "CorpusSplit",
    "Corpus",
    "assign_split",
    "default_stdlib_dir",
    "build_corpus",
    "iterate_batches",
    "write_text_splits",
]

PathLike = Union[str, "os.PathLike[str]"]

SPLITS: Tuple[str, str, str] = ("train", "valid", "test")

DOMAIN_PYTHON_CODE = "python-code"
DOMAIN_PYTHON_DOCS = "python-docs"
FORTUNES_PREFIX = "fortunes-"
DEFAULT_FORTUNES_DIR = "/usr/share/games/fortunes"

#: Default cap on the total number of document bytes (all splits together).
DEFAULT_MAX_BYTES = 4 * 1024 * 1024
#: Longer documents are cut at a line boundary to at most this many bytes.
DEFAULT_MAX_DOC_BYTES = 32 * 1024

#: Bumped whenever the selection/normalisation rules change (invalidates caches).
CORPUS_FORMAT_VERSION = 1

# --------------------------------------------------------------------------- tokenizer

EOD_ID = 256
PAD_ID = 257
VOCAB_SIZE = 258


class ByteTokenizer:
    """Byte-level tokenizer: ids 0..255 are UTF-8 bytes, then special tokens.

    ``decode(encode(s)) == s`` for every ``str`` ``s``.  No vocabulary file, no download.
    """

    num_bytes = 256
    eod_id = EOD_ID
    pad_id = PAD_ID
    vocab_size = VOCAB_SIZE
    special_tokens: Mapping[str, int] = {"<eod>": EOD_ID, "<pad>": PAD_ID}

    def encode(self, text: str, *, add_eod: bool = False) -> torch.Tensor:
        """UTF-8 bytes of ``text`` as a 1-D ``torch.long`` tensor (plus ``<eod>`` if asked)."""
        data = text.encode("utf-8")
        ids = _bytes_to_tensor(data)
        if add_eod:
            ids = torch.cat([ids, torch.tensor([EOD_ID], dtype=torch.long)])
        return ids

    def decode(
        self,
        ids: Union[torch.Tensor, Sequence[int]],
        *,
        skip_special: bool = True,
        errors: str = "replace",
    ) -> str:
        """Inverse of :meth:`encode`.

        Special ids are dropped (``skip_special=True``) or rendered by name (``<eod>``).
        ``errors`` is passed to ``bytes.decode`` (model samples may cut a UTF-8 sequence).
        """
        if isinstance(ids, torch.Tensor):
            seq = ids.reshape(-1).tolist()
        else:
            seq = [int(i) for i in ids]
        names = {v: k for k, v in self.special_tokens.items()}
        out: List[str] = []
        buf = bytearray()
        for i in seq:
            if 0 <= i < 256:
                buf.append(i)
                continue
            if i not in names:
                raise ValueError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
            if not skip_special:
                out.append(buf.decode("utf-8", errors=errors))
                buf = bytearray()
                out.append(names[i])
        out.append(buf.decode("utf-8", errors=errors))
        return "".join(out)

    def __repr__(self) -> str:  # pragma: no cover - cosmetic
        return f"ByteTokenizer(vocab_size={self.vocab_size}, eod_id={self.eod_id}, pad_id={self.pad_id})"


def _bytes_to_tensor(data: bytes) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.long)


# --------------------------------------------------------------------------- documents


@dataclass(frozen=True)
class Document:
    """One corpus document.  ``key`` is ``"<domain>:<relative path>[#<item>]"``."""

    key: str
    domain: str
    split: str
    text: str

    @property
    def num_bytes(self) -> int:
        return len(self.text.encode("utf-8"))


def assign_split(key: str, valid_fraction: float = 0.05, test_fraction: float = 0.05) -> str:
    """Deterministic train/valid/test assignment of a document key (seed independent)."""
    if valid_fraction < 0 or test_fraction < 0 or valid_fraction + test_fraction >= 1:
        raise ValueError("need 0 <= valid_fraction, test_fraction and valid+test < 1")
    digest = hashlib.sha1(key.encode("utf-8")).digest()
    u = int.from_bytes(digest[:8], "big") / 2.0**64
    if u < test_fraction:
        return "test"
    if u < test_fraction + valid_fraction:
        return "valid"
    return "train"


def default_stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


# Folders never descended into (matched against each path component).
_EXCLUDED_DIRS = frozenset(
    {
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "site-packages",
        "dist-packages",
        "__pycache__",
        "encodings",
        "lib-dynload",
        "ensurepip",
        "_bundled",
    }
)
_EXCLUDED_DIR_PREFIXES = ("config-", ".")
_DOC_SUFFIXES = (".rst", ".txt")
_TOPICS_RELPATH = "pydoc_data/topics.py"


@dataclass(frozen=True)
class _Source:
    kind: str  # "py" | "doc" | "topics" | "fortune"
    domain: str
    rel: str  # posix relative path (stable key part)
    path: str


@dataclass
class _Candidate:
    key: str
    domain: str
    path: Optional[str] = None  # lazily read when text is None
    text: Optional[str] = None


def _excluded_dir(name: str) -> bool:
    return name in _EXCLUDED_DIRS or name.startswith(_EXCLUDED_DIR_PREFIXES)


def _discover_stdlib(stdlib_dir: Path) -> List[_Source]:
    sources: List[_Source] = []
    if not stdlib_dir.is_dir():
        return sources
    for root, dirnames, filenames in os.walk(stdlib_dir, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not _excluded_dir(d))
        rel_root = Path(root).relative_to(stdlib_dir)
        for fname in sorted(filenames):
            path = Path(root) / fname
            rel = (rel_root / fname).as_posix()
            if not path.is_file():
                continue
            if rel == _TOPICS_RELPATH:
                sources.append(_Source("topics", DOMAIN_PYTHON_DOCS, rel, str(path)))
            elif fname.endswith(".py"):
                if fname.startswith(("_sysconfigdata", "test_")):
                    continue
                sources.append(_Source("py", DOMAIN_PYTHON_CODE, rel, str(path)))
            elif fname.endswith(_DOC_SUFFIXES) and "Grammar" not in fname:
                sources.append(_Source("doc", DOMAIN_PYTHON_DOCS, rel, str(path)))
    return sources


def _lang_code(dirname: str) -> Optional[str]:
    """``"fr"`` for ``fr/``, ``"zh"`` for ``zh_CN/``; ``None`` for ``off/``, ``eo-iso3/`` etc."""
    base = dirname.split("_", 1)[0]
    if dirname == "off" or not (2 <= len(base) <= 3 and base.isascii() and base.isalpha() and base.islower()):
        return None
    return base


# Debian installs a few non-English fortune files at the top level (fortunes-zh, -br, -mario).
_TOPLEVEL_FORTUNE_LANGS = {"chinese": "zh", "song100": "zh", "tang300": "zh", "brasil": "pt"}
_TOPLEVEL_FORTUNE_PREFIX_LANGS = {"mario.": "pt"}
_FORTUNE_SKIP_SUFFIXES = (".dat", ".u8", ".pdat", ".sh", ".gz", ".tmp")


def _fortune_domain(rel_parts: Tuple[str, ...]) -> Optional[str]:
    if len(rel_parts) == 1:
        name = rel_parts[0]
        lang = _TOPLEVEL_FORTUNE_LANGS.get(name)
        for prefix, code in _TOPLEVEL_FORTUNE_PREFIX_LANGS.items():
            if name.startswith(prefix):
                lang = code
        return FORTUNES_PREFIX + (lang or "en")
    if len(rel_parts) == 2:
        lang = _lang_code(rel_parts[0])
        return FORTUNES_PREFIX + lang if lang else None
    return None


def _discover_fortunes(fortunes_dir: Path) -> List[_Source]:
    """Fortune files: top level (English unless known otherwise) and one level of language
    folders; ``off/`` (offensive, often rot13), index files and encoding variants are skipped.
    Symlinks are labelled and keyed by the file they point to, and read once."""
    sources: List[_Source] = []
    if not fortunes_dir.is_dir():
        return sources
    real_root = fortunes_dir.resolve()
    seen: set = set()
    for root, dirnames, filenames in os.walk(fortunes_dir, followlinks=False):
        rel_root = Path(root).relative_to(fortunes_dir)
        if rel_root.parts:
            dirnames[:] = []  # one level of language folders only
        else:
            dirnames[:] = sorted(d for d in dirnames if _lang_code(d))
        for fname in sorted(filenames):
            if fname.startswith(".") or fname.endswith(_FORTUNE_SKIP_SUFFIXES):
                continue
            path = Path(root) / fname
            try:
                real = path.resolve()
                if not real.is_file():
                    continue
            except OSError:
                continue
            try:
                rel = real.relative_to(real_root)
            except ValueError:  # points outside the tree: label by where the link lives
                rel = rel_root / fname
            if real in seen or rel.name.endswith(_FORTUNE_SKIP_SUFFIXES):
                continue
            domain = _fortune_domain(rel.parts)
            if domain is None:
                continue
            seen.add(real)
            sources.append(_Source("fortune", domain, rel.as_posix(), str(real)))
    return sources


def _read_text(path: str) -> str:
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("latin-1")
    return _normalize(text)


def _normalize(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\x00", "")
    if text.startswith("\ufeff"):
        text = text[1:]
    return text.strip("\n") + "\n" if text.strip() else ""


def _truncate(text: str, max_bytes: int) -> str:
    """Cut ``text`` to at most ``max_bytes`` UTF-8 bytes, at a line boundary when possible."""
    data = text.encode("utf-8")
    if len(data) <= max_bytes:
        return text
    if max_bytes <= 0:
        return ""
    head = data[:max_bytes]
    cut = head.rfind(b"\n")
    if cut >= 0:
        head = head[: cut + 1]
    out = head.decode("utf-8", errors="ignore")
    return out if out.strip() else ""


def _expand(sources: Sequence[_Source]) -> List[_Candidate]:
    cands: List[_Candidate] = []
    for src in sources:
        if src.kind in ("py", "doc"):
            cands.append(_Candidate(f"{src.domain}:{src.rel}", src.domain, path=src.path))
        elif src.kind == "topics":
            for name, text in _read_pydoc_topics(src.path):
                cands.append(_Candidate(f"{src.domain}:{src.rel}#{name}", src.domain, text=text))
        elif src.kind == "fortune":
            for i, text in enumerate(_read_fortunes(src.path)):
                cands.append(_Candidate(f"{src.domain}:{src.rel}#{i}", src.domain, text=text))
    return cands


def _read_pydoc_topics(path: str) -> List[Tuple[str, str]]:
    """The ``topics`` dict of ``pydoc_data/topics.py``, parsed (never imported/executed)."""
    try:
        src = Path(path).read_text(encoding="utf-8")
        tree = ast.parse(src)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return []
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id == "topics"
        ):
            try:
                topics = ast.literal_eval(node.value)
            except ValueError:
                return []
            if not isinstance(topics, dict):
                return []
            out = []
            for name in sorted(topics):
                text = _normalize(str(topics[name]))
                if text:
                    out.append((str(name), text))
            return out
    return []


def _read_fortunes(path: str) -> List[str]:
    try:
        text = _read_text(path)
    except OSError:
        return []
    out: List[str] = []
    chunk: List[str] = []
    for line in text.split("\n"):
        if line.rstrip() == "%":
            item = _normalize("\n".join(chunk))
            if item:
                out.append(item)
            chunk = []
        else:
            chunk.append(line)
    item = _normalize("\n".join(chunk))
    if item:
        out.append(item)
    return out


def _domain_order(domains: Sequence[str]) -> List[str]:
    base = [d for d in (DOMAIN_PYTHON_CODE, DOMAIN_PYTHON_DOCS) if d in domains]
    rest = sorted(d for d in set(domains) if d not in base)
    return base + rest


def _split_budgets(
    max_bytes: Optional[int], valid_fraction: float, test_fraction: float
) -> Dict[str, Optional[int]]:
    if max_bytes is None:
        return {s: None for s in SPLITS}
    valid = int(max_bytes * valid_fraction)
    test = int(max_bytes * test_fraction)
    return {"train": max_bytes - valid - test, "valid": valid, "test": test}


def _select(
    cands: Sequence[_Candidate],
    split: str,
    budget: Optional[int],
    domains: Sequence[str],
    seed: int,
    max_doc_bytes: Optional[int],
) -> List[Document]:
    """Domain-balanced, seeded selection of documents of one split under a byte budget."""
    pools: Dict[str, deque] = {}
    for d in domains:
        items = sorted((c for c in cands if c.domain == d), key=lambda c: c.key)
        random.Random(f"megamoe-corpus/{seed}/{split}/{d}").shuffle(items)
        if items:
            pools[d] = deque(items)
    rank = {d: i for i, d in enumerate(domains)}
    used = {d: 0 for d in pools}
    remaining = budget
    docs: List[Document] = []
    while pools and (remaining is None or remaining > 0):
        d = min(pools, key=lambda name: (used[name], rank[name]))
        cand = pools[d].popleft()
        if not pools[d]:
            del pools[d]
        try:
            text = cand.text if cand.text is not None else _read_text(cand.path)  # type: ignore[arg-type]
        except OSError:
            continue
        if max_doc_bytes is not None:
            text = _truncate(text, max_doc_bytes)
        if not text:
            continue
        nbytes = len(text.encode("utf-8"))
        if remaining is not None and nbytes > remaining:
            text = _truncate(text, remaining)
            if text:
                docs.append(Document(cand.key, d, split, text))
            break  # budget exhausted (up to less than one line)
        docs.append(Document(cand.key, d, split, text))
        used[d] += nbytes
        if remaining is not None:
            remaining -= nbytes
    return docs


# --------------------------------------------------------------------------- batching


def iterate_batches(
    tokens: torch.Tensor,
    batch_size: int,
    seq_len: int,
    generator: Optional[torch.Generator] = None,
    *,
    shuffle: Optional[bool] = None,
    drop_last: bool = False,
) -> Iterator[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One pass over the samples of a 1-D token tensor.

    Sample ``i`` is ``tokens[i*seq_len : i*seq_len + seq_len + 1]``; there are
    ``(len(tokens) - 1) // seq_len`` samples.  Yields ``(input, target, sample_index)`` with
    shapes ``[B, seq_len]``, ``[B, seq_len]``, ``[B]`` (``torch.long``).  Samples come in a
    random order drawn from ``generator`` when ``shuffle`` (default: ``generator is not None``),
    otherwise in index order.  The last, smaller batch is kept unless ``drop_last``.
    """
    if batch_size <= 0 or seq_len <= 0:
        raise ValueError("batch_size and seq_len must be positive")
    if tokens.dim() != 1:
        raise ValueError("tokens must be a 1-D tensor")
    n = max((tokens.numel() - 1) // seq_len, 0)
    if shuffle is None:
        shuffle = generator is not None
    if shuffle:
        order = torch.randperm(n, generator=generator)
    else:
        order = torch.arange(n)
    offsets = torch.arange(seq_len + 1)
    for start in range(0, n, batch_size):
        idx = order[start : start + batch_size]
        if drop_last and idx.numel() < batch_size:
            break
        windows = tokens[idx[:, None] * seq_len + offsets]
        yield windows[:, :-1], windows[:, 1:], idx.to(torch.long)


# --------------------------------------------------------------------------- corpus


@dataclass
class CorpusSplit:
    """Token stream of one split.

    ``tokens`` and ``token_domains`` are 1-D ``torch.long`` tensors of equal length; every
    document is followed by an ``<eod>`` token, which carries its document's domain.
    Document ``j`` occupies ``tokens[doc_offsets[j] : doc_offsets[j+1]]`` (``<eod>`` included).
    """

    name: str
    tokens: torch.Tensor
    token_domains: torch.Tensor
    doc_offsets: torch.Tensor
    doc_domains: torch.Tensor
    doc_keys: Tuple[str, ...]

    def __len__(self) -> int:
        return int(self.tokens.numel())

    def num_samples(self, seq_len: int) -> int:
        return max((self.tokens.numel() - 1) // seq_len, 0)

    def sample(self, index: int, seq_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
        n = self.num_samples(seq_len)
        if not 0 <= index < n:
            raise IndexError(f"sample {index} out of range for {n} samples of {self.name}")
        window = self.tokens[index * seq_len : index * seq_len + seq_len + 1]
        return window[:-1], window[1:]

    def sample_token_domains(self, sample_index: torch.Tensor, seq_len: int) -> torch.Tensor:
        """Domain ids of the input positions of samples ``sample_index`` (``[..., seq_len]``)."""
        idx = torch.as_tensor(sample_index, dtype=torch.long)
        return self.token_domains[idx[..., None] * seq_len + torch.arange(seq_len)]


class Corpus:
    """The embedded default corpus (see the module docstring)."""

    def __init__(
        self,
        documents: Sequence[Document],
        domains: Sequence[str],
        config: Mapping[str, object],
        tokenizer: Optional[ByteTokenizer] = None,
    ) -> None:
        self.documents: Tuple[Document, ...] = tuple(documents)
        self.domains: Tuple[str, ...] = tuple(domains)
        self.config: Dict[str, object] = dict(config)
        self.tokenizer = tokenizer or ByteTokenizer()
        self.seed = int(self.config.get("seed", 0))  # type: ignore[arg-type]
        self._domain_index = {d: i for i, d in enumerate(self.domains)}
        self.splits: Dict[str, CorpusSplit] = {s: self._build_split(s) for s in SPLITS}

    def _build_split(self, split: str) -> CorpusSplit:
        docs = [d for d in self.documents if d.split == split]
        tok_parts, dom_parts, offsets = [], [], [0]
        eod = torch.tensor([EOD_ID], dtype=torch.long)
        for doc in docs:
            ids = torch.cat([_bytes_to_tensor(doc.text.encode("utf-8")), eod])
            tok_parts.append(ids)
            dom_parts.append(torch.full((ids.numel(),), self._domain_index[doc.domain], dtype=torch.long))
            offsets.append(offsets[-1] + ids.numel())
        empty = torch.empty(0, dtype=torch.long)
        return CorpusSplit(
            name=split,
            tokens=torch.cat(tok_parts) if tok_parts else empty,
            token_domains=torch.cat(dom_parts) if dom_parts else empty.clone(),
            doc_offsets=torch.tensor(offsets, dtype=torch.long),
            doc_domains=torch.tensor([self._domain_index[d.domain] for d in docs], dtype=torch.long),
            doc_keys=tuple(d.key for d in docs),
        )

    # -- convenience accessors -------------------------------------------------------
    @property
    def train(self) -> torch.Tensor:
        return self.splits["train"].tokens

    @property
    def valid(self) -> torch.Tensor:
        return self.splits["valid"].tokens

    @property
    def test(self) -> torch.Tensor:
        return self.splits["test"].tokens

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def eod_id(self) -> int:
        return self.tokenizer.eod_id

    def split(self, name: str) -> CorpusSplit:
        if name not in self.splits:
            raise KeyError(f"unknown split {name!r}; expected one of {SPLITS}")
        return self.splits[name]

    def domain_id(self, name: str) -> int:
        return self._domain_index[name]

    def token_domains(self, split: str) -> torch.Tensor:
        return self.split(split).token_domains

    def split_documents(self, split: str) -> List[Document]:
        return [d for d in self.documents if d.split == split]

    # -- samples ---------------------------------------------------------------------
    def num_samples(self, split: str, seq_len: int) -> int:
        return self.split(split).num_samples(seq_len)

    def sample(self, split: str, index: int, seq_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.split(split).sample(index, seq_len)

    def sample_token_domains(self, split: str, sample_index: torch.Tensor, seq_len: int) -> torch.Tensor:
        return self.split(split).sample_token_domains(sample_index, seq_len)

    def batches(
        self,
        split: str,
        batch_size: int,
        seq_len: int,
        generator: Optional[torch.Generator] = None,
        *,
        shuffle: Optional[bool] = None,
        drop_last: bool = False,
    ) -> Iterator[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """One epoch of ``(input, target, sample_index)``; see :func:`iterate_batches`.

        With ``shuffle=True`` and no generator, a generator seeded with the corpus seed is used.
        """
        if shuffle is None:
            shuffle = generator is not None
        if shuffle and generator is None:
            generator = torch.Generator().manual_seed(self.seed)
        return iterate_batches(
            self.split(split).tokens, batch_size, seq_len, generator, shuffle=shuffle, drop_last=drop_last
        )

    # -- reporting -------------------------------------------------------------------
    def stats(self) -> Dict[str, Dict[str, Dict[str, int]]]:
        """``{split: {domain: {"docs": n, "bytes": b}}}``."""
        out: Dict[str, Dict[str, Dict[str, int]]] = {s: {} for s in SPLITS}
        for doc in self.documents:
            entry = out[doc.split].setdefault(doc.domain, {"docs": 0, "bytes": 0})
            entry["docs"] += 1
            entry["bytes"] += doc.num_bytes
        return out

    def describe(self) -> str:
        lines = [f"Corpus: vocab_size={self.vocab_size} domains={list(self.domains)}"]
        for split, per_dom in self.stats().items():
            parts = ", ".join(f"{d}={v['docs']}docs/{v['bytes']}B" for d, v in per_dom.items())
            lines.append(f"  {split}: {self.splits[split].tokens.numel()} tokens ({parts})")
        return "\n".join(lines)

    def __repr__(self) -> str:
        sizes = ", ".join(f"{s}={self.splits[s].tokens.numel()}" for s in SPLITS)
        return f"Corpus({sizes}, domains={list(self.domains)})"


def _fingerprint(sources: Sequence[_Source], config: Mapping[str, object]) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(config, sort_keys=True).encode("utf-8"))
    for src in sources:
        try:
            st = os.stat(src.path)
            meta = (st.st_size, st.st_mtime_ns)
        except OSError:
            meta = (-1, -1)
        h.update(f"{src.kind}\0{src.domain}\0{src.rel}\0{src.path}\0{meta}\n".encode("utf-8"))
    return h.hexdigest()


def build_corpus(
    max_bytes: Optional[int] = DEFAULT_MAX_BYTES,
    seed: int = 0,
    include_fortunes: bool = True,
    *,
    valid_fraction: float = 0.05,
    test_fraction: float = 0.05,
    max_doc_bytes: Optional[int] = DEFAULT_MAX_DOC_BYTES,
    stdlib_dir: Optional[PathLike] = None,
    fortunes_dir: Optional[PathLike] = None,
    domains: Optional[Sequence[str]] = None,
    cache_dir: Optional[PathLike] = None,
) -> Corpus:
    """Build the default corpus from the local standard library (and fortunes, if present).

    ``max_bytes`` caps the total UTF-8 bytes of all documents of all splits (``None``: no
    cap); it is shared between splits as ``valid_fraction``/``test_fraction``/rest.
    ``seed`` picks which documents are kept under the cap and their order; a document's
    split depends only on its key.  ``cache_dir`` (optional) keeps a JSON cache of the
    selected documents, keyed by the arguments and the sources' sizes and mtimes.
    ``domains`` (optional) keeps only the domains matching these ``fnmatch`` patterns, e.g.
    ``("python-*", "fortunes-en")``.  Under a cap, documents are drawn domain-balanced, so
    with many fortune languages installed each domain gets a smaller share.
    """
    if max_bytes is not None and max_bytes < 0:
        raise ValueError("max_bytes must be >= 0 or None")
    if max_doc_bytes is not None and max_doc_bytes <= 0:
        raise ValueError("max_doc_bytes must be > 0 or None")
    assign_split("", valid_fraction, test_fraction)  # validates the fractions
    if isinstance(domains, str):
        raise TypeError("domains must be a sequence of patterns, not a string")
    std = Path(stdlib_dir) if stdlib_dir is not None else default_stdlib_dir()
    fdir = Path(fortunes_dir) if fortunes_dir is not None else Path(DEFAULT_FORTUNES_DIR)

    sources = _discover_stdlib(std)
    if include_fortunes:
        sources += _discover_fortunes(fdir)
    patterns = tuple(domains) if domains is not None else None
    if patterns is not None:
        sources = [s for s in sources if any(fnmatch.fnmatchcase(s.domain, p) for p in patterns)]

    config: Dict[str, object] = {
        "format_version": CORPUS_FORMAT_VERSION,
        "max_bytes": max_bytes,
        "seed": int(seed),
        "include_fortunes": bool(include_fortunes),
        "valid_fraction": valid_fraction,
        "test_fraction": test_fraction,
        "max_doc_bytes": max_doc_bytes,
        "stdlib_dir": str(std),
        "fortunes_dir": str(fdir) if include_fortunes else None,
        "domains": list(patterns) if patterns is not None else None,
        "python_version": sys.version.split()[0],
    }

    cache_file: Optional[Path] = None
    if cache_dir is not None:
        cache_file = Path(cache_dir) / f"megamoe-corpus-{_fingerprint(sources, config)[:24]}.json"
        if cache_file.is_file():
            try:
                payload = json.loads(cache_file.read_text(encoding="utf-8"))
                docs = [Document(*row) for row in payload["documents"]]
                return Corpus(docs, payload["domains"], payload["config"])
            except (OSError, ValueError, KeyError, TypeError):
                pass  # unreadable cache: rebuild and overwrite

    cands = _expand(sources)
    domain_names = _domain_order([c.domain for c in cands])
    by_split: Dict[str, List[_Candidate]] = {s: [] for s in SPLITS}
    for c in cands:
        by_split[assign_split(c.key, valid_fraction, test_fraction)].append(c)
    budgets = _split_budgets(max_bytes, valid_fraction, test_fraction)
    docs: List[Document] = []
    for split in SPLITS:
        docs += _select(by_split[split], split, budgets[split], domain_names, int(seed), max_doc_bytes)

    corpus = Corpus(docs, domain_names, config)
    if cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "config": config,
            "domains": list(domain_names),
            "documents": [[d.key, d.domain, d.split, d.text] for d in docs],
        }
        tmp = cache_file.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(payload, ensure_ascii=False), encoding="utf-8")
        os.replace(tmp, cache_file)
    return corpus


# --------------------------------------------------------------------------- export


def write_text_splits(
    out_dir: PathLike,
    corpus: Optional[Corpus] = None,
    *,
    formats: Sequence[str] = ("txt", "jsonl"),
    **build_kwargs,
) -> Dict[str, Path]:
    """Write the splits as files that fairseq / Megatron preprocessing read.

    * ``{split}.txt`` -- fairseq raw text: each document's non-blank lines, documents
      separated by one empty line (for ``fairseq-preprocess --only-source --trainpref
      out/train.txt`` and ``--sample-break-mode complete_doc``).
    * ``{split}.jsonl`` -- Megatron loose JSON, one document per line, lossless:
      ``{"text": ..., "domain": ..., "key": ...}`` (``tools/preprocess_data.py
      --json-keys text``).
    * ``corpus_info.json`` -- domains, build config and per-split statistics.

    Builds the corpus with ``build_kwargs`` when ``corpus`` is not given.  Returns
    ``{file name: path}``.
    """
    if corpus is None:
        corpus = build_corpus(**build_kwargs)
    elif build_kwargs:
        raise TypeError("pass either a corpus or build_corpus keyword arguments, not both")
    unknown = set(formats) - {"txt", "jsonl"}
    if unknown:
        raise ValueError(f"unknown formats {sorted(unknown)}; expected 'txt' and/or 'jsonl'")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: Dict[str, Path] = {}
    for split in SPLITS:
        docs = corpus.split_documents(split)
        if "txt" in formats:
            path = out / f"{split}.txt"
            with path.open("w", encoding="utf-8", newline="\n") as f:
                first = True
                for doc in docs:
                    lines = [ln.rstrip() for ln in doc.text.split("\n") if ln.strip()]
                    if not lines:
                        continue
                    if not first:
                        f.write("\n")
                    first = False
                    f.write("\n".join(lines) + "\n")
            written[path.name] = path
        if "jsonl" in formats:
            path = out / f"{split}.jsonl"
            with path.open("w", encoding="utf-8", newline="\n") as f:
                for doc in docs:
                    f.write(json.dumps({"text": doc.text, "domain": doc.domain, "key": doc.key}, ensure_ascii=False))
                    f.write("\n")
            written[path.name] = path
    info = out / "corpus_info.json"
    info.write_text(
        json.dumps(
            {
                "domains": list(corpus.domains),
                "vocab_size": corpus.vocab_size,
                "eod_id": corpus.eod_id,
                "config": corpus.config,
                "stats": corpus.stats(),
            },
            indent=2,
            sort_keys=True,
        ),
        encoding="utf-8",
    )
    written[info.name] = info
    return written
