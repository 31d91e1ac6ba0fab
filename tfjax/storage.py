"""The file layer: every path tfjax takes (caches, workdirs, `init_from`) may be local or
an fsspec URL (`gs://bucket/dir`, `s3://...`), opened through etils `epath`.

What needs a local file (ArrayRecord's C++ reader, safetensors, TensorBoard's writer)
goes through `local_copy` (downloaded once, by checksum when one is known) or
`local_directory` (a directory's files, downloaded again only when changed), or is
staged locally and `upload`ed. Objects on a bucket appear whole when their upload finishes, so
`write_atomic` writes them directly (a rename there is a copy). `check_reachable` turns
a missing bucket, missing credentials or no connection into one line naming the URL and
the fix. With `STORAGE_EMULATOR_HOST` set, orbax's tensorstore is pointed at the same
emulator. See docs/data.md ("Buckets").
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import tempfile

from etils import epath

__all__ = ["check_reachable", "download_directory", "is_remote", "local_copy",
           "local_directory", "path", "upload", "write_atomic"]

_INSTALL = "pip install 'tfjax[cloud]' (gcsfs for gs://; s3fs for s3://)"


def is_remote(p) -> bool:
    """True for a URL with a scheme other than file:// (gs://, s3://, ...)."""
    s = os.fspath(p)
    return "://" in s and not s.startswith("file://")


def path(p) -> epath.Path:
    """`p` as an `epath.Path` (a local path made absolute, `~` expanded)."""
    if is_remote(p):
        _emulator_settings()
        return epath.Path(os.fspath(p))
    s = os.fspath(p)
    return epath.Path(os.path.abspath(os.path.expanduser(s.removeprefix("file://"))))


def write_atomic(p, data: bytes) -> None:
    """Write `data` to `p` so that a reader sees the old file or the new one, never part:
    locally a temporary file renamed into place; on a bucket one upload (objects appear
    whole)."""
    dst = path(p)
    if is_remote(dst):
        dst.write_bytes(data)
        return
    tmp = dst.parent / (dst.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(dst)


def upload(local_file, remote) -> None:
    """Copy the local file `local_file` to `remote` (any path the file layer takes)."""
    if not is_remote(remote):
        dst = path(remote)
        dst.parent.mkdir(parents=True, exist_ok=True)
        epath.Path(local_file).copy(dst, overwrite=True)
        return
    fs, where = _fs(remote)
    fs.put_file(os.fspath(local_file), where)


def download_directory() -> epath.Path:
    """Where `local_copy` keeps what it downloads: $TFJAX_DOWNLOADS, else
    ~/.cache/tfjax/downloads."""
    return epath.Path(os.environ.get("TFJAX_DOWNLOADS")
                      or os.path.expanduser("~/.cache/tfjax/downloads"))


def local_copy(p, sha256: str | None = None) -> str:
    """A local file with the contents of `p`: `p` itself when local, else a download
    kept under `download_directory()`. With `sha256`, the copy is named by it, checked
    while it downloads (a mismatch is a ValueError, the copy not kept) and reused by
    later calls; without, it is named by the URL and downloaded again each call."""
    if not is_remote(p):
        return os.fspath(path(p))
    src = os.fspath(p)
    name = sha256 or hashlib.sha256(src.encode()).hexdigest()
    suffix = "".join(epath.Path(src).suffixes[-1:])
    dst = download_directory() / f"{name}{suffix}"
    if sha256 and dst.exists():
        return os.fspath(dst)
    _download(src, dst, sha256)
    return os.fspath(dst)


def local_directory(p, names: tuple[str, ...] = ("*",)) -> str:
    """A local directory holding the files of directory `p` whose names match one of the
    globs `names` (not its subdirectories): `p` itself when local, else a mirror under
    `download_directory()` named by the URL, where a file is downloaded again only when
    its version on the bucket (fsspec's `ukey`: generation, size, time) changed."""
    if not is_remote(p):
        return os.fspath(path(p))
    url = os.fspath(p).rstrip("/")
    fs, where = _fs(url)
    dst = download_directory() / ("dir-" + hashlib.sha256(url.encode()).hexdigest()[:32])
    fs.invalidate_cache(where)  # the listing as it is now, not as this process saw it
    for info in fs.ls(where, detail=True):
        name = info["name"].rstrip("/").rsplit("/", 1)[-1]
        if info.get("type") != "file" or not any(fnmatch.fnmatch(name, g) for g in names):
            continue
        version = str(fs.ukey(info["name"]))
        stamp = dst / f".{name}.version"
        if (dst / name).exists() and stamp.exists() and stamp.read_text() == version:
            continue
        _download(f"{url}/{name}", dst / name)
        stamp.write_text(version)
    dst.mkdir(parents=True, exist_ok=True)  # an empty match: an empty directory
    return os.fspath(dst)


def _download(src: str, dst: epath.Path, sha256: str | None = None) -> None:
    """Copy remote `src` to local `dst` whole or not at all (a temporary file renamed
    into place), checking `sha256` when given."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.fspath(dst.parent), prefix=dst.name + ".")
    h = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out, path(src).open("rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
                out.write(chunk)
        if sha256 and h.hexdigest() != sha256:
            raise ValueError(f"{src}: sha256 {h.hexdigest()[:12]}... differs from the expected "
                             f"{sha256[:12]}... (damaged or replaced)")
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def check_reachable(url, field: str, *, must_exist: bool = False) -> None:
    """Raise a one-line ValueError naming `field`, `url` and the fix when `url`'s bucket
    cannot be reached (no fsspec implementation for its scheme, no credentials, no such
    bucket, no connection); with `must_exist`, also when `url` itself is missing. Local
    paths and reachable URLs return None."""
    if not is_remote(url):
        if must_exist and not path(url).exists():
            raise ValueError(f"{field}: {url} does not exist")
        return
    url = os.fspath(url)
    scheme, rest = url.split("://", 1)
    bucket = rest.split("/", 1)[0]
    where = f"{field}: {url}"
    if not bucket:
        raise ValueError(f"{where}: no bucket in the URL; write {scheme}://BUCKET/PATH")
    try:
        fs, _ = _fs(url)
    except (ImportError, ValueError) as e:
        raise ValueError(f"{where}: no file system for {scheme}:// ({_first_line(e)}); "
                         f"{_INSTALL}") from None
    try:
        if not fs.exists(f"{scheme}://{bucket}"):
            raise FileNotFoundError(bucket)
        if must_exist and not fs.exists(url):
            raise ValueError(f"{where} does not exist; check the path")
    except ValueError:
        raise
    except FileNotFoundError:
        raise ValueError(f"{where}: bucket {scheme}://{bucket} does not exist; create it "
                         f"(gcloud storage buckets create {scheme}://{bucket}) or fix the "
                         "path") from None
    except Exception as e:  # noqa: BLE001 - the clients' errors, sorted into fixes below
        raise ValueError(f"{where}: {_why(e)}") from None


def _why(e: BaseException) -> str:
    """A client error as its cause and fix, in a few words."""
    text = _first_line(e)
    name = type(e).__name__
    code = getattr(e, "code", None) or getattr(e, "status", None)
    if "credential" in text.lower() or "DefaultCredentials" in name or code in (401,):
        return (f"no usable Google Cloud credentials ({name}: {text}); run `gcloud auth "
                "application-default login`, or set GOOGLE_APPLICATION_CREDENTIALS to a "
                "service account key file")
    if code == 403 or "permission" in text.lower() or "forbidden" in text.lower():
        return (f"access denied ({name}: {text}); grant this account storage access to the "
                "bucket (roles/storage.objectAdmin), or use credentials that have it")
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    target = f"the emulator at STORAGE_EMULATOR_HOST={emulator}" if emulator else "the bucket"
    return (f"cannot reach {target} ({name}: {text}); check the network"
            + (" and that the emulator runs" if emulator else " and the URL"))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().split("\n")[0]
    return text if len(text) <= 160 else text[:157] + "..."


def _fs(url):
    import fsspec  # with etils' epath: fsspec is what it opens gs:// with

    _emulator_settings()
    return fsspec.core.url_to_fs(os.fspath(url))


def _emulator_settings() -> None:
    """With STORAGE_EMULATOR_HOST (gcsfs's and google-cloud-storage's emulator variable),
    point orbax's tensorstore at the same emulator (TENSORSTORE_GCS_HTTP_URL) with the
    placeholder token an emulator accepts (it checks none), unless these are set."""
    host = os.environ.get("STORAGE_EMULATOR_HOST")
    if host and host != "default":
        url = host if host.startswith(("http://", "https://")) else f"http://{host}"
        os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", url)
        os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
