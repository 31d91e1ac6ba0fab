"""`TokenCache.read` against a plain numpy concatenation of [bos] + ids + [eos] per
document, across shard and document boundaries; its shards read by grain's
`ArrayRecordDataSource`; a damaged shard (a flipped byte, cut short, a missing file)
is a one-line ValueError naming the file and the fix, never read silently."""

import json
import shutil

import numpy as np
import pytest

from tfjax.data import is_validation, load_tokenizer
from tfjax.data.cache import ShardWriter, TokenCache, ids_dtype
from tfjax.data.prepare import prepare

N_DOCS = 150


def _texts():
    rng = np.random.default_rng(0)
    # lengths 1..60 bytes, a few long ones spanning several reads
    return [("d%d " % i + "x" * int(rng.integers(0, 60 if i % 17 else 400))) for i in range(N_DOCS)]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cache")
    (d / "src").mkdir()
    (d / "src" / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts()))
    prepare([str(d / "src")], str(d / "out"), "byte", workers=1, shard_mb=700 / 2**20)
    return d / "out"


def _reference(split: str):
    tok = load_tokenizer("byte")
    texts = [t for i, t in enumerate(_texts()) if is_validation(f"a.jsonl:{i}") ==
             (split == "validation")]
    docs = [np.concatenate([[tok.bos_id], tok.encode(t), [tok.eos_id]]) for t in texts]
    owner = np.concatenate([np.full(len(d), i) for i, d in enumerate(docs)])
    return np.stack([np.concatenate(docs), owner]).astype(np.int32)


@pytest.mark.parametrize("split", ["train", "validation"])
def test_read_matches_a_plain_concatenation(cache_dir, split):
    cache = TokenCache(str(cache_dir), split)
    ref = _reference(split)
    assert cache.stream_length == ref.shape[1] == cache.num_tokens + 2 * cache.num_documents
    assert cache.name == "out" and cache.split == split
    assert (cache.bos_id, cache.eos_id, cache.vocab_size) == (257, 258, 259)
    assert cache.tokenizer_name == "byte"
    assert cache.tokenizer_fingerprint == load_tokenizer("byte").fingerprint
    if split == "train":
        assert len([s for s in cache.metadata["splits"]["train"]["shards"]]) > 5
    # every shard and document boundary, +-1, and random spans
    cuts = np.flatnonzero(np.diff(ref[1])) + 1
    points = sorted({0, ref.shape[1], *cuts, *(cuts - 1), *(cuts + 1)} - {-1, ref.shape[1] + 1})
    rng = np.random.default_rng(1)
    spans = [(0, 0), (0, ref.shape[1]), (ref.shape[1], ref.shape[1])]
    spans += [(a, a) for a in points[::7]] + [(a, b) for a, b in zip(points, points[3:])]
    spans += [tuple(sorted(rng.integers(0, ref.shape[1] + 1, 2))) for _ in range(200)]
    for a, b in spans:
        got = cache.read(a, b)
        assert got.shape == (2, b - a) and got.dtype == np.int32
        np.testing.assert_array_equal(got, ref[:, a:b], err_msg=f"read({a}, {b})")


def test_read_outside_the_stream_is_refused(cache_dir):
    cache = TokenCache(str(cache_dir))
    for a, b in [(-1, 3), (5, 4), (0, cache.stream_length + 1)]:
        with pytest.raises(ValueError, match=r"read\(.*\) outside 0 <= start <= stop <= "):
            cache.read(a, b)


def test_grain_reads_the_shards(cache_dir):
    grain = pytest.importorskip("grain")
    meta = json.loads((cache_dir / "metadata.json").read_text())
    shards = meta["splits"]["train"]["shards"]
    source = grain.sources.ArrayRecordDataSource([str(cache_dir / s["file"]) for s in shards])
    assert len(source) == meta["splits"]["train"]["num_documents"]
    ref = _reference("train")
    docs = np.split(ref[0], np.flatnonzero(np.diff(ref[1])) + 1)
    for i in (0, 1, len(source) // 2, len(source) - 1):
        np.testing.assert_array_equal(np.frombuffer(source[i], "<u2"), docs[i][1:-1])


@pytest.fixture
def fresh(cache_dir, tmp_path):
    """A copy of the cache that this process has not opened yet."""
    shutil.copytree(cache_dir, tmp_path / "c")
    return tmp_path / "c"


def _error(path, match):
    with pytest.raises(ValueError, match=match) as e:
        cache = TokenCache(str(path))
        cache.read(0, cache.stream_length)
    assert "\n" not in str(e.value)


@pytest.mark.bad_input
def test_a_flipped_byte_is_named(fresh):
    shard = fresh / "train" / "00003.arrayrecord"
    data = bytearray(shard.read_bytes())
    data[200] ^= 0x10
    shard.write_bytes(bytes(data))
    _error(fresh, rf"^{shard}: damaged token cache shard \(sha256 differs from metadata.json\); "
           "re-run python -m tfjax.data.prepare with the same inputs and --output$")


@pytest.mark.bad_input
def test_a_shard_cut_short_or_missing_is_named(fresh):
    shard = fresh / "train" / "00002.arrayrecord"
    shard.write_bytes(shard.read_bytes()[:-10])
    _error(fresh, rf"^{shard}: damaged token cache shard \(\d+ bytes, metadata.json says \d+\); re-run")
    shard.unlink()
    _error(fresh, rf"^{shard}: token cache shard is missing; re-run")


@pytest.mark.bad_input
def test_a_damaged_index_is_named(fresh):
    lengths = fresh / "train" / "00001.lengths.npy"
    lengths.write_bytes(lengths.read_bytes()[:-1] + b"\x07")
    _error(fresh, rf"^{lengths}: damaged token cache index \(sha256 differs")


@pytest.mark.bad_input
def test_not_a_cache(tmp_path, fresh):
    _error(tmp_path / "nothing", r"token cache .*nothing: is not a directory; run python -m "
           r"tfjax.data.prepare INPUT\.\.\. --output")
    (fresh / "metadata.json").unlink()
    _error(fresh, r"has no metadata.json \(its prepare did not finish\); run python -m")
    (tmp_path / "plain").mkdir()
    _error(tmp_path / "plain", "is not a token cache")


@pytest.mark.bad_input
def test_an_empty_split_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text("one document, in train")
    prepare([str(tmp_path / "a.txt")], str(tmp_path / "out"), "byte", workers=1)
    assert TokenCache(str(tmp_path / "out")).num_documents == 1
    with pytest.raises(ValueError, match="the validation split has no documents"):
        TokenCache(str(tmp_path / "out"), "validation")


def test_ids_dtype_and_ids_that_do_not_fit(tmp_path):
    assert ids_dtype(259) == np.dtype("<u2") and ids_dtype(65536) == np.dtype("<u2")
    assert ids_dtype(65537) == np.dtype("<u4")
    w = ShardWriter(tmp_path, "train", 0, ids_dtype(65536))
    with pytest.raises(ValueError, match=r"token id 70000 does not fit the cache's uint16"):
        w.add(np.array([1, 70000]))
    w = ShardWriter(tmp_path, "train", 1, ids_dtype(100_000))
    w.add(np.array([1, 70000]))
    entry = w.finish()
    assert entry["num_tokens"] == 2 and entry["num_documents"] == 1


def test_a_cache_on_a_bucket_reads_as_the_local_one(cache_dir, gcs_bucket):
    """prepare --output gs://... (the local GCS emulator): the same shards, and a
    TokenCache over the bucket reads what the local cache reads; a bucket that does not
    exist is one line naming the URL, before anything is tokenized."""
    src = cache_dir.parent / "src"
    url = f"{gcs_bucket}/caches/web"
    prepare([str(src)], url, "byte", workers=1, shard_mb=700 / 2**20)
    for split in ("train", "validation"):
        local, remote = TokenCache(str(cache_dir), split), TokenCache(url, split)
        assert remote.name == "web" and remote.stream_length == local.stream_length
        np.testing.assert_array_equal(remote.read(0, remote.stream_length),
                                      local.read(0, local.stream_length))
    with pytest.raises(ValueError, match=r"^--output: gs://no-such-bucket-tfjax/x: .*bucket"):
        prepare([str(src)], "gs://no-such-bucket-tfjax/x", "byte", workers=1)
