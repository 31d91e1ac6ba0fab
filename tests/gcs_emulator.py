"""A local Google Cloud Storage emulator for tests (the `gcp-storage-emulator` package, in
a subprocess on 127.0.0.1): `GcsEmulator.start()` waits for it (bounded), `url` is what
STORAGE_EMULATOR_HOST takes, `make_bucket(name)` creates a bucket, `stop()` ends it.

The emulator leaves out two things of GCS's JSON API that tensorstore (orbax's writer)
relies on: a download's `x-goog-generation` header and the `ifGenerationMatch`
precondition of an upload. OCDBT's manifest is read, then rewritten only if its
generation is unchanged; without them the rewrite fails ("Malformed StorageGeneration").
Run as a script, this file serves the emulator with both added, as GCS has them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

START_TIMEOUT_S = 20.0


class GcsEmulator:
    def __init__(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen | None = None

    def start(self) -> GcsEmulator:
        # its log (a line per request) goes to a file: a pipe nobody reads fills up and
        # blocks the emulator, and with it every client
        self._log = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(
            [sys.executable, __file__, "start", "--host", "127.0.0.1", "--port",
             str(self.port), "--in-memory"],
            stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self._proc.poll() is not None:
                self._log.seek(0)
                raise RuntimeError("gcp-storage-emulator exited at start: "
                                   + self._log.read().decode()[-2000:])
            try:
                urllib.request.urlopen(self.url + "/storage/v1/b", timeout=1).read()
                return self
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"gcp-storage-emulator did not answer on {self.url} "
                                       f"within {START_TIMEOUT_S:.0f} s") from None
                time.sleep(0.1)

    def make_bucket(self, name: str) -> str:
        """Create bucket `name` (the emulator's JSON API, as `gcloud` would); its URL."""
        req = urllib.request.Request(f"{self.url}/storage/v1/b?project=test",
                                     data=f'{{"name": "{name}"}}'.encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=10).read()
        return f"gs://{name}"

    def environment(self) -> dict[str, str]:
        """What points gcsfs (and, through tfjax.storage, tensorstore) at the emulator."""
        return {"STORAGE_EMULATOR_HOST": self.url,
                # gcsfs's default client asks Google's control API for each bucket's type
                # (with credentials an emulator does not have): the plain client instead.
                "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None


def _with_generations() -> None:
    """Add GCS's generation header to downloads and its ifGenerationMatch precondition
    to media uploads (412 when the object's generation differs; 0: must not exist)."""
    from http import HTTPStatus

    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    def generation(storage, bucket, name) -> str:
        try:
            return str(storage.get_file_obj(bucket, name)["generation"])
        except NotFound:
            return "0"

    download, media_upload = objects.download, objects._media_upload

    def download_with_generation(request, response, storage, *args, **kwargs):
        download(request, response, storage, *args, **kwargs)
        gen = generation(storage, request.params["bucket_name"], request.params["object_id"])
        if gen != "0":
            response["x-goog-generation"] = gen

    def media_upload_if_generation_matches(request, response, storage):
        want = request.query.get("ifGenerationMatch")
        if want and want[0] != generation(storage, request.params["bucket_name"],
                                          request.query["name"][0]):
            response.status = HTTPStatus.PRECONDITION_FAILED
            response.json({"error": {"code": 412, "message": "Precondition Failed"}})
            return
        media_upload(request, response, storage)

    objects.download = download_with_generation  # before the server's routes are built
    objects._media_upload = media_upload_if_generation_matches


if __name__ == "__main__":
    _with_generations()
    from gcp_storage_emulator.__main__ import main

    main()
