"""The demo's output folder (``--out``) made safe to write: what an earlier demo wrote there is
replaced, what else is there is kept, and a folder the demo did not write is refused."""

from __future__ import annotations

import json
import os
from pathlib import Path

from mlx_rwkvx.errors import UserError
from mlx_rwkvx.io.targets import remove_path, remove_stale

MARKER = ".mlx_rwkvx-demo"  # in --out: the manifest of what the demo wrote, which a rerun removes
# everything the demo writes in --out (its folders are its own: a rerun replaces them whole)
ENTRIES = (
    "data",
    "model_config.json",
    "pretrain",
    "mac-1",
    "mac-2",
    "merged-fedavg",
    "merged",
    "metrics.jsonl",
    "loss.png",
)


def prepare(out: Path) -> None:
    """Make ``out`` ready for the demo: a new or empty folder, or an earlier demo's, whose
    entries (its manifest, ``MARKER``, lists them) are removed and nothing else: what a user
    added is kept, and said once. A folder without a manifest that is not empty is refused.
    Called holding ``out``'s lock."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: not a folder")
    if out.exists() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise UserError(
            f"--out {out}: a folder the demo did not write (no {MARKER}); give an "
            "empty or new folder"
        )
    try:
        if out.exists():
            for name in _written_before(out):
                remove_path(str(out / name))
            remove_stale(str(out))  # what a killed stage was writing
        # (our own hidden files, such as a killed stage's lock, are no user's)
        kept = (
            sorted(p.name for p in out.iterdir() if not p.name.startswith(".mlx_rwkvx"))
            if out.exists()
            else []
        )
        out.mkdir(parents=True, exist_ok=True)
        manifest = {
            "written_by": "python -m mlx_rwkvx.demo: a rerun removes these, nothing else",
            "entries": list(ENTRIES),
        }
        (out / MARKER).write_text(json.dumps(manifest, indent=1) + "\n")
    except OSError as e:
        raise UserError(f"--out {out}: {e.strerror or e}") from e
    if kept:
        print(
            f"kept {len(kept)} thing{'s' if len(kept) > 1 else ''} of yours in {out}: "
            f"{', '.join(kept[:8])}{' ...' if len(kept) > 8 else ''}"
        )


def _written_before(out: Path) -> list[str]:
    """What an earlier demo wrote in ``out``: its manifest's entries, plain names in ``out``
    (a marker of the first demos, plain text, stands for every entry the demo writes)."""
    try:
        entries = json.loads((out / MARKER).read_text())["entries"]
    except (ValueError, KeyError, TypeError):
        return list(ENTRIES)
    if not isinstance(entries, list):
        return []
    plain = [e for e in entries if isinstance(e, str) and e not in ("", ".", "..", MARKER)]
    return [e for e in plain if os.sep not in e and (os.altsep or os.sep) not in e]
