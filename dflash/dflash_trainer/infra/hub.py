"""The Hugging Face hub, asked once and briefly: a name that is not a local path is only tried on the
hub when the hub answers (its client would otherwise retry for a minute before saying it is offline)."""

from __future__ import annotations

import functools
import re
import socket
from pathlib import Path
from urllib.parse import urlparse

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # "gpt2" or "org/name"


def looks_like_hub_id(name: str) -> bool:
    """Could be a hub repository id: at most one '/', no leading '.', '/' or '~'."""
    return bool(_HUB_ID.match(name)) and ".." not in name


def endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


@functools.cache
def reachable(timeout_s: float = 3.0) -> bool:
    """One TCP connection to the hub's endpoint, within timeout_s."""
    if offline():
        return False
    url = urlparse(endpoint())
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                      timeout=timeout_s):
            return True
    except OSError:
        return False


def cached_model(repo_id: str) -> bool:
    """The model's config.json is in the local hub cache (it loads without the network)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except (ValueError, OSError):  # an id the cache cannot even hold
        return False


def unavailable_reason(name: str, noun: str = "directory") -> str:
    """Why a missing local path cannot be a hub name either (empty when it may be one)."""
    where = Path(name).expanduser().absolute()
    if not looks_like_hub_id(name):
        return f"no such {noun}: {where}"
    if offline():
        return f"no such {noun} ({where}), and the hub is switched off (HF_HUB_OFFLINE) for a hub id"
    if not reachable():
        return f"no such {noun} ({where}), and the hub ({endpoint()}) is not reachable for a hub id"
    return ""


def remote_code_hint(exc: BaseException, how: str) -> str:
    """"; ... `how` ..." when transformers refused a directory that ships its own modelling code (its refusal
    names its keyword argument), else "": each command says it with its own flag or key."""
    if "trust_remote_code" not in str(exc):
        return ""
    return (f"; its family is not in the installed transformers and the directory ships its own code: run it "
            f"only if you trust it, with {how}")


# What a drafter directory needs from a hub repository: its config and weights (never code: the drafter
# class is this trainer's own).
DRAFTER_FILES = ("*.json", "*.safetensors")


class HubError(Exception):
    """A hub id that cannot be had: unknown to the hub, or not cached while the hub cannot be asked."""


def local_model(name: str, where: str, noun: str = "drafter directory", files=DRAFTER_FILES) -> Path:
    """The local directory `name` names; or, for a hub id, its snapshot in the local hub cache: brought up to date
    when the hub answers, read from the cache as it is when it does not, as from_pretrained resolves a target.
    HubError says why neither works, naming `where` (the setting or flag that gave it) and the fix."""
    local = Path(name).expanduser()
    if local.exists() or not looks_like_hub_id(name):
        return local
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    reason = unavailable_reason(name, noun)
    if not reason:  # the hub answers: its current snapshot (files the cache holds are not downloaded again)
        try:
            return Path(snapshot_download(name, allow_patterns=list(files)))
        except HfHubHTTPError as exc:
            status = getattr(exc.response, "status_code", None)
            what = ("the hub has no such repository (or it is private or gated: log in with hf auth login)"
                    if status in (401, 403, 404) else f"the hub answered {status or exc}")
            raise HubError(f"{where} {name!r}: no such {noun} ({local.absolute()}), and {what}; give a local "
                           f"{noun} or a hub id that exists") from None
    try:
        return Path(snapshot_download(name, allow_patterns=list(files), local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        raise HubError(f"{where} {name!r}: {reason}, and it is not in the local hub cache ({constants.HF_HUB_CACHE}): "
                       f"give a local {noun}, or download it once where the hub answers (hf download {name}; "
                       "HF_HOME or HF_HUB_CACHE names the cache)") from None


def push_problem(repo_id: str, where: str) -> str:
    """Why a push to repo_id could not happen from here (checked before training, in seconds), or ""."""
    if offline():
        return (f"{where} {repo_id}: the hub is switched off (HF_HUB_OFFLINE), so the drafter could not be pushed "
                "after training: unset HF_HUB_OFFLINE, or leave the push out and upload OUTPUT/drafter later "
                f"(hf upload {repo_id} OUTPUT/drafter)")
    if not reachable():
        return (f"{where} {repo_id}: the hub ({endpoint()}) is not reachable from here, so the drafter could not be "
                f"pushed after training: leave the push out and upload OUTPUT/drafter later from a machine that "
                f"reaches it (hf upload {repo_id} OUTPUT/drafter)")
    return ""


def push_dir(directory: Path, repo_id: str, private: bool, message: str) -> str:
    """Every file in directory uploaded to the hub model repository repo_id (created when missing) as one
    commit; returns the commit's URL. HubError names the repository, what the hub said and the fix."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        return str(api.upload_folder(folder_path=str(directory), repo_id=repo_id, commit_message=message))
    except (HfHubHTTPError, OSError, ValueError) as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        why = ("no login that may write there (hf auth login, or HF_TOKEN with write access)"
               if status in (401, 403) else f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        raise HubError(f"pushing {directory} to the hub repository {repo_id} failed ({why}); the drafter is "
                       f"intact there: upload it again with hf upload {repo_id} {directory}") from exc
