"""tfjax.storage against a local GCS emulator (tests/gcs_emulator.py): paths, atomic
writes, uploads, checksummed downloads, directory mirrors, and the one-line errors of a bucket that does
not exist, a scheme without a file system, an emulator that does not answer and
missing credentials."""

import hashlib
import os

import pytest

from tfjax import storage


def test_local_and_remote_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert not storage.is_remote("a/b") and not storage.is_remote("file:///x")
    assert storage.is_remote("gs://b/x") and storage.is_remote("s3://b/x")
    assert os.fspath(storage.path("a/b")) == str(tmp_path / "a" / "b")
    assert os.fspath(storage.path("file:///x/y")) == "/x/y"


def test_write_upload_and_download(gcs_bucket, tmp_path):
    url = f"{gcs_bucket}/run/x.json"
    storage.write_atomic(url, b"one")
    storage.write_atomic(url, b"two")  # replaced whole
    assert storage.path(url).read_bytes() == b"two"
    local = tmp_path / "big.bin"
    data = os.urandom(3 << 20)  # several download chunks
    local.write_bytes(data)
    storage.upload(local, f"{gcs_bucket}/run/big.bin")
    sha = hashlib.sha256(data).hexdigest()
    got = storage.local_copy(f"{gcs_bucket}/run/big.bin", sha)
    assert open(got, "rb").read() == data and os.path.basename(got) == sha + ".bin"
    storage.path(f"{gcs_bucket}/run/big.bin").write_bytes(b"other")
    assert storage.local_copy(f"{gcs_bucket}/run/big.bin", sha) == got  # by checksum: kept
    storage.path(f"{gcs_bucket}/run/big2.bin").write_bytes(b"other")
    with pytest.raises(ValueError, match=r"big2\.bin: sha256 .* differs"):
        storage.local_copy(f"{gcs_bucket}/run/big2.bin", "0" * 64)
    assert sorted(os.listdir(os.path.dirname(got))) == [os.path.basename(got)]  # none kept
    # a local path is its own copy; an empty file downloads
    assert storage.local_copy(local) == str(local)
    storage.write_atomic(f"{gcs_bucket}/empty", b"")
    assert open(storage.local_copy(f"{gcs_bucket}/empty"), "rb").read() == b""


def test_local_directory_mirrors_matching_files_and_follows_changes(gcs_bucket, tmp_path,
                                                                   monkeypatch):
    for name, data in (("config.json", b"{}"), ("a.safetensors", b"A"), ("notes.txt", b"n"),
                       ("sub/b.safetensors", b"B")):
        storage.write_atomic(f"{gcs_bucket}/ckpt/{name}", data)
    fetched = []
    download = storage._download
    monkeypatch.setattr(storage, "_download", lambda src, dst, sha256=None: (
        fetched.append(src.rsplit("/", 1)[1]), download(src, dst, sha256)))
    names = ("*.safetensors", "config.json")
    local = storage.local_directory(f"{gcs_bucket}/ckpt/", names)
    assert sorted(f for f in os.listdir(local) if not f.startswith(".")) == [
        "a.safetensors", "config.json"]  # not notes.txt, not the subdirectory's
    assert open(os.path.join(local, "a.safetensors"), "rb").read() == b"A"
    assert sorted(fetched) == ["a.safetensors", "config.json"]
    fetched.clear()
    assert storage.local_directory(f"{gcs_bucket}/ckpt", names) == local  # unchanged: kept
    assert fetched == []
    storage.write_atomic(f"{gcs_bucket}/ckpt/a.safetensors", b"A2")  # replaced on the bucket
    storage.local_directory(f"{gcs_bucket}/ckpt", names)
    assert fetched == ["a.safetensors"]
    assert open(os.path.join(local, "a.safetensors"), "rb").read() == b"A2"
    assert storage.local_directory(tmp_path) == str(tmp_path)  # local: itself


def test_local_write_atomic_and_upload(tmp_path):
    storage.write_atomic(tmp_path / "a.json", b"1")
    assert (tmp_path / "a.json").read_bytes() == b"1" and not (tmp_path / "a.json.tmp").exists()
    storage.upload(tmp_path / "a.json", tmp_path / "deep" / "b.json")
    assert (tmp_path / "deep" / "b.json").read_bytes() == b"1"


@pytest.mark.bad_input
def test_reachable_bucket_and_the_errors(gcs_bucket, gcs_emulator, monkeypatch, tmp_path):
    storage.check_reachable(f"{gcs_bucket}/not/yet", "--output")  # a new prefix is fine
    storage.check_reachable(tmp_path / "new", "--workdir")
    with pytest.raises(ValueError, match=r"^--output: gs://no-such-bucket-x/c: bucket "
                                         r"gs://no-such-bucket-x does not exist; create it"):
        storage.check_reachable("gs://no-such-bucket-x/c", "--output")
    with pytest.raises(ValueError, match=r"^init_from: .*/absent does not exist"):
        storage.check_reachable(f"{gcs_bucket}/absent", "init_from", must_exist=True)
    with pytest.raises(ValueError, match=r"^data.paths\[0\]: nofs://b/c: no file system for "
                                         r"nofs:// .*pip install 'tfjax\[cloud\]'"):
        storage.check_reachable("nofs://b/c", "data.paths[0]")
    with pytest.raises(ValueError, match=r"^--output: gs:///c: no bucket in the URL"):
        storage.check_reachable("gs:///c", "--output")


def _credentials_missing():
    from google.auth.exceptions import DefaultCredentialsError
    return DefaultCredentialsError("Your default credentials were not found")


def _http(code, message):
    from gcsfs.retry import HttpError
    return HttpError({"code": code, "message": message})


@pytest.mark.bad_input
@pytest.mark.parametrize("error, fix", [
    (_credentials_missing, "gcloud auth application-default login"),
    (lambda: _http(401, "Anonymous caller"), "gcloud auth application-default login"),
    (lambda: _http(403, "no storage.objects.list access"), "roles/storage.objectAdmin"),
    (lambda: OSError("Cannot connect to host 127.0.0.1:1"), "check the network"),
], ids=["no-credentials", "401", "403", "no-connection"])
def test_client_errors_name_the_fix(error, fix, monkeypatch):
    class Failing:
        def exists(self, _):
            raise error()

    monkeypatch.setattr(storage, "_fs", lambda url: (Failing(), url))
    with pytest.raises(ValueError) as e:
        storage.check_reachable("gs://b/run", "--workdir")
    line = str(e.value)
    assert line.startswith("--workdir: gs://b/run: ") and fix in line and "\n" not in line
