import json
import math
import threading
from collections import Counter

import numpy as np
import pytest
import torch

from lmforge.config import make_config
from lmforge.data.corpus import (END_OF_TEXT, Document, encode_documents, file_documents, load_documents,
                                 load_tokenizer, split_documents, stdlib_documents, train_tokenizer)
from lmforge.data.loader import BatchLoader, window_batch
from lmforge.data.prepare import open_prepared, prepare_data
from lmforge.data.prepare import open_tokens, token_dtype, unigram_entropy, write_tokens
from lmforge.common.errors import LmforgeError
from tests.conftest import tiny_overrides


def test_stdlib_corpus_is_real_deterministic_and_excludes_site_packages():
    docs = stdlib_documents()
    assert len(docs) > 500 and sum(len(d.text) for d in docs) > 10_000_000
    names = [d.name for d in docs]
    assert names == sorted(names)
    assert not any("site-packages" in n for n in names)
    assert "os.py" in names and any(n.startswith("json/") for n in names)


def test_file_documents_read_txt_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("first document\n")
    (tmp_path / "b.jsonl").write_text('{"text": "one"}\n\n{"text": "two", "id": 3}\n')
    (tmp_path / "ignored.bin").write_bytes(b"\x00\x01")
    docs = file_documents([str(tmp_path)])
    assert [d.text for d in docs] == ["first document\n", "one", "two"]


@pytest.mark.parametrize("content, message", [
    ('{"text": "ok"}\n{"txt": "x"}\n', r'b.jsonl:2 must be an object with a "text" string'),
    ('{"text": "ok"}\nnot json\n', r"b.jsonl:2 is not valid JSON"),
])
def test_bad_jsonl_names_the_line(tmp_path, content, message):
    (tmp_path / "b.jsonl").write_text(content)
    with pytest.raises(LmforgeError, match=message):
        file_documents([str(tmp_path / "b.jsonl")])


def test_a_byte_order_mark_is_not_text_and_one_example_is_too_few(tmp_path):
    """A file saved with a UTF-8 byte-order mark (Windows editors) reads as without one, corpus and
    examples alike; a lone example is refused in one line, not cut in two and called invalid JSON."""
    from lmforge.data.sft import is_example_source, read_records

    (tmp_path / "b.jsonl").write_bytes('\ufeff{"text": "one"}\n'.encode())
    assert [d.text for d in file_documents([str(tmp_path / "b.jsonl")])] == ["one"]
    examples = tmp_path / "sft.jsonl"
    examples.write_bytes('\ufeff{"prompt": "a", "response": "b"}\n{"prompt": "c", "response": "d"}\n'.encode())
    assert is_example_source(str(examples)) and json.loads(read_records(str(examples))[0].text)["prompt"] == "a"
    examples.write_text('{"prompt": "a", "response": "b"}\n')
    with pytest.raises(LmforgeError, match="holds 1 example: fine-tuning needs at least two"):
        read_records(str(examples))


def test_a_file_listed_twice_is_refused(tmp_path):
    """Twice the same file (or a folder and a file in it) is one line, not "every document fell into
    the validation split" (both copies share a name, so a split)."""
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("first document\n")
    for paths in ([tmp_path / "notes" / "a.txt"] * 2, [tmp_path / "notes", tmp_path / "notes" / "a.txt"]):
        with pytest.raises(LmforgeError, match="a.txt twice: list each file or folder once"):
            file_documents([str(p) for p in paths])
    from lmforge.data.sft import read_records  # fine-tuning examples alike

    (tmp_path / "notes" / "b.jsonl").write_text('{"prompt": "a", "response": "b"}\n' * 2)
    with pytest.raises(LmforgeError, match="b.jsonl twice"):
        read_records(f"{tmp_path / 'notes'},{tmp_path / 'notes' / 'b.jsonl'}")


def test_missing_empty_and_binary_sources(tmp_path):
    with pytest.raises(LmforgeError, match="does not exist"):
        load_documents(str(tmp_path / "nothing.txt"))
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(LmforgeError, match="holds no text"):
        load_documents(str(tmp_path / "empty.txt"))
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(LmforgeError, match="is not UTF-8"):
        load_documents(str(tmp_path / "bin.txt"))
    (tmp_path / "folder").mkdir()
    with pytest.raises(LmforgeError, match="holds no .txt"):
        load_documents(str(tmp_path / "folder"))


def test_split_is_by_document_and_stable():
    docs = [Document(f"doc{i}", f"text {i}") for i in range(400)]
    train, val = split_documents(docs, 0.1)
    assert {d.name for d in train}.isdisjoint(d.name for d in val)
    assert len(train) + len(val) == 400 and 20 < len(val) < 60
    # adding documents does not move existing ones across the split
    train2, val2 = split_documents(docs + [Document("new", "x")], 0.1)
    assert {d.name for d in val} <= {d.name for d in val2}


def test_a_single_document_is_cut_at_a_line():
    text = "".join(f"line {i}\n" for i in range(100))
    train, val = split_documents([Document("one", text)], 0.1)
    assert train[0].text + val[0].text == text
    assert train[0].text.endswith("\n") and 5 <= val[0].text.count("\n") <= 15


def test_tokenizer_round_trips_any_text():
    tokenizer = train_tokenizer(["def f(x):\n    return x + 1\n"] * 50, vocab_size=300)
    for text in ["def g(y):\n\treturn y", "naïve café ☃ 日本語", "\x00\x7f odd bytes", ""]:
        assert tokenizer.decode(tokenizer.encode(text).ids) == text
    assert tokenizer.token_to_id(END_OF_TEXT) is not None


def test_encoding_in_batches_appends_end_tokens():
    tokenizer = train_tokenizer(["abc abd abe"] * 20, vocab_size=270)
    texts = ["abc", "abd abe", "x"]
    chunks = list(encode_documents(tokenizer, texts, batch_size=2))
    assert len(chunks) == 2
    ids = np.concatenate(chunks).tolist()
    end = tokenizer.token_to_id(END_OF_TEXT)
    expected = [i for t in texts for i in tokenizer.encode(t).ids + [end]]
    assert ids == expected


def test_token_files_round_trip_and_pick_the_dtype(tmp_path):
    assert token_dtype(4096) == np.uint16 and token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    for vocab in (4096, 100_000):
        dtype = token_dtype(vocab)
        ids = np.random.default_rng(0).integers(0, vocab, size=1000)
        count = write_tokens(tmp_path / "train.bin", [ids[:300], ids[300:]], dtype)
        meta = {"dtype": dtype.name, "splits": {"train": {"tokens": count}}}
        assert open_tokens(tmp_path, "train", meta).tolist() == ids.tolist()


def test_truncated_token_file_is_reported(tmp_path):
    write_tokens(tmp_path / "train.bin", [np.arange(100)], np.dtype(np.uint16))
    meta = {"dtype": "uint16", "splits": {"train": {"tokens": 100}}}
    with open(tmp_path / "train.bin", "r+b") as f:
        f.truncate(150)
    with pytest.raises(LmforgeError, match="train.bin is truncated or corrupt: 150 bytes, expected 200"):
        open_tokens(tmp_path, "train", meta)


def test_unigram_entropy():
    tokens = np.array([0, 0, 1, 2])
    expected = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))
    assert unigram_entropy(tokens, 5) == pytest.approx(expected)


def test_prepare_writes_reuses_and_protects(tmp_path, corpus_dir):
    cfg = make_config("tiny", overrides=tiny_overrides(corpus_dir, tmp_path / "prep"))
    data = prepare_data(cfg, log=lambda _: None)
    assert sorted(p.name for p in data.dir.iterdir()) == ["meta.json", "tokenizer.json", "train.bin", "val.bin"]
    meta = json.loads((data.dir / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["tokenizer_vocab_size"] == 512
    assert meta["splits"]["train"]["tokens"] == len(data.train) > len(data.val) > 0
    assert int(data.train.max()) < 512
    # the validation stream decodes back to exactly the validation documents, each closed by the end token
    _, val_docs = split_documents(load_documents(str(corpus_dir)), cfg.data.val_fraction)
    text = data.tokenizer.decode(data.val.tolist(), skip_special_tokens=False)
    assert text.split(END_OF_TEXT) == [d.text for d in val_docs] + [""]
    # a second run reuses the folder untouched
    mtime = (data.dir / "train.bin").stat().st_mtime_ns
    again = prepare_data(cfg, log=lambda _: None)
    assert (again.dir / "train.bin").stat().st_mtime_ns == mtime
    # other settings never overwrite it
    other = make_config("tiny", overrides=tiny_overrides(corpus_dir, tmp_path / "prep") + ["model.vocab_size=600"])
    with pytest.raises(LmforgeError, match="prepared with a different vocab_size"):
        prepare_data(other, log=lambda _: None)
    assert (data.dir / "train.bin").stat().st_mtime_ns == mtime
    # a tokenizer swapped under the token files is caught
    (data.dir / "tokenizer.json").write_text(train_tokenizer(["abc"] * 5, 300).to_str())
    with pytest.raises(LmforgeError, match="does not match the tokenizer its token files were written with"):
        open_prepared(data.dir)


def test_prepare_leaves_nothing_behind_when_interrupted(tmp_path, corpus_dir, monkeypatch):
    import lmforge.data.prepare as prepare_module

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_module, "write_tokens", boom)
    cfg = make_config("tiny", overrides=tiny_overrides(corpus_dir, tmp_path / "prep"))
    with pytest.raises(KeyboardInterrupt):
        prepare_data(cfg, log=lambda _: None)
    assert list(tmp_path.iterdir()) == []


def test_corrupt_tokenizer_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(LmforgeError, match="tokenizer .* is unreadable"):
        load_tokenizer(tmp_path / "tokenizer.json")
    with pytest.raises(LmforgeError, match="not found"):
        load_tokenizer(tmp_path / "missing.json")


def test_windows_are_next_token_pairs_and_reproducible():
    tokens = np.arange(1000, dtype=np.uint16)
    x, y = window_batch(tokens, 8, 16, seed=3, index=5)
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)
    assert torch.equal(window_batch(tokens, 8, 16, 3, 5)[0], x)
    assert not torch.equal(window_batch(tokens, 8, 16, 3, 6)[0], x)
    assert int(y.max()) <= 999  # the last window ends inside the file


def test_loader_streams_in_order_and_resumes_at_its_position():
    tokens = np.arange(5000, dtype=np.uint16)
    with BatchLoader(tokens, 4, 32, seed=7, prefetch=2) as loader:
        straight = [next(loader)[0] for _ in range(6)]
        assert loader.position == 6
    with BatchLoader(tokens, 4, 32, seed=7, start=3) as resumed:
        again = [next(resumed)[0] for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(straight[3:], again))
    # windows start uniformly over the file
    starts = Counter(int(x[0, 0]) // 1000 for x in straight)
    assert len(starts) >= 2


class FailingDisk:
    """Tokens on a disk that fails: reads of windows starting at `bad_from` or later raise OSError."""

    def __init__(self, tokens: np.ndarray, bad_from: int):
        self.tokens, self.bad_from = tokens, bad_from

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, window: slice):
        if window.start >= self.bad_from:
            raise OSError(5, "Input/output error")
        return self.tokens[window]


def next_or_hang(loader, seconds=60):
    """next(loader) in a thread; ("hung", None) if it has not returned after `seconds` (a guard
    against a hanging test, not a timing assertion)."""
    outcome = []

    def consume():
        try:
            outcome.append(("batch", next(loader)))
        except BaseException as err:
            outcome.append(("raised", err))

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    thread.join(seconds)
    return outcome[0] if outcome else ("hung", None)


def test_a_failing_loader_thread_raises_its_error_in_the_consumer():
    tokens = np.arange(5000, dtype=np.uint16)  # a window's first token is its start offset
    batches = [window_batch(tokens, 4, 32, seed=7, index=i)[0] for i in range(100)]
    first_bad = next(i for i, x in enumerate(batches) if x[:, 0].max() >= 4800)
    assert first_bad >= 3  # more batches than the queue holds come before the failure
    with BatchLoader(FailingDisk(tokens, bad_from=4800), 4, 32, seed=7, prefetch=2) as loader:
        for index in range(first_bad):  # the batches made before the failure still arrive, in order
            kind, batch = next_or_hang(loader)
            assert kind == "batch" and torch.equal(batch[0], batches[index])
        for _ in range(2):  # the error, and again on every later call instead of a hang
            kind, err = next_or_hang(loader)
            assert kind == "raised" and isinstance(err, OSError) and err.strerror == "Input/output error"
        assert loader.position == first_bad


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA, where pinning memory fails")
def test_a_loader_for_a_missing_gpu_raises_instead_of_hanging():
    with BatchLoader(np.arange(5000, dtype=np.uint16), 4, 32, seed=7, device="cuda") as loader:
        kind, err = next_or_hang(loader)
    assert kind == "raised" and isinstance(err, RuntimeError)


def test_loader_rejects_a_file_shorter_than_a_window():
    with pytest.raises(ValueError, match="cannot fill one window"):
        BatchLoader(np.arange(10, dtype=np.uint16), 2, 16, seed=0)


def test_the_split_does_not_depend_on_where_the_corpus_lies(tmp_path):
    """Documents are named by their path inside the folder given, so the same corpus in another
    place (another test's temporary folder, a moved checkout) splits the same way."""
    from lmforge.data.corpus import load_documents, split_documents

    splits = []
    for place in ("a", "b/deeper"):
        folder = tmp_path / place / "notes"
        (folder / "sub").mkdir(parents=True)
        for i in range(40):
            (folder / ("sub" if i % 2 else "") / f"doc{i}.txt").write_text(f"document {i}\n" * 5)
        train, val = split_documents(load_documents(str(folder)), val_fraction=0.2)
        splits.append(sorted(d.name for d in val))
    assert splits[0] and splits[0] == splits[1]
    assert all(name.startswith(("doc", "sub/doc")) for name in splits[0])  # named inside the folder


def test_prepared_folder_is_reused_by_stamp_and_checked_by_hash(tmp_path, monkeypatch):
    """Unchanged source files are not read again; a touched file is read and its hash compared; an
    edited one is refused."""
    import os

    import lmforge.data.prepare as prepare_module

    (tmp_path / "src").mkdir()
    for i in range(8):
        (tmp_path / "src" / f"{i}.txt").write_text(f"document {i}\n" + "some words here and there\n" * 300)
    cfg = make_config("tiny", overrides=[f"data.source={tmp_path / 'src'}", f"data.dir={tmp_path / 'prep'}"])
    prepare_data(cfg, log=lambda _: None)
    reads = []
    monkeypatch.setattr(prepare_module, "load_documents", lambda source: reads.append(source) or load_documents(source))
    prepare_data(cfg, log=lambda _: None)
    assert reads == []  # the stamp matched: the corpus was not read
    os.utime(tmp_path / "src" / "0.txt", ns=(1, 1))
    prepare_data(cfg, log=lambda _: None)  # touched, same text: read, hashed, reused
    assert len(reads) == 1
    (tmp_path / "src" / "0.txt").write_text("edited\n")
    with pytest.raises(LmforgeError, match="prepared with a different source_sha256"):
        prepare_data(cfg, log=lambda _: None)
