"""Whether a results file belongs on a model's card, and what the card must say about how it was measured.

A card states numbers about one model, so ``geosharp card`` checks the weights' sha256 that ``geosharp run``
recorded (``model_source.weights_sha256``) against the model folder's before anything is written, and refuses
results measured on other weights unless ``--force`` is given (the card then says so). What a reader cannot see in
the numbers (a freshly initialised ``--head``, a forced publication) goes into the entries' notes and into one
block of notes in the card's text, one line per entry, kept in step with the entries when a rerun replaces them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult

from ..engine.result import certificate_words
from ..leaderboard.store import weights_digests

BEGIN, END = "<!-- hf_geosharp notes: `geosharp card` keeps these lines in step with the entries -->", \
    "<!-- /hf_geosharp notes -->"
_BLOCK = re.compile(re.escape(BEGIN) + r"\r?\n(.*?)" + re.escape(END) + r"(\r?\n)?", re.S)
HEADING = "**Notes on the sharpness results**"


class ForeignResults(ValueError):
    """The results were measured on weights other than the model folder's."""


def check_weights(context: dict[str, Any], folder: Path, force: bool) -> tuple[bool, list[str]]:
    """Check the weights a run recorded against ``folder``'s, computed the same way (each weight file's sha256).

    Results without a recorded digest (``SharpnessResult.to_dict()`` output, a run of a Hub id) are published with
    a warning rather than refused: their own writers never record one, so a refusal would only teach ``--force``.

    Args:
        context: the run file's top level (``model_source`` is read).
        folder: the model folder the card belongs to.
        force: publish results of other weights anyway.

    Returns:
        Whether the publication is forced past a mismatch, and the warnings to print.

    Raises:
        ForeignResults: the digests differ and ``force`` is off; nothing has been written.
    """
    recorded = (context.get("model_source") or {}).get("weights_sha256")
    source = (context.get("model_source") or {}).get("source") or context.get("model_name") or "the measured model"
    if not recorded:
        return False, [f"the results record no weights sha256 (not a `geosharp run --json` file of a model folder), "
                       f"so nothing shows they were measured on {str(folder)!r}'s weights; check before publishing."]
    here = weights_digests(folder)
    if not here:
        return False, [f"{str(folder)!r} holds no weight files (*.safetensors, *.bin), so the results' weights "
                       "sha256 could not be checked against it."]
    if here == recorded:
        return False, []
    differ = "; ".join(f"{name}: results {recorded.get(name, 'absent')[:12]}, folder {here.get(name, 'absent')[:12]}"
                       for name in sorted(set(here) | set(recorded)) if here.get(name) != recorded.get(name))
    if not force:
        raise ForeignResults(f"the results were measured on other weights than those in {str(folder)!r} ({source}; "
                             f"sha256 {differ}), so they do not describe this model. Run `geosharp run` on this "
                             "folder, or pass --force to publish them anyway (the card then says so). Nothing was "
                             "written.")
    return True, [f"--force: publishing results measured on other weights ({differ}); the card says so."]


def run_note(context: dict[str, Any], forced: bool) -> str | None:
    """What the card must say about how the numbers were measured, or None when there is nothing to say.

    Args:
        context: the run file's top level (``config.head`` is read).
        forced: the publication went past a weights mismatch (:func:`check_weights`).

    Returns:
        One sentence fragment, or None.
    """
    parts = []
    head = (context.get("config") or {}).get("head")
    if head:
        parts.append(f"measured with a freshly initialised {head.get('num_labels')}-class head (seed "
                     f"{head.get('seed')}, `--head`), not a trained one: the numbers describe the encoder with that "
                     "random head")
    if forced:
        parts.append("measured on weights other than this model's (their sha256 differ; published with --force)")
    return "; ".join(parts) or None


def head_args(context: dict[str, Any]) -> dict[str, Any]:
    """The model-index metric args that say a fresh head was measured.

    Args:
        context: the run file's top level (``config.head`` is read).

    Returns:
        ``{"head": "new, N classes, seed S"}``, or ``{}`` for the model's own head.
    """
    head = (context.get("config") or {}).get("head")
    return {"head": f"new, {head.get('num_labels')} classes, seed {head.get('seed')}"} if head else {}


def entry_key(entry: EvalResult) -> str:
    """How a note line names its entry.

    Args:
        entry: a model-index entry.

    Returns:
        Its display name without the certificate, its data and split.
    """
    name = entry.metric_name.replace(f", {certificate_words(False)}", "")
    data = entry.dataset_type + (f"/{entry.dataset_config}" if entry.dataset_config else "")
    return f"{name} on {data} [{entry.dataset_split}]"


def noted(text: str, entries: list[EvalResult], note: str | None) -> str:
    """``text`` with its notes block updated: the lines of ``entries`` (replaced by this merge) dropped, one line per
    entry added when there is a ``note``; the block is removed when no line is left, and added at the end when new.

    Args:
        text: the card's text (below the front matter).
        entries: the entries this merge writes.
        note: what to say of each of them (:func:`run_note`), or None.

    Returns:
        The new text.
    """
    found = _BLOCK.search(text)
    nl = "\r\n" if "\r\n" in text else "\n"  # a CRLF card stays CRLF
    keys = {entry_key(e) for e in entries}
    lines = [ln for ln in (found.group(1).splitlines() if found else []) if ln.startswith("- ")
             and ln[2:].split(": ", 1)[0] not in keys]
    lines += [f"- {entry_key(e)}: {note}." for e in entries] if note else []
    block = nl.join([BEGIN, HEADING, "", *lines, END, ""]) if lines else ""
    if found:
        return text[:found.start()] + block + text[found.end():]
    return text.rstrip("\r\n") + nl + nl + block if block else text
