"""Hugging Face Hub ids (`--model meta-llama/Llama-3.1-8B`, a recipe's model_name_or_path or
base_model) -> the path of that model's config.json, found as transformers' from_pretrained would
find it, without a network unless huggingface_hub is installed and allowed one:

1. the local Hugging Face cache in its standard layout (huggingface_hub/constants.py:
   HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub; a repo's files under
   models--{org}--{name}/snapshots/{commit}/, the commit main points at in refs/main);
2. huggingface_hub.hf_hub_download(repo_id, "config.json"), when the package is installed and
   HF_HUB_OFFLINE is not set (the optional extra `zsim[hub]`; imported here only, on demand; any
   failure, no network included, falls through quietly);
3. zsim's catalogue of released configs (scenarios/hub/, one file per repo id: the fields that
   shape the model, each file naming where its values were read in "_source");
4. else one line saying how to give the file.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from zsim.errors import ZsimInputError

# a repo id as the Hub spells it: owner/name of letters, digits, '-', '_', '.'
# (huggingface_hub/utils/_validators.py REPO_ID_REGEX, without the 96-character cap)
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w][\w.-]*$")
TRUE_VALUES = {"1", "ON", "YES", "TRUE"}   # huggingface_hub/constants.py ENV_VARS_TRUE_VALUES


def catalogue_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "scenarios" / "hub"


def catalogue() -> dict[str, Path]:
    """repo id -> its catalogue file (scenarios/hub/{org}--{name}.json)."""
    return {p.stem.replace("--", "/", 1): p for p in sorted(catalogue_dir().glob("*.json"))}


def is_repo_id(text: str) -> bool:
    """`org/name` that is not a file or folder here (a local path wins, as in from_pretrained)."""
    if not isinstance(text, str) or not _REPO_ID.match(text) or text.endswith((".json", ".yaml", ".yml")):
        return False
    try:
        return not Path(text).exists()
    except (OSError, ValueError):
        return False


def cache_dir() -> Path:
    """huggingface_hub/constants.py: HF_HUB_CACHE (or its older name HUGGINGFACE_HUB_CACHE),
    else $HF_HOME/hub, else ~/.cache/huggingface/hub ($XDG_CACHE_HOME/huggingface/hub)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.path.expanduser(os.environ[var]))
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return Path(os.path.expanduser(home)) / "hub"


def offline() -> bool:
    return (os.environ.get("HF_HUB_OFFLINE") or "").upper() in TRUE_VALUES


def from_cache(repo_id: str, revision: str = "main") -> Path | None:
    """The cached config.json of the snapshot refs/{revision} names (huggingface_hub's
    try_to_load_from_cache); a revision given as a commit hash is that snapshot itself."""
    repo = cache_dir() / ("models--" + repo_id.replace("/", "--"))
    ref = repo / "refs" / revision
    try:
        commit = ref.read_text(encoding="utf-8").strip() if ref.is_file() else revision
        path = repo / "snapshots" / commit / "config.json"
        return path if path.is_file() else None
    except (OSError, ValueError):
        return None


# [Note: no network, no wait] huggingface_hub retries a download whose connection fails (its
# http_backoff: five retries, 1+2+4+8+8 s, each logged as a warning): without a network a run
# would wait 23 s and print ten lines before reaching the catalogue. One TCP connection to the
# endpoint with a short timeout says first whether the Hub can be reached at all.
HUB_PROBE_TIMEOUT_S = 2.0


def hub_reachable() -> bool:
    """Whether a TCP connection to the Hub's endpoint (HF_ENDPOINT, default huggingface.co:443)
    opens within HUB_PROBE_TIMEOUT_S (see [Note: no network, no wait])."""
    import socket
    from urllib.parse import urlparse
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=HUB_PROBE_TIMEOUT_S).close()
        return True
    except OSError:
        return False


def from_hub(repo_id: str) -> Path | None:
    """hf_hub_download's path, or None: huggingface_hub absent, offline, no network, gated or
    unknown repo (each falls through to the catalogue)."""
    if offline():
        return None
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        return None
    if not hub_reachable():
        return None
    try:
        return Path(hf_hub_download(repo_id=repo_id, filename="config.json"))
    except Exception:      # any failure of the download (network, auth, 404) falls through quietly
        return None


def resolve(repo_id: str, field: str = "--model") -> tuple[Path, str]:
    """(path of the repo's config.json, where it was found: a phrase for the note)."""
    path = from_cache(repo_id)
    if path is not None:
        return path, f"the Hugging Face cache ({path})"
    path = from_hub(repo_id)
    if path is not None:
        return path, f"the Hugging Face Hub ({path})"
    known = {k.lower(): (k, p) for k, p in catalogue().items()}
    if repo_id.lower() in known:
        name, path = known[repo_id.lower()]
        return path, f"zsim's catalogue (scenarios/hub/{path.name}, architecture fields of {name})"
    raise ZsimInputError(field, repo_id, "no config.json for this Hub id in the Hugging Face cache "
                         f"({cache_dir()}) or zsim's catalogue; give the file (--model path/to/config.json) or "
                         f"download it: huggingface-cli download {repo_id} config.json")
