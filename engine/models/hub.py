"""Models on the Hugging Face Hub: a repo id (`ORG/NAME`) resolved by `huggingface_hub` into the cache transformers and
vLLM share (`HF_HOME`, `HF_HUB_CACHE`, `HF_TOKEN`, `HF_HUB_OFFLINE` and `HF_ENDPOINT` are huggingface_hub's own).

Only what Kiln reads is downloaded, from the repo's top folder: configs, tokenizer files and chat templates, and the
weights (safetensors and their index, of the shards only those it lists; `pytorch_model*.bin` only for a repo with no
safetensors; a named GGUF file instead of either). A model already in the cache starts with no network: huggingface_hub
falls back to the cached snapshot when the Hub cannot be reached or is down, and reads only the cache under
`HF_HUB_OFFLINE=1`. Each failure is one line (`HubError`).
"""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path

# What Kiln reads of a repo besides its weights: configs (and the safetensors index), tokenizers, chat templates.
_METADATA = ["*.json", "*.jinja", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt"]
# Each format's weights, and the index that names its shards: a repo may hold files the index does not list (Mistral's
# consolidated.safetensors, the same weights again), which the loader would not read either
_WEIGHTS = [("*.safetensors", "model.safetensors.index.json"), ("pytorch_model*.bin", "pytorch_model.bin.index.json")]
# Kiln reads a snapshot's top folder only: a subfolder's files (a training checkpoint, another format) are not fetched
_SUBFOLDERS = ["*/*"]
# ORG/NAME as the Hub spells repo ids (letters, digits, '-', '_', '.'; no leading or trailing '.' or '-')
_REPO_ID = re.compile(r"^[\w][\w.-]{0,95}/[\w][\w.-]{0,95}$")


class HubError(ValueError):
    """A model that cannot be had from the Hub; the message is one line that says why and what to do."""


def looks_like_repo_id(model: str) -> bool:
    return bool(_REPO_ID.match(model)) and ".." not in model and not model.endswith((".", "-"))


def download(
    repo_id: str,
    revision: str | None = None,
    download_dir: str | None = None,
    gguf_file: str | None = None,
    weights: bool = True,
) -> Path:
    """The local snapshot of `repo_id` at `revision` (default: the main branch), downloaded into the Hub cache (or
    `download_dir`) when not there: metadata, and with `weights` the weights Kiln reads (or `gguf_file`)."""
    from huggingface_hub import constants, snapshot_download  # noqa: PLC0415 (only a Hub model needs it)
    from huggingface_hub.errors import (  # noqa: PLC0415
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id}" + (f" (revision {revision})" if revision else "")
    try:
        patterns = _patterns(repo_id, revision, download_dir, gguf_file) if weights else _METADATA
        ignored = _SUBFOLDERS if gguf_file is None else None  # (a GGUF file may lie in a subfolder)
        path = Path(
            snapshot_download(
                repo_id, revision=revision, cache_dir=download_dir, allow_patterns=patterns, ignore_patterns=ignored
            )
        )
    except GatedRepoError:
        raise HubError(
            f"{where} is gated or private: accept its terms on the Hub, then pass a token that may read it "
            "(HF_TOKEN=hf_..., or `hf auth login`)"
        ) from None
    except RevisionNotFoundError:
        raise HubError(f"{repo_id} has no revision {revision!r} (a branch, tag or commit of the repo)") from None
    except RepositoryNotFoundError:
        raise HubError(
            f"{repo_id} is not a model repo on {constants.ENDPOINT} (nor a local path or preset); a private repo needs "
            "a token (HF_TOKEN=hf_...)"
        ) from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else f"{constants.ENDPOINT} cannot be reached"
        raise HubError(f"{where} is not in the Hub cache and {why}: download it once with network access") from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status in (401, 403):
            raise HubError(f"{where}: the Hub refused access ({status}); pass a token that may read it") from None
        raise HubError(f"{where}: the Hub answered {status}: {str(e).splitlines()[0]}") from None
    if gguf_file is not None and not (path / gguf_file).is_file():
        raise HubError(f"{where} has no file {gguf_file!r} (--gguf-file)")
    return path


def _patterns(repo_id: str, revision: str | None, download_dir: str | None, gguf_file: str | None) -> list[str]:
    """The files to fetch: metadata and the weights Kiln reads, chosen from the repo's file list (the Hub's, or the
    cached listing when offline); a repo with none of them is refused."""
    if gguf_file is not None:
        return [*_METADATA, gguf_file]
    files = _repo_files(repo_id, revision, download_dir)
    if files is None:  # offline with no cached listing: whatever the cache holds
        return [*_METADATA, _WEIGHTS[0][0]]
    top = [name for name in files if "/" not in name]
    for pattern, index in _WEIGHTS:
        if any(fnmatch.fnmatch(name, pattern) for name in top):
            return [*_METADATA, *(_shards(repo_id, revision, download_dir, index) if index in top else [pattern])]
    ggufs = sorted(name for name in files if name.endswith(".gguf"))
    hint = f"; it holds GGUF files: pick one with --gguf-file (e.g. {ggufs[0]})" if ggufs else ""
    raise HubError(f"{repo_id} has no weights Kiln reads (*.safetensors, or pytorch_model*.bin){hint}")


def _shards(repo_id: str, revision: str | None, download_dir: str | None, index: str) -> list[str]:
    """The files a weights index names (the index itself is fetched, or read from the cache)."""
    from huggingface_hub import hf_hub_download  # noqa: PLC0415

    path = hf_hub_download(repo_id, index, revision=revision, cache_dir=download_dir)
    return sorted(set(json.loads(Path(path).read_text())["weight_map"].values()))


def _repo_files(repo_id: str, revision: str | None, download_dir: str | None) -> list[str] | None:
    """The repo's file names: from the Hub, else (offline, the Hub unreachable or down) the cached listing, else None.
    The Hub's other errors (no such repo, gated) are raised for `download` to word."""
    import httpx2  # noqa: PLC0415 (huggingface_hub's HTTP client)
    from huggingface_hub import HfApi, constants, get_cached_repo_tree  # noqa: PLC0415
    from huggingface_hub.errors import CachedRepoTreeNotFoundError, HfHubHTTPError, OfflineModeIsEnabled  # noqa: PLC0415

    if not constants.HF_HUB_OFFLINE:
        try:
            return [sibling.rfilename for sibling in HfApi().model_info(repo_id, revision=revision).siblings or []]
        except (httpx2.ConnectError, httpx2.TimeoutException, OfflineModeIsEnabled):
            pass
        except HfHubHTTPError as e:  # an outage (5xx): the cache answers, as snapshot_download's own fallback does
            if e.response is None or e.response.status_code < 500:
                raise
    try:
        return [entry.path for entry in get_cached_repo_tree(repo_id, revision=revision, cache_dir=download_dir)]
    except CachedRepoTreeNotFoundError:
        return None
