"""Tests for the embedded default corpus (megamoe_plugin.data.corpus)."""

from __future__ import annotations

import json

import pytest
import torch

from megamoe_plugin.data import (
    DOMAIN_PYTHON_CODE,
    DOMAIN_PYTHON_DOCS,
    EOD_ID,
    SPLITS,
    VOCAB_SIZE,
    ByteTokenizer,
    assign_split,
    build_corpus,
    iterate_batches,
    write_text_splits,
)

MAX_BYTES = 300_000

FORTUNES_EN = "The early bird gets the worm.\n%\nTwo lines\n  of wisdom.\n%\nA third one.\n%\n"
FORTUNES_EN2 = "".join(f"English saying number {i}.\n%\n" for i in range(40))
FORTUNES_FR = "".join(f"Çà et là, l'été {i} — déjà vu ?\n%\n" for i in range(40))
FORTUNES_OFF = "OFFENSIVE-MARKER should never be read\n%\n"


@pytest.fixture(scope="module")
def fortunes_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("fortunes")
    (root / "wisdom").write_text(FORTUNES_EN, encoding="utf-8")
    (root / "sayings").write_text(FORTUNES_EN2, encoding="utf-8")
    (root / "sayings.dat").write_bytes(b"\x00\x01binary index\x00")
    (root / "fr").mkdir()
    (root / "fr" / "proverbes").write_text(FORTUNES_FR, encoding="utf-8")
    (root / "off").mkdir()
    (root / "off" / "rude").write_text(FORTUNES_OFF, encoding="utf-8")
    (root / "fr" / "off").mkdir()
    (root / "fr" / "off" / "rude").write_text(FORTUNES_OFF, encoding="utf-8")
    # Debian layouts: *.u8 links, top-level links into a language folder (fortunes-it),
    # encoding variants (fortunes-eo-iso3), zh_CN/ folders, top-level non-English files.
    (root / "wisdom.u8").symlink_to("wisdom")
    (root / "it").mkdir()
    (root / "it" / "detti").write_text("".join(f"Chi va piano {i}.\n%\n" for i in range(30)), encoding="utf-8")
    (root / "detti").symlink_to("it/detti")
    (root / "eo-iso3").mkdir()
    (root / "eo-iso3" / "proverbaro").write_bytes(b"ISO3-MARKER \xe6\n%\n")
    (root / "zh_CN").mkdir()
    (root / "zh_CN" / "hints").write_text("".join(f"提示 {i}\n%\n" for i in range(30)), encoding="utf-8")
    (root / "chinese").write_text("".join(f"中文 {i}\n%\n" for i in range(30)), encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def corpus(fortunes_dir):
    return build_corpus(max_bytes=MAX_BYTES, seed=0, fortunes_dir=fortunes_dir)


def _doc_bytes(c):
    return sum(int((c.split(s).tokens != EOD_ID).sum()) for s in SPLITS)


# ----------------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize(
    "text",
    ["", "hello world\n", "héllo wörld — 日本語 🚀\n\tend", "\x00\x7f\u00ff\U0010ffff", "def f(x):\n    return x\n"],
)
def test_tokenizer_roundtrip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids.dtype == torch.long and ids.dim() == 1
    assert ids.numel() == len(text.encode("utf-8"))
    assert bool(((ids >= 0) & (ids < 256)).all())
    assert tok.decode(ids) == text
    assert tok.decode(ids.tolist()) == text
    with_eod = tok.encode(text, add_eod=True)
    assert int(with_eod[-1]) == EOD_ID
    assert tok.decode(with_eod) == text
    assert tok.decode(with_eod, skip_special=False) == text + "<eod>"


def test_tokenizer_vocab_and_errors():
    tok = ByteTokenizer()
    assert tok.vocab_size == VOCAB_SIZE == 258
    assert tok.encode("é").tolist() == [0xC3, 0xA9]
    assert tok.decode([0xC3]) == "\ufffd"  # cut UTF-8 sequence is replaced, not raised
    with pytest.raises(ValueError):
        tok.decode([VOCAB_SIZE])


# ----------------------------------------------------------------------------- corpus


def test_corpus_nonempty_and_consistent(corpus):
    assert corpus.vocab_size == VOCAB_SIZE
    for name in SPLITS:
        sp = corpus.split(name)
        assert sp.tokens.numel() > 0, name
        assert sp.tokens.dtype == torch.long and sp.tokens.dim() == 1
        assert sp.token_domains.shape == sp.tokens.shape
        assert int(sp.tokens.max()) < corpus.vocab_size and int(sp.tokens.min()) >= 0
        assert len(sp.doc_keys) == sp.doc_domains.numel() == sp.doc_offsets.numel() - 1
        assert int(sp.doc_offsets[-1]) == sp.tokens.numel()
    assert corpus.train is corpus.split("train").tokens
    assert corpus.valid.numel() > 0 and corpus.test.numel() > 0
    # every document decodes back to its text, ends with <eod>, and carries its domain
    tok = corpus.tokenizer
    for name in SPLITS:
        sp = corpus.split(name)
        docs = corpus.split_documents(name)
        assert [d.key for d in docs] == list(sp.doc_keys)
        for j, doc in enumerate(docs):
            a, b = int(sp.doc_offsets[j]), int(sp.doc_offsets[j + 1])
            assert int(sp.tokens[b - 1]) == EOD_ID
            assert tok.decode(sp.tokens[a : b - 1]) == doc.text
            assert bool((sp.token_domains[a:b] == corpus.domain_id(doc.domain)).all())
            assert int(sp.doc_domains[j]) == corpus.domain_id(doc.domain)
            assert int((sp.tokens[a : b - 1] == EOD_ID).sum()) == 0


def test_deterministic_across_builds(corpus, fortunes_dir):
    again = build_corpus(max_bytes=MAX_BYTES, seed=0, fortunes_dir=fortunes_dir)
    assert again.domains == corpus.domains
    for name in SPLITS:
        assert torch.equal(again.split(name).tokens, corpus.split(name).tokens)
        assert torch.equal(again.split(name).token_domains, corpus.split(name).token_domains)
        assert again.split(name).doc_keys == corpus.split(name).doc_keys
    other = build_corpus(max_bytes=MAX_BYTES, seed=1, fortunes_dir=fortunes_dir)
    assert not torch.equal(other.train[:1000], corpus.train[:1000])  # the seed matters
    # ... but never moves a document to another split
    for doc in other.documents:
        assert doc.split == assign_split(doc.key)


def test_splits_disjoint_by_document(corpus):
    keys = {s: set(corpus.split(s).doc_keys) for s in SPLITS}
    for s in SPLITS:
        assert len(keys[s]) == len(corpus.split(s).doc_keys), "duplicate document in split"
    assert not keys["train"] & keys["valid"]
    assert not keys["train"] & keys["test"]
    assert not keys["valid"] & keys["test"]
    for doc in corpus.documents:
        assert doc.split == assign_split(doc.key)
    # the split of a document is a fixed function of its key (pinned: later caches of
    # per-sample expert assignments rely on splits staying put across versions)
    golden = {"k15": "test", "k21": "test", "k27": "valid", "k0": "train", "fortunes-en:fortunes#1": "train"}
    assert {k: assign_split(k) for k in golden} == golden
    assert assign_split("python-code:json/decoder.py") == assign_split("python-code:json/decoder.py")
    counts = {s: 0 for s in SPLITS}
    for i in range(4000):
        counts[assign_split(f"k{i}", 0.1, 0.2)] += 1
    assert 300 < counts["valid"] < 500 and 700 < counts["test"] < 900


def test_domains_present(corpus):
    assert corpus.domains[:2] == (DOMAIN_PYTHON_CODE, DOMAIN_PYTHON_DOCS)
    assert corpus.domains[2:] == ("fortunes-en", "fortunes-fr", "fortunes-it", "fortunes-zh")
    stats = corpus.stats()
    for domain in corpus.domains:  # a small cap still serves every domain
        assert stats["train"].get(domain, {}).get("bytes", 0) > 0, domain
    train_domains = set(corpus.token_domains("train").unique().tolist())
    assert train_domains == set(range(len(corpus.domains)))
    texts = "".join(d.text for d in corpus.documents)
    assert "OFFENSIVE-MARKER" not in texts
    assert "binary index" not in texts and "ISO3-MARKER" not in texts
    keys = [d.key for d in corpus.documents]
    assert not any(".u8" in k or k.startswith("fortunes-en:detti") for k in keys)  # links read once
    assert any(k.startswith("fortunes-it:it/detti#") for k in keys)
    assert any(k.startswith("fortunes-zh:zh_CN/hints#") for k in keys)
    assert any(k.startswith("fortunes-zh:chinese#") for k in keys)
    fr = [d for d in corpus.documents if d.domain == "fortunes-fr"]
    assert fr and all("été" in d.text for d in fr)
    # one document per fortune, split on '%' lines
    en = {d.text for d in corpus.documents if d.key.startswith("fortunes-en:wisdom#")}
    assert en <= {"The early bird gets the worm.\n", "Two lines\n  of wisdom.\n", "A third one.\n"}
    # non-ASCII survives the token stream
    sp = corpus.split(fr[0].split)
    j = sp.doc_keys.index(fr[0].key)
    a, b = int(sp.doc_offsets[j]), int(sp.doc_offsets[j + 1])
    assert corpus.tokenizer.decode(sp.tokens[a:b]) == fr[0].text


def test_domain_filter(fortunes_dir):
    c = build_corpus(max_bytes=30_000, fortunes_dir=fortunes_dir, domains=("python-*", "fortunes-fr"))
    assert c.domains == (DOMAIN_PYTHON_CODE, DOMAIN_PYTHON_DOCS, "fortunes-fr")
    assert {d.domain for d in c.documents} == set(c.domains)
    with pytest.raises(TypeError):
        build_corpus(max_bytes=1000, domains="python-code")


def test_without_fortunes(fortunes_dir):
    c = build_corpus(max_bytes=60_000, seed=0, include_fortunes=False, fortunes_dir=fortunes_dir)
    assert c.domains == (DOMAIN_PYTHON_CODE, DOMAIN_PYTHON_DOCS)
    assert all(not d.domain.startswith("fortunes-") for d in c.documents)
    missing = build_corpus(max_bytes=60_000, seed=0, fortunes_dir=fortunes_dir / "does-not-exist")
    assert missing.domains == (DOMAIN_PYTHON_CODE, DOMAIN_PYTHON_DOCS)


@pytest.mark.parametrize("max_bytes", [5_000, 50_000, MAX_BYTES])
def test_max_bytes_honoured(max_bytes, fortunes_dir, corpus):
    c = corpus if max_bytes == MAX_BYTES else build_corpus(max_bytes=max_bytes, fortunes_dir=fortunes_dir)
    n = _doc_bytes(c)
    assert n == sum(d.num_bytes for d in c.documents)
    assert 0.8 * max_bytes <= n <= max_bytes
    assert _doc_bytes(c) > 0 and c.train.numel() > 0


def test_max_doc_bytes(fortunes_dir):
    c = build_corpus(max_bytes=100_000, max_doc_bytes=2_000, fortunes_dir=fortunes_dir)
    assert c.documents and max(d.num_bytes for d in c.documents) <= 2_000


def test_invalid_arguments():
    with pytest.raises(ValueError):
        build_corpus(max_bytes=-1)
    with pytest.raises(ValueError):
        build_corpus(max_bytes=1000, valid_fraction=0.6, test_fraction=0.5)


# ----------------------------------------------------------------------------- batches


def test_batches_shapes_and_indices(corpus):
    B, T = 4, 32
    tokens = corpus.train
    n = corpus.num_samples("train", T)
    assert n == (tokens.numel() - 1) // T
    seen = []
    g = torch.Generator().manual_seed(123)
    for inp, tgt, idx in corpus.batches("train", B, T, g):
        assert inp.dtype == tgt.dtype == idx.dtype == torch.long
        assert inp.shape == tgt.shape == (idx.numel(), T)
        assert 1 <= idx.numel() <= B
        assert torch.equal(inp[:, 1:], tgt[:, :-1])
        for b, i in enumerate(idx.tolist()):
            assert torch.equal(inp[b], tokens[i * T : i * T + T])
            assert torch.equal(tgt[b], tokens[i * T + 1 : i * T + T + 1])
            s_inp, s_tgt = corpus.sample("train", i, T)
            assert torch.equal(s_inp, inp[b]) and torch.equal(s_tgt, tgt[b])
        doms = corpus.sample_token_domains("train", idx, T)
        assert doms.shape == inp.shape
        assert torch.equal(doms[0], corpus.token_domains("train")[idx[0] * T : idx[0] * T + T])
        seen += idx.tolist()
        if len(seen) > 400:
            break
    assert seen != sorted(seen)  # shuffled
    # same generator seed -> same order; full epoch covers each sample exactly once
    first = next(iter(corpus.batches("train", B, T, torch.Generator().manual_seed(123))))[2]
    assert first.tolist() == seen[: first.numel()]
    all_idx = torch.cat([i for _, _, i in corpus.batches("valid", 7, T, torch.Generator().manual_seed(0))])
    assert sorted(all_idx.tolist()) == list(range(corpus.num_samples("valid", T)))


def test_batches_sequential_and_drop_last():
    tokens = torch.arange(1, 102)  # 101 tokens -> (101 - 1) // 10 = 10 samples
    batches = list(iterate_batches(tokens, 3, 10))
    assert [b[2].tolist() for b in batches] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert batches[-1][0].tolist() == [list(range(91, 101))]
    assert batches[-1][1].tolist() == [list(range(92, 102))]
    dropped = list(iterate_batches(tokens, 3, 10, torch.Generator().manual_seed(0), drop_last=True))
    assert len(dropped) == 3 and all(b[0].shape == (3, 10) for b in dropped)
    with pytest.raises(IndexError):
        from megamoe_plugin.data import CorpusSplit

        CorpusSplit("x", tokens, tokens, torch.tensor([0]), tokens[:0], ()).sample(10, 10)


# ----------------------------------------------------------------------------- export / cache


def test_write_text_splits(corpus, tmp_path):
    files = write_text_splits(tmp_path / "out", corpus)
    for s in SPLITS:
        assert files[f"{s}.txt"].is_file() and files[f"{s}.jsonl"].is_file()
        docs = corpus.split_documents(s)
        rows = [json.loads(line) for line in files[f"{s}.jsonl"].read_text(encoding="utf-8").splitlines()]
        assert [r["text"] for r in rows] == [d.text for d in docs]
        assert [r["domain"] for r in rows] == [d.domain for d in docs]
        blocks = files[f"{s}.txt"].read_text(encoding="utf-8").split("\n\n")
        assert len(blocks) == len(docs)
        assert all(block.strip() for block in blocks)
    info = json.loads(files["corpus_info.json"].read_text(encoding="utf-8"))
    assert info["domains"] == list(corpus.domains) and info["vocab_size"] == VOCAB_SIZE
    with pytest.raises(TypeError):
        write_text_splits(tmp_path / "bad", corpus, max_bytes=10)


def test_cache_dir(tmp_path, fortunes_dir):
    cache = tmp_path / "cache"
    a = build_corpus(max_bytes=40_000, seed=3, fortunes_dir=fortunes_dir, cache_dir=cache)
    cached = list(cache.glob("*.json"))
    assert len(cached) == 1
    b = build_corpus(max_bytes=40_000, seed=3, fortunes_dir=fortunes_dir, cache_dir=cache)
    assert a.documents == b.documents and a.domains == b.domains
    assert torch.equal(a.train, b.train)
    build_corpus(max_bytes=40_000, seed=4, fortunes_dir=fortunes_dir, cache_dir=cache)
    assert len(list(cache.glob("*.json"))) == 2  # other arguments, other cache entry
