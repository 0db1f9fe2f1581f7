"""Data for megamoe_plugin: the embedded default corpus and its byte-level tokenizer.

The corpus is assembled at run time from files already on the machine (the Python
standard library's sources and prose, plus Debian's fortune files when installed); no
third-party text is stored in this repository.  See :mod:`megamoe_plugin.data.corpus`.

Typical use::

    from megamoe_plugin.data import build_corpus

    corpus = build_corpus(max_bytes=2_000_000, seed=0)
    for inp, tgt, idx in corpus.batches("train", batch_size=8, seq_len=128,
                                        generator=torch.Generator().manual_seed(0)):
        ...
"""

from .corpus import (
    DEFAULT_FORTUNES_DIR,
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_DOC_BYTES,
    DOMAIN_PYTHON_CODE,
    DOMAIN_PYTHON_DOCS,
    EOD_ID,
    FORTUNES_PREFIX,
    PAD_ID,
    SPLITS,
    VOCAB_SIZE,
    ByteTokenizer,
    Corpus,
    CorpusSplit,
    Document,
    assign_split,
    build_corpus,
    default_stdlib_dir,
    iterate_batches,
    write_text_splits,
)

__all__ = [
    "DEFAULT_FORTUNES_DIR",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_DOC_BYTES",
    "DOMAIN_PYTHON_CODE",
    "DOMAIN_PYTHON_DOCS",
    "EOD_ID",
    "FORTUNES_PREFIX",
    "PAD_ID",
    "SPLITS",
    "VOCAB_SIZE",
    "ByteTokenizer",
    "Corpus",
    "CorpusSplit",
    "Document",
    "assign_split",
    "build_corpus",
    "default_stdlib_dir",
    "iterate_batches",
    "write_text_splits",
]
