"""Models by Hugging Face name: ``org/name``, ``org/name@revision``, ``org/name/FILE`` or
``org/name@revision/FILE`` (FILE: one ``.pth`` or ``.safetensors`` of a repository holding
several, BlinkDL's way) resolved to a folder or file in the hub's own cache.

An existing path always wins. A name is fetched with huggingface_hub's ``snapshot_download``,
limited to the files we read (configs, tokenizer files, ``*.safetensors``, or the one FILE):
online it downloads with the hub's progress bars into its cache (``HF_HOME``, ``HF_HUB_CACHE``
as the hub documents them); offline (``HF_HUB_OFFLINE=1``, or no network) it uses the cache.
The patterns depend on the name alone, so an offline load checks the same files an online one
fetched. Every failure a user can cause is one ``CheckpointError`` naming the repository and
what to do.
"""

from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass

from mlx_rwkvx.io.atomic import CheckpointError

# what a model folder on the hub holds that we read: its config, weights, tokenizer and chat
# template (never the READMEs, images, other frameworks' weights or training logs)
FOLDER_FILES = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "rwkv_vocab_v20230424.txt",
]
# the weights of other frameworks, named when a repository holds nothing else
_FOREIGN = {
    "pytorch_model.bin": "PyTorch pickles of transformers models are not read: convert it to "
    "safetensors (transformers: save_pretrained(..., safe_serialization=True))",
    ".gguf": "GGUF files (llama.cpp) are not read",
    ".onnx": "ONNX files are not read",
}
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_NAME = re.compile(rf"({_PART})/({_PART})(?:@([^/\s]+))?(?:/([^\s]+))?")


@dataclass(frozen=True)
class HubName:
    repo: str
    revision: str | None
    file: str | None

    def __str__(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        return f"{self.repo}{rev}" + (f"/{self.file}" if self.file else "")


def hub_name(spec: str) -> HubName | None:
    """``spec`` read as a hub name, or None when it cannot be one."""
    m = _NAME.fullmatch(spec)
    if not m or spec.startswith((".", "/", "~")) or ".." in spec.split("/"):
        return None
    file = m[4]
    if file is not None and not file.endswith((".pth", ".safetensors")):
        return None  # org/name/sub/dir: a path, not a file of a repository
    return HubName(f"{m[1]}/{m[2]}", m[3], file)


def allow_patterns(name: HubName, weights: bool = True) -> list[str]:
    """The files fetched for ``name``: one weights file and the tokenizer's, or a folder's
    (``weights=False``: its configs and tokenizer files alone)."""
    small = [p for p in FOLDER_FILES if "*" not in p]
    if not weights:
        return small
    return [name.file, *small] if name.file else list(FOLDER_FILES)


_RESOLVED: dict[tuple, str] = {}  # one process asks the hub once per name and cache


def resolve_model(spec, weights: bool = True) -> str:
    """A local checkpoint path for ``spec``: itself when it exists (or is not a hub name: the
    reader then says it does not exist), else its snapshot in the hub's cache.
    ``weights=False``: only the tokenizer's and config files are fetched (the snapshot's
    folder is returned)."""
    path = os.fspath(spec) if isinstance(spec, os.PathLike) else spec
    if not isinstance(path, str) or os.path.exists(path):
        return path
    name = hub_name(path)
    if name is None:
        return path
    env = (os.environ.get(v) for v in ("HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE"))
    key = (path, weights, *env)
    found = _RESOLVED.get(key)
    if found is None or not os.path.exists(found):
        found = _RESOLVED[key] = _resolve(path, name, weights)
    return found


def _resolve(path: str, name: HubName, weights: bool) -> str:
    folder = _snapshot(path, name, weights)
    if not weights:
        return folder
    if name.file:
        found = os.path.join(folder, name.file)
        if not os.path.isfile(found):
            raise CheckpointError(f"{name.repo}: the repository has no file {name.file!r}")
        return found
    return _weights_in(folder, name)


def _snapshot(spec: str, name: HubName, weights: bool) -> str:
    try:
        from huggingface_hub import errors as hub_errors
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - a dependency of mlx-lm
        raise CheckpointError(f"{spec}: no such file or folder ({e})") from e
    repo = name.repo
    try:
        patterns = allow_patterns(name, weights)
        return snapshot_download(repo, revision=name.revision, allow_patterns=patterns)
    except _transport_errors() as e:  # the connection dropped, after the hub's own retries
        raise CheckpointError(f"{repo}: the download failed ({e}); run again to resume it") from e
    except hub_errors.GatedRepoError as e:
        raise CheckpointError(
            f"{repo}: a gated repository: accept its terms on huggingface.co, then log in "
            "(hf auth login) or set HF_TOKEN"
        ) from e
    except hub_errors.RepositoryNotFoundError as e:
        raise CheckpointError(
            f"{spec}: no such file or folder, and no Hugging Face repository {repo!r} (a typo? "
            "a private repository needs hf auth login or HF_TOKEN)"
        ) from e
    except hub_errors.RevisionNotFoundError as e:
        raise CheckpointError(f"{repo}: no revision {name.revision!r} in the repository") from e
    except hub_errors.LocalEntryNotFoundError as e:
        offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
        how = (
            "HF_HUB_OFFLINE is set: unset it to download"
            if offline
            else "the hub could not be reached: check the network and try again"
        )
        raise CheckpointError(
            f"{spec}: not a file or folder here, and {repo} is not (completely) in the "
            f"Hugging Face cache; {how}"
        ) from e
    except hub_errors.HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            raise CheckpointError(
                f"{repo}: access refused (HTTP {status}): log in (hf auth login) or set "
                "HF_TOKEN with access to it"
            ) from e
        raise CheckpointError(f"{repo}: the hub answered HTTP {status}; try again later") from e


def _transport_errors() -> tuple[type, ...]:
    """The network errors of the HTTP client huggingface_hub uses (httpx2, or httpx in older
    versions): a dropped connection is the user's network, not a bug."""
    found = []
    for module in ("httpx2", "httpx"):
        try:
            found.append(importlib.import_module(module).TransportError)
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def _weights_in(folder: str, name: HubName) -> str:
    """The checkpoint in a snapshot of a whole repository: the folder itself when it has a
    config, else its one ``.safetensors``; else one error naming what the repository has."""
    # a snapshot none of whose files we read is not even created
    held = os.listdir(folder) if os.path.isdir(folder) else []
    single = sorted(n for n in held if n.endswith(".safetensors"))
    has_config = os.path.exists(os.path.join(folder, "config.json"))
    if has_config and single:
        return folder
    if len(single) == 1 and not has_config:
        return os.path.join(folder, single[0])
    files = _repo_files(name)
    pth = [f for f in files if f.endswith(".pth")]
    if (len(single) > 1 or pth) and not has_config:
        choices = single or pth
        shown = ", ".join(choices[:4]) + (", ..." if len(choices) > 4 else "")
        raise CheckpointError(
            f"{name.repo}: holds checkpoint files ({shown}) and no config.json: "
            f"name one as {name.repo}/FILE (e.g. {name.repo}/{choices[0]})"
        )
    for marker, why in _FOREIGN.items():
        if any(f.endswith(marker) for f in files):
            raise CheckpointError(f"{name.repo}: holds {marker} weights only; {why}")
    if has_config:
        return folder  # a config without weights: the reader names what is missing
    listed = f" (it holds {', '.join(files[:6])})" if files else ""
    raise CheckpointError(
        f"{name.repo}: no checkpoint we read: no config.json with safetensors weights, no "
        f".safetensors or .pth file{listed}"
    )


def _repo_files(name: HubName) -> list[str]:
    """The repository's files (one listing call; empty offline: the cache cannot say)."""
    from huggingface_hub import HfApi

    try:
        return sorted(HfApi().list_repo_files(name.repo, revision=name.revision))
    except OSError:  # offline (the hub's errors are OSErrors): the message does without it
        return []
