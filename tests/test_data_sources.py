"""Data users already have: llm.c token shards, nanoGPT's raw .bin, globs of shards, JSON lines
and a Hugging Face tokenizer.json (trained here with the tokenizers package; nothing is
downloaded).  Shards are written with numpy as llm.c's and nanoGPT's scripts write them."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from helios.data import (
    BatchLoader,
    Corpus,
    ShardSet,
    TokenStream,
    open_data,
    prepare_dataset,
    read_shard,
    split_tokens,
    write_shard,
)
from helios.errors import DataError
from helios.tokenizer import HFTokenizer, check_spec, get_tokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_train import BASE, losses, run  # noqa: E402

tokenizers = pytest.importorskip("tokenizers")

WORDS = ["alpha", "beta", "gamma", "delta", "def", "return", "class", "self", "value", "print"]


def _lines(n: int = 1500, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=rng.integers(3, 10))) for _ in range(n)]


def llmc_bytes(tokens, magic: int = 20240520, version: int = 1, dtype=np.uint16) -> bytes:
    """A shard as llm.c's dev/data/data_common.py writes it: 256 int32 (magic, version, count)."""
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = magic, version, len(tokens)
    return header.tobytes() + np.asarray(tokens, dtype=dtype).tobytes()


def write_llmc(path, tokens, **kw) -> None:
    path.write_bytes(llmc_bytes(tokens, **kw))


def write_nanogpt(path, tokens) -> None:
    """nanoGPT's prepare.py: ``np.array(ids, dtype=np.uint16).tofile('train.bin')``."""
    np.array(tokens, dtype=np.uint16).tofile(path)


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    """A byte-level BPE tokenizer.json of 300 ids, trained here on a few KB of text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator(_lines(400, seed=1), trainer)
    d = tmp_path_factory.mktemp("hf")
    tok.save(str(d / "tokenizer.json"))
    return d


# ----------------------------------------------------------------------------- formats


def test_llmc_shard_is_memory_mapped_and_matches_our_writer(tmp_path):
    toks = np.random.default_rng(0).integers(0, 50257, 1001)
    write_llmc(tmp_path / "a.bin", toks)
    s = read_shard(tmp_path / "a.bin")
    assert (s.kind, s.offset, s.count, s.dtype) == ("llm.c", 1024, 1001, np.dtype("<u2"))
    mm = s.tokens()
    assert isinstance(mm, np.memmap) and mm.dtype == np.uint16
    np.testing.assert_array_equal(mm, toks)
    write_shard(tmp_path / "b.bin", toks, "llm.c")
    assert (tmp_path / "b.bin").read_bytes() == (tmp_path / "a.bin").read_bytes()
    # llm.c's LLaMA-3 shards: magic 20240801, version 7, uint32 tokens
    big = np.array([0, 128000, 7, 128255])
    write_llmc(tmp_path / "l3.bin", big, magic=20240801, version=7, dtype=np.uint32)
    s3 = read_shard(tmp_path / "l3.bin")
    assert s3.kind == "llm.c LLaMA-3" and s3.dtype == np.dtype("<u4")
    np.testing.assert_array_equal(s3.tokens(), big)


def test_nanogpt_raw_bin_has_no_header(tmp_path):
    toks = np.arange(0, 3000, 3)
    write_nanogpt(tmp_path / "train.bin", toks)
    s = read_shard(tmp_path / "train.bin")
    assert (s.kind, s.offset, s.count) == ("nanoGPT", 0, 1000)
    np.testing.assert_array_equal(s.tokens(), toks)
    write_shard(tmp_path / "w.bin", toks, "nanoGPT")
    assert (tmp_path / "w.bin").read_bytes() == (tmp_path / "train.bin").read_bytes()


def _bad(tmp_path, name, data: bytes):
    p = tmp_path / name
    p.write_bytes(data)
    return p


GOOD = llmc_bytes(np.arange(100))  # 1024 + 200 bytes


@pytest.mark.parametrize("name,data,needle", [
    ("version.bin", GOOD[:4] + np.int32(2).tobytes() + GOOD[8:], "byte 4: llm.c header version 2, expected 1"),
    ("cut.bin", GOOD[:-3], "truncated at byte 1221: the llm.c header (byte 8) counts 100 tokens, which end at byte 1224"),
    ("long.bin", GOOD + b"\0\0", "2 extra bytes from byte 1224"),
    ("header.bin", GOOD[:600], "llm.c shard header truncated at byte 600"),
    ("count.bin", GOOD[:8] + np.int32(0).tobytes() + GOOD[12:1024], "byte 8: token count 0"),
    ("magic.bin", np.int32(20240521).tobytes() + GOOD[4:], "byte 0: magic 20240521, expected 20240520"),
    ("odd.bin", b"\1\0\2\0\3", "5 bytes, an odd count"),
    ("empty.bin", b"", "the file is empty (0 bytes)"),
])
def test_malformed_shard_is_refused_naming_file_and_byte(tmp_path, name, data, needle):
    p = _bad(tmp_path, name, data)
    with pytest.raises(DataError) as e:
        read_shard(p)
    msg = str(e.value)
    assert needle in msg and str(p) in msg and "\n" not in msg, msg
    with pytest.raises(DataError, match="byte|empty"):
        open_data(str(tmp_path / "*.bin"))  # through a glob too


# ----------------------------------------------------------------------------- shard sets and the split


def test_validation_files_are_found_by_name(tmp_path):
    rng = np.random.default_rng(0)
    nano = tmp_path / "nano"
    nano.mkdir()
    write_nanogpt(nano / "train.bin", rng.integers(0, 65, 900))
    write_nanogpt(nano / "val.bin", rng.integers(0, 65, 100))
    for spec in (nano / "train.bin", nano):  # the file (val.bin beside it) or the folder
        d = open_data(str(spec))
        assert isinstance(d, ShardSet)
        assert [s.path.name for s in d.train_shards] == ["train.bin"] and [s.path.name for s in d.val_shards] == ["val.bin"]
    fw = tmp_path / "fw"
    fw.mkdir()
    for i in range(3):
        write_llmc(fw / f"fineweb_train_{i:06d}.bin", rng.integers(0, 50257, 300 + i))
    write_llmc(fw / "fineweb_val_000000.bin", rng.integers(0, 50257, 200))
    for pattern in ("fineweb_train_*.bin", "fineweb_*.bin"):
        d = open_data(str(fw / pattern))
        assert [s.count for s in d.train_shards] == [300, 301, 302] and [s.count for s in d.val_shards] == [200]
    assert "fineweb_val_000000.bin" in open_data(str(fw / "fineweb_train_*.bin")).description
    # no *val* file: the trainer's rule, the last 10% of the training tokens
    alone = open_data(str(fw / "fineweb_train_000001.bin"))
    assert alone.val_shards == [] and "last 10%" in alone.description
    tr, va = alone.streams()
    assert (len(tr), len(va)) == (271, 30)
    np.testing.assert_array_equal(np.concatenate([tr.array(), va.array()]), alone.train_shards[0].tokens())
    with pytest.raises(DataError, match="names only validation shards"):
        open_data(str(fw / "fineweb_val_*.bin"))
    with pytest.raises(FileNotFoundError, match="matches no file"):
        open_data(str(fw / "nothing_*.bin"))


def test_stream_split_and_loader_over_shards(tmp_path):
    parts = [np.arange(i * 1000, i * 1000 + n) for i, n in enumerate((50, 8, 70))]
    for i, p in enumerate(parts):
        write_llmc(tmp_path / f"s_train_{i}.bin", p)
    d = open_data(str(tmp_path / "s_train_*.bin"))
    stream = TokenStream(d.train_shards)
    assert len(stream) == 128 and isinstance(stream.part(0), np.memmap)
    np.testing.assert_array_equal(stream[45:60].array(), np.concatenate([parts[0][45:], parts[1], parts[2][:2]]))
    tr, va = split_tokens(stream, 0.25)
    assert (len(tr), len(va)) == (96, 32)
    ld = BatchLoader(stream, batch_size=64, block_size=10, seed=3)
    assert ld.n_windows == 40 + 0 + 60  # the 8-token shard holds no window of 11
    seen = set()
    for _ in range(20):
        x, y = ld.next_batch()
        np.testing.assert_array_equal(y[:, :-1], x[:, 1:])
        np.testing.assert_array_equal(y - x, np.ones_like(x))  # a window never straddles two shards
        seen.update(x[:, 0].tolist())
    assert seen == set(range(40)) | set(range(2000, 2060))
    # resumable: the state goes through JSON and restores the same batches
    ref = BatchLoader(stream, 4, 10, seed=7)
    for _ in range(3):
        ref.next_batch()
    state = json.loads(json.dumps(ref.state_dict()))
    assert state["shards"] == [50, 8, 70]
    expected = [ref.next_batch() for _ in range(4)]
    back = BatchLoader(stream, 4, 10, seed=0)
    back.load_state_dict(state)
    for (ex, ey), (gx, gy) in zip(expected, (back.next_batch() for _ in range(4))):
        np.testing.assert_array_equal(ex, gx)
        np.testing.assert_array_equal(ey, gy)
    other = TokenStream([np.arange(50), np.arange(70), np.arange(8)])
    with pytest.raises(ValueError, match="shards: saved"):
        BatchLoader(other, 4, 10).load_state_dict(state)
    # one part reads as the plain array does, batch for batch
    a, b = BatchLoader(np.arange(500), 4, 16, seed=1), BatchLoader(TokenStream([np.arange(500)]), 4, 16, seed=1)
    np.testing.assert_array_equal(a.next_batch()[0], b.next_batch()[0])
    assert a.state_dict() == b.state_dict()


def test_token_ids_must_fit_the_vocabulary(tmp_path, hf_tok):
    write_nanogpt(tmp_path / "train.bin", [1, 2, 3, 299, 4])
    with pytest.raises(DataError, match=r"'.*train.bin': token id 299 at byte 6 is outside the vocabulary of "
                                        r"--tokenizer byte \(256 ids"):
        prepare_dataset(str(tmp_path / "train.bin"), "byte", cache_root=tmp_path / "c")
    ds = prepare_dataset(str(tmp_path / "train.bin"), f"hf:{hf_tok}", cache_root=tmp_path / "c")
    assert ds.tokenizer.vocab_size == 300 and len(ds.tokens) == 5
    with pytest.raises(DataError, match="bpe:300 trains a BPE on text"):
        prepare_dataset(str(tmp_path / "train.bin"), "bpe:300", cache_root=tmp_path / "c")


# ----------------------------------------------------------------------------- JSON lines and globs of text


def test_jsonl_records_are_documents(tmp_path):
    texts = ["first doc", "", "second – ünïcode", "third\nwith a newline"]
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps({"text": t, "meta": i}) for i, t in enumerate(texts)) + "\n\n")
    ds = prepare_dataset(str(p), "byte", cache_root=tmp_path / "c")
    assert isinstance(ds.corpus, Corpus) and ds.corpus.kind == "jsonl"
    assert ds.tokenizer.decode(ds.tokens) == "\n\n".join(t for t in texts if t).encode()
    # the same file read as text would be another corpus: another cache entry
    assert Corpus(tmp_path, [p], "d", kind="text").fingerprint != ds.corpus.fingerprint
    good = json.dumps({"text": "ok"}) + "\n"
    for body, needle in ((good + "{oops\n", "line 2 (byte 15): not a JSON line"),
                         (good + '{"body": "x"}\n', "line 2 (byte 15): no \"text\" field (fields 'body')"),
                         (good + '{"text": 3}\n', "\"text\" is int, expected a string"),
                         (good + "[1, 2]\n", "no \"text\" field (list)")):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(body)
        with pytest.raises(DataError) as e:
            prepare_dataset(str(bad), "byte", cache_root=tmp_path / "c2")
        assert needle in str(e.value) and str(bad) in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_glob_of_text_files(tmp_path):
    for name, body in (("b.txt", "bee"), ("a.txt", "ay"), ("c.md", "sea")):
        (tmp_path / name).write_text(body)
    c = open_data(str(tmp_path / "*.txt"))
    assert isinstance(c, Corpus) and [f.name for f in c.files] == ["a.txt", "b.txt"]
    assert c.read_bytes() == b"ay\n\nbee"


# ----------------------------------------------------------------------------- the Hugging Face tokenizer


def test_hf_tokenizer_json(tmp_path, hf_tok):
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(str(hf_tok / "tokenizer.json"))
    for spec in (f"hf:{hf_tok}", f"hf:{hf_tok / 'tokenizer.json'}"):
        check_spec(spec)
        t = get_tokenizer(spec)
        assert isinstance(t, HFTokenizer) and t.vocab_size == 300 and t.identity.startswith("hf300-")
    text = "def alpha(self): return beta_value\n"
    ids = t.encode(text)
    assert ids.dtype == np.int32 and ids.tolist() == ref.encode(text, add_special_tokens=False).ids
    assert t.encode(text.encode()).tolist() == ids.tolist() and t.decode(ids) == text.encode()
    assert [a.tolist() for a in t.encode_batch([b"alpha", "beta gamma"])] == [t.encode("alpha").tolist(),
                                                                               t.encode("beta gamma").tolist()]
    # a text corpus tokenized with it (each document on its own, joined by the separator's ids)
    (tmp_path / "words.txt").write_text("\n".join(_lines(50)))
    ds = prepare_dataset(str(tmp_path / "words.txt"), f"hf:{hf_tok}", cache_root=tmp_path / "c")
    assert ds.tokens.tolist() == ref.encode("\n".join(_lines(50)), add_special_tokens=False).ids
    assert ds.summary()["vocab_size"] == 300
    for spec, needle in ((f"hf:{tmp_path / 'none.json'}", "no such file"), (f"hf:{tmp_path}", "no tokenizer.json")):
        with pytest.raises(DataError, match=needle):
            check_spec(spec)
    (tmp_path / "broken.json").write_text('{"version": "1.0", "model": 7}')
    with pytest.raises(DataError, match="is not a tokenizers tokenizer.json"):
        get_tokenizer(f"hf:{tmp_path / 'broken.json'}")


# ----------------------------------------------------------------------------- helios-train on each source


@pytest.fixture(scope="module")
def sources(tmp_path_factory, hf_tok):
    """Each kind of --data (with its --tokenizer), made from the same learnable word corpus."""
    from tokenizers import Tokenizer

    root = tmp_path_factory.mktemp("sources")
    lines = _lines()
    ref = Tokenizer.from_file(str(hf_tok / "tokenizer.json"))
    ids = np.concatenate([ref.encode(line + "\n").ids for line in lines])
    n = len(ids)
    for i in range(3):
        write_llmc(root / f"fw_train_{i:06d}.bin", ids[i * n // 4:(i + 1) * n // 4])
    write_llmc(root / "fw_val_000000.bin", ids[3 * n // 4:])
    (root / "nano").mkdir()
    text = np.frombuffer("\n".join(lines).encode(), np.uint8)  # character-level, as nanoGPT's shakespeare_char
    write_nanogpt(root / "nano" / "train.bin", text[:len(text) * 9 // 10])
    write_nanogpt(root / "nano" / "val.bin", text[len(text) * 9 // 10:])
    with open(root / "docs.jsonl", "w") as f:
        for line in lines:
            f.write(json.dumps({"text": line, "source": "words"}) + "\n")
    tok = ["--tokenizer", f"hf:{hf_tok}"]
    return {"llm.c glob": ["--data", str(root / "fw_train_*.bin"), *tok],
            "nanoGPT bin": ["--data", str(root / "nano" / "train.bin")],
            "jsonl": ["--data", str(root / "docs.jsonl"), *tok]}


@pytest.mark.vulkan
@pytest.mark.parametrize("source", ["llm.c glob", "nanoGPT bin", "jsonl"])
def test_train_and_resume_exactly(sources, tmp_path, source):
    args = BASE + ["--steps", "5", "--seed", "3", *sources[source]]
    full = run(args + ["--out", str(tmp_path / "full")], tmp_path)
    assert full.returncode == 0, full.stderr
    assert "data: " in full.stdout and (source != "llm.c glob" or "fw_val_000000.bin, beside" in full.stdout)
    summary = json.loads(full.stdout.strip().splitlines()[-1])
    assert summary["final_val_loss"] < summary["final_train_loss"] + 1.0  # a real validation set
    first = run(args + ["--out", str(tmp_path / "split"), "--stop-after", "2"], tmp_path)
    assert first.returncode == 0, first.stderr
    second = run(["--out", str(tmp_path / "split"), "--resume", "--no-progress", "--sample-tokens", "0"], tmp_path)
    assert second.returncode == 0, second.stderr
    a, b = losses(tmp_path / "full"), losses(tmp_path / "split")
    assert sorted(a) == sorted(b) == list(range(1, 6))
    assert [a[s] for s in range(1, 6)] == [b[s] for s in range(1, 6)]  # exact float equality


def _refusals(tmp_path, hf_tok, glob):
    write_nanogpt(tmp_path / "wide.bin", [1, 2, 300, 4] * 100)
    (tmp_path / "cut.bin").write_bytes(GOOD[:-1])
    return (
        (["--data", str(tmp_path / "cut.bin")], "truncated at byte 1223"),
        (["--data", str(tmp_path / "wide.bin")], "token id 300 at byte 4 is outside the vocabulary of --tokenizer byte"),
        (["--data", glob], "token id 299 at byte"),
        (["--data", glob, "--tokenizer", "bpe:300"], "--tokenizer bpe:300 trains a BPE on text"),
        (["--data", glob, "--tokenizer", f"hf:{tmp_path}"], "no tokenizer.json in that folder"),
        (["--data", glob, "--tokenizer", f"hf:{hf_tok}", "--block-size", "4000"], "holds no shard of more than"),
        (["--data", str(tmp_path / "none_*.bin")], "the pattern matches no file"),
    )


def test_cli_refuses_bad_data_in_one_line(sources, tmp_path, hf_tok, monkeypatch, capsys):
    """Each refusal is one line and exit status 2, before any device is opened (run in this
    process: the command line's checks come first)."""
    from helios.train import main

    monkeypatch.setenv("HELIOS_CACHE_DIR", str(tmp_path / "cache"))
    for extra, needle in _refusals(tmp_path, hf_tok, sources["llm.c glob"][1]):
        with pytest.raises(SystemExit) as e:
            main(BASE + ["--steps", "2", "--out", str(tmp_path / "x"), *extra])
        err = capsys.readouterr().err
        assert e.value.code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.vulkan
def test_cli_refusal_is_one_line_without_traceback(tmp_path):
    (tmp_path / "cut.bin").write_bytes(GOOD[:-1])
    r = run(BASE + ["--steps", "2", "--out", str(tmp_path / "x"), "--data", str(tmp_path / "cut.bin")], tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == (f"helios-train: error: --data '{tmp_path / 'cut.bin'}': truncated at byte 1223: the "
                                "llm.c header (byte 8) counts 100 tokens, which end at byte 1224")
