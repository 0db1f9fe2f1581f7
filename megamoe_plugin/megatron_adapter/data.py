"""Data for megatron-core trainers: Megatron's own GPT datasets over mock tokens or the embedded real-text corpus.

- ``--mock-data``: megatron-core's ``MockGPTDataset`` (random documents), exactly as Megatron-LM's ``--mock-data``.
- default: the embedded corpus (``megamoe_plugin.data``: Python stdlib sources and docs, plus Debian fortunes when
  installed) byte-tokenized and written once, at run time, as Megatron indexed datasets (``.bin``/``.idx``, one
  per split) in a cache folder; then megatron-core's ``GPTDataset`` reads them through
  ``BlendedMegatronDatasetBuilder``, like any user's preprocessed data.

``build_datasets`` returns (train, valid, test) Megatron datasets; ``batches`` yields the micro-batches of one data
parallel rank in Megatron's global order (sample ``(it * global_batch + m * dp * mbs + dp_rank * mbs + i)``), so
a resumed run reads exactly the batches the uninterrupted run would have read.
"""
from __future__ import annotations

import hashlib
import os
from typing import Iterator, Optional

import numpy as np
import torch

from ..data import EOD_ID, PAD_ID, VOCAB_SIZE, build_corpus


class ByteTokenizer:
    """The corpus's byte tokenizer in the shape Megatron's datasets expect (``vocab_size``, ``eod``, ``pad``)."""

    def __init__(self, vocab_size: int = VOCAB_SIZE):
        self.vocab_size, self.eod, self.pad = vocab_size, EOD_ID, PAD_ID
        self.unique_identifiers = {"class": "megamoe-byte", "vocab_size": vocab_size}


class MockTokenizer:
    def __init__(self, vocab_size: int):
        self.vocab_size, self.eod, self.pad = vocab_size, 0, -1
        self.unique_identifiers = {"class": "megamoe-mock", "vocab_size": vocab_size}


def write_corpus_indexed(cache_dir: str, max_bytes: int, seed: int) -> dict:
    """Write the embedded corpus's splits as Megatron indexed datasets; returns {split: path prefix}."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    tag = hashlib.sha1(f"{max_bytes}-{seed}-v1".encode()).hexdigest()[:10]
    out = os.path.join(cache_dir, f"corpus-{tag}")
    prefixes = {s: os.path.join(out, s) for s in ("train", "valid", "test")}
    if all(os.path.exists(p + ".idx") for p in prefixes.values()):
        return prefixes
    os.makedirs(out, exist_ok=True)
    corpus = build_corpus(max_bytes=max_bytes, seed=seed)
    for split, prefix in prefixes.items():
        part = corpus.splits[split]
        builder = IndexedDatasetBuilder(prefix + ".bin.tmp", dtype=np.int32)
        offsets = part.doc_offsets.tolist()
        for a, b in zip(offsets[:-1], offsets[1:]):
            builder.add_document(part.tokens[a:b].to(torch.int32), [b - a])
        builder.finalize(prefix + ".idx.tmp")
        os.replace(prefix + ".bin.tmp", prefix + ".bin")
        os.replace(prefix + ".idx.tmp", prefix + ".idx")
    return prefixes


def build_datasets(seq_length: int, num_samples: tuple, seed: int, mock: bool, vocab_size: int,
                   cache_dir: str, corpus_bytes: int = 4_000_000, rank: int = 0):
    """(train, valid, test) megatron-core GPT datasets; rank 0 writes the corpus files first (others wait)."""
    import torch.distributed as dist
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    common = dict(random_seed=seed, sequence_length=seq_length, reset_position_ids=False,
                  reset_attention_mask=False, eod_mask_loss=False, path_to_cache=os.path.join(cache_dir, "index"))
    if mock:
        config = GPTDatasetConfig(tokenizer=MockTokenizer(vocab_size), split="98,1,1", **common)
        cls = MockGPTDataset
    else:
        if rank == 0:
            prefixes = write_corpus_indexed(cache_dir, corpus_bytes, seed)
        if dist.is_initialized():
            dist.barrier()
        if rank != 0:
            prefixes = write_corpus_indexed(cache_dir, corpus_bytes, seed)
        config = GPTDatasetConfig(tokenizer=ByteTokenizer(vocab_size),
                                  blend_per_split=[([prefixes[s]], None) for s in ("train", "valid", "test")],
                                  **common)
        cls = GPTDataset
    # every rank builds (and reads) the same index files; rank 0 first so the others find them cached
    if rank == 0:
        datasets = BlendedMegatronDatasetBuilder(cls, list(num_samples), lambda: True, config).build()
    if dist.is_initialized():
        dist.barrier()
    if rank != 0:
        datasets = BlendedMegatronDatasetBuilder(cls, list(num_samples), lambda: True, config).build()
    return datasets


def batches(dataset, start_iteration: int, num_microbatches: int, micro_batch_size: int, dp_rank: int,
            dp_size: int, eval_offset: Optional[int] = None, epoch_samples: int = 0) -> Iterator[dict]:
    """Micro-batches of this data-parallel rank, in order, from ``start_iteration`` on (forever, wrapping after
    ``epoch_samples`` samples, default the whole dataset). Each batch also carries ``sample_ids`` (the samples'
    dataset indices, what DynaMoE's assignment cache keys by) and ``epoch`` (1-based)."""
    global_batch = num_microbatches * micro_batch_size * dp_size
    it = start_iteration
    n = min(epoch_samples, len(dataset)) if epoch_samples else len(dataset)
    while True:
        for m in range(num_microbatches):
            first = it * global_batch + m * dp_size * micro_batch_size + dp_rank * micro_batch_size
            ids = [(first + i) % n for i in range(micro_batch_size)]
            items = [dataset[i] for i in ids]
            batch = {k: torch.stack([torch.as_tensor(x[k]) for x in items])
                     for k in ("tokens", "labels", "loss_mask", "position_ids")}
            batch["sample_ids"] = torch.tensor(ids)
            batch["epoch"] = first // n + 1
            yield batch
        it += 1
