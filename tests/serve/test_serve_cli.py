"""`python -m tfjax.serve`: bad flags are one line (exit status 2) before the model loads;
the command serves a checkpoint on 127.0.0.1 (a subprocess, stopped by the test)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
from serve_fixtures import greedy

from tfjax.serve.__main__ import main, parser


@pytest.mark.parametrize("argv, words", [
    (["--hf", "/no/such/dir"], "--hf: /no/such/dir is not a directory"),
    (["--hf", "/tmp", "--step", "3"], "--step is for --workdir runs"),
    (["--workdir", "/tmp", "--port", "70000"], "--port: 70000 is not a TCP port"),
    (["--workdir", "/tmp", "--max_queue", "0"], "--max_queue: must be >= 1"),
    (["--workdir", "/tmp", "--chunk", "0"], "EngineConfig.chunk: must be >= 1"),
])
def test_bad_flags_are_one_line(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1, err


def test_it_binds_127_0_0_1_unless_told_otherwise():
    a = parser().parse_args(["--hf", "x"])
    assert (a.host, a.port) == ("127.0.0.1", 8000)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # a python that imports jax, loads the model and compiles: ~20 s
def test_the_command_serves_a_checkpoint(checkpoint):
    path, model, tok = checkpoint
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.getcwd()] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    proc = subprocess.Popen([sys.executable, "-m", "tfjax.serve", "--hf", str(path), "--port",
                             str(port), "--max_len", "64", "--max_seqs", "2",
                             "--served_model_name", "tiny", "--log_level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the server did not start in 120 s"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny"
        r = httpx.post(f"{url}/v1/completions", timeout=60, json=dict(
            model="tiny", prompt="hello world", max_tokens=8, temperature=0)).json()
        want = greedy(model, tok, tok("hello world")["input_ids"], 8)
        assert r["choices"][0]["text"] == tok.decode(want, skip_special_tokens=True)
    finally:
        proc.terminate()
        proc.wait(30)
