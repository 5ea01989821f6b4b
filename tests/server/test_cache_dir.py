"""``--cache-dir`` as real servers use it: a restart on hundreds of states holds no descriptor
for them, two servers share one folder (each resumes the other's conversations, neither dies,
the folder within its budget), the debris of a killed writer and the states of a configuration
no longer served are removed, everything is private (0700 / 0600), and a disk that refuses the
states (a file-size limit) leaves the server answering, with one warning."""

from __future__ import annotations

import json
import os
import resource
import stat
import subprocess
import sys
import urllib.request

from mlx_rwkvx.generation.prefix_cache import PrefixCache, folder_for
from mlx_rwkvx.io.states import read_header

import mlx.core as mx
import pytest
from helpers.parity import import_parity_extra
from helpers.serving import Server, chat_model, serving

import_parity_extra(("fastapi", "uvicorn"), extra="server")

USER = [{"role": "user", "content": "Hello, world!"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return chat_model(tmp_path_factory.mktemp("cache_dir"), seed=30)


def chat(server: Server, model: str, messages, max_tokens: int = 4) -> dict:
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens})
    request = urllib.request.Request(
        server.url + "/chat/completions",
        data=body.encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.status == 200
        return json.loads(r.read())


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def state_files(folder) -> dict[str, int]:
    """Our saved states under ``folder`` (any depth) and their sizes."""
    return {
        os.path.join(root, f): os.path.getsize(os.path.join(root, f))
        for root, _, files in os.walk(folder)
        for f in files
        if f.endswith(".safetensors") and not f.startswith(".")
    }


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def dead_pid() -> int:
    return int(
        subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
        ).stdout
    )


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_a_restart_on_many_states_and_two_servers_on_one_folder(model, tmp_path):
    cache_dir = tmp_path / "made" / "states"  # missing: made private
    with serving("--model", model, "--cache-dir", cache_dir) as first:
        a = chat(first, model, USER)
    (folder,) = [p for p in cache_dir.iterdir() if p.is_dir()]
    assert mode(tmp_path / "made") == mode(cache_dir) == mode(folder) == 0o700
    assert state_files(folder) and {mode(p) for p in state_files(folder)} == {0o600}
    key = read_header(next(iter(state_files(folder)))).identity
    filler = PrefixCache(10**9, folder=str(folder), key=key)  # 300 states of no conversation
    for i in range(300):
        filler.put([7, 7, 7, i], {"state": [mx.zeros((64,))]})
    filler.close()
    retired = PrefixCache(10**9, folder=folder_for(str(cache_dir), "retired"), key="retired")
    for i in range(3):  # a configuration no longer served
        retired.put([i], {"state": [mx.zeros((20000,))]})
    retired.close()
    debris = folder / f".mlx_rwkvx-tmp-{dead_pid()}.new.{'a' * 32}.safetensors"  # a kill -9's
    debris.write_bytes(b"half a state")
    (cache_dir / "notes.txt").write_text("the user's")
    budget = sum(state_files(folder).values()) + 10 * max(state_files(folder).values())

    args = ("--model", model, "--cache-dir", cache_dir, "--cache-bytes", budget)
    with serving(*args) as one, serving(*args) as two:
        descriptors = len(os.listdir(f"/proc/{one.proc.pid}/fd"))
        assert descriptors < 100, descriptors  # 300 states saved, none held open
        assert not debris.exists() and (cache_dir / "notes.txt").exists()
        assert not os.path.exists(retired.folder)  # its states removed, then the folder
        again = chat(one, model, USER)  # the conversation before the restart resumes
        assert cached(again) == a["usage"]["prompt_tokens"]
        assert again["choices"][0]["message"] == a["choices"][0]["message"]
        talk = [{"role": "user", "content": "Another, longer conversation, Bob."}]
        b = chat(one, model, talk, max_tokens=8)
        talk += [b["choices"][0]["message"], {"role": "user", "content": "And then?"}]
        c = chat(two, model, talk)  # the other server's state, taken from the folder
        assert cached(c) >= b["usage"]["prompt_tokens"]
        for i in range(6):  # both write the same states: neither stops
            same = [{"role": "user", "content": f"Same text {i}"}]
            for server in (one, two):
                chat(server, model, same)
        assert sum(state_files(cache_dir).values()) <= budget
        assert one.proc.poll() is None and two.proc.poll() is None
    assert {mode(p) for p in state_files(cache_dir)} == {0o600}


@pytest.mark.skipif(not hasattr(resource, "prlimit"), reason="needs resource.prlimit (Linux)")
def test_a_disk_that_refuses_the_states_leaves_the_server_answering(model, tmp_path):
    """A file-size limit smaller than any state: every write fails (EFBIG), one warning, and
    every request is answered; a conversation still resumes from memory."""
    server = Server(["--model", model, "--cache-dir", tmp_path / "states"])
    try:
        resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE, (512, resource.RLIM_INFINITY))
        first = chat(server, model, USER)
        for i in range(4):
            chat(server, model, [{"role": "user", "content": f"Question {i}?"}])
        again = chat(server, model, USER)
        assert cached(again) == first["usage"]["prompt_tokens"]
        assert server.proc.poll() is None
        assert not state_files(tmp_path / "states")
    finally:
        out = server.stop()
    assert server.proc.returncode == 0, out
    assert out.count("could not be saved") == 1, out
