"""Proposing results on the Hub: one pull request with the card and the ``.eval_results`` files, in one commit.

The model's owner reviews the change, so everything goes through ``HfApi().create_commit(..., create_pr=True)``:
the current card and eval-results files are read from the repo, the new entries are merged into them (the same rules
as locally, :mod:`hf_geosharp.hub.cards`), and the merged files are committed together. Optionally the run's JSON goes
to a results dataset repo laid out like the Open LLM Leaderboard's details (``<org>/<model>/results_<timestamp>.json``,
one file per model and run), committed directly (it is the user's own repo).

Refused before any network use (and before anything is written locally, see ``geosharp card``) when
huggingface_hub is offline.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from huggingface_hub import CommitOperationAdd, EvalResult, HfApi

from .cards import (
    SOURCE_NAME,
    CardError,
    entries_yaml,
    eval_results_file,
    merge,
    merge_entries,
    new_card,
    parse_card,
    read_card_text,
    read_entries,
)

if TYPE_CHECKING:
    from huggingface_hub import EvalResultEntry

logger = logging.getLogger(__name__)


@dataclass
class Publication:
    """What to propose on one model repo."""

    repo_id: str
    model_index: list[EvalResult] = field(default_factory=list)
    eval_entries: list[EvalResultEntry] = field(default_factory=list)
    metadata: dict = field(default_factory=dict)
    #: How the numbers were measured, for the card's notes (:func:`hf_geosharp.hub.provenance.run_note`).
    note: str | None = None


def require_online(repo_id: str) -> None:
    """Refuse to push when huggingface_hub is offline, before any network use."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        raise CardError(
            f"cannot push to {repo_id!r}: the Hugging Face Hub is offline (HF_HUB_OFFLINE=1), so nothing was sent or "
            "written. Unset HF_HUB_OFFLINE on a machine with network access, or run without --push to write the "
            "local files only."
        )


def _remote_text(api: HfApi, repo_id: str, filename: str, repo_type: str = "model") -> str | None:
    """A file of the repo's main branch, or ``None`` when the Hub says the repo has no such file (a network failure
    is an error: a missing card must never be mistaken for an empty one and overwritten)."""
    from huggingface_hub.errors import RemoteEntryNotFoundError

    try:
        return read_card_text(api.hf_hub_download(repo_id, filename, repo_type=repo_type))
    except RemoteEntryNotFoundError:
        return None


def operations(api: HfApi, pub: Publication) -> list[CommitOperationAdd]:
    """The merged README.md and ``.eval_results`` files, as commit operations."""
    ops = []
    if pub.model_index:
        text = _remote_text(api, pub.repo_id, "README.md")
        card = parse_card(text, f"the README.md of {pub.repo_id!r}") if text is not None \
            else new_card(pub.repo_id.split("/")[-1])
        merge(card, pub.model_index, pub.repo_id.split("/")[-1], pub.metadata, pub.note)
        ops.append(CommitOperationAdd("README.md", str(card).encode()))
    for benchmark in dict.fromkeys(e.dataset_id for e in pub.eval_entries):
        path = eval_results_file(benchmark)
        text = _remote_text(api, pub.repo_id, path)
        old = read_entries(text) if text is not None else []
        ops.append(CommitOperationAdd(path, entries_yaml(
            merge_entries(old, [e for e in pub.eval_entries if e.dataset_id == benchmark])).encode()))
    return ops


def proposed_paths(pub: Publication) -> list[str]:
    """The files the pull request changes, in its order (known without reading the repo)."""
    return ((["README.md"] if pub.model_index else [])
            + [eval_results_file(b) for b in dict.fromkeys(e.dataset_id for e in pub.eval_entries)])


def pull_request_text(paths: list[str]) -> tuple[str, str]:
    """The pull request's title and body for the files it changes."""
    return f"Add sharpness results ({SOURCE_NAME})", "Proposed by `geosharp card --push`: " + ", ".join(paths)


def details_path(model: str, when: datetime | None = None) -> str:
    """Where a run's JSON goes in a results dataset: ``<org>/<model>/results_<UTC timestamp>.json``."""
    stamp = (when or datetime.now(timezone.utc)).strftime("%Y-%m-%dT%H-%M-%S.%f")
    return f"{model.strip('/')}/results_{stamp}.json"


def push(pub: Publication, *, token: str | None = None, results_repo: str | None = None,
         run_json: bytes | None = None, api: HfApi | None = None) -> dict[str, str]:
    """Open the pull request on ``pub.repo_id`` (and commit ``run_json`` to ``results_repo``); returns the URLs.

    Raises :class:`CardError` before any network use when offline, and with the cause when the Hub refuses."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    require_online(pub.repo_id)
    api = api or HfApi(token=token)
    urls: dict[str, str] = {}
    try:
        ops = operations(api, pub)
        if not ops:
            raise CardError("nothing to push: no model-index entries and no eval results.")
        title, body = pull_request_text([op.path_in_repo for op in ops])
        info = api.create_commit(pub.repo_id, operations=ops, create_pr=True, commit_message=title,
                                 commit_description=body)
        urls["pull_request"] = str(info.pr_url or info.commit_url)
        if results_repo and run_json is not None:
            path = details_path(pub.repo_id)
            info = api.create_commit(results_repo, repo_type="dataset", commit_message=f"Add {path}",
                                     operations=[CommitOperationAdd(path, run_json)])
            urls["results"] = str(info.commit_url)
    except OfflineModeIsEnabled as err:
        raise CardError(f"cannot push to {pub.repo_id!r}: the Hub is offline ({err}). Nothing was sent.") from None
    except (HfHubHTTPError, OSError) as err:
        raise CardError(
            f"could not open a pull request on {pub.repo_id!r}: {type(err).__name__}: {err}. Check the repo id, "
            "your network, and that your token (`hf auth login` or --token) may write to it."
        ) from None
    return urls
