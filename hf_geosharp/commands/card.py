"""``geosharp card``: publish sharpness results as model-index entries and/or ``.eval_results`` files.

Reads the JSON of ``geosharp run --json`` (or ``SharpnessResult.to_dict()`` output) and, by ``--format``:

* ``model-index`` (default): merges one entry per measure into ``MODEL/README.md`` (other content kept; an entry with
  the same configuration is replaced, not duplicated). Works for any dataset.
* ``eval-results``: merges one entry per measure into ``MODEL/.eval_results/<benchmark>.yaml``, the Hub's current
  format; needs ``--benchmark``, a benchmark dataset on the Hub that carries an ``eval.yaml``.
* ``both``.

``--push REPO_ID`` proposes the same files as one pull request (one commit) on the Hub with the user's token;
``--results-repo`` also commits the run JSON to a results dataset. Every check runs before anything is written.

The results must describe this model: the weights' sha256 that ``geosharp run`` recorded is checked against the model
folder's, and results of other weights are refused unless ``--force`` (the card then says so). The card states the
examples actually measured, and notes (in its text and the entries) a freshly initialised ``--head``.

Every worst-case value goes out with its certificate (``certified`` in the metric's args, the certificate in the
``.eval_results`` notes); a value that is not certified is published as a lower bound and named on stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from huggingface_hub import ModelCard

from ..engine.result import LOWER_BOUND, certified, shown
from ..hub.cards import (
    CardError,
    card_yaml,
    dataset_info,
    entries_yaml,
    eval_result,
    eval_result_entry,
    eval_results_file,
    key_of_result,
    known_task,
    model_metadata,
    parse_card,
    read_card_text,
    read_entries,
    read_results,
    readme_path,
    write_card,
    write_eval_results,
)
from ..hub.provenance import ForeignResults, check_weights, head_args, run_note
from ..hub.publish import Publication, details_path, proposed_paths, pull_request_text, push, require_online
from .common import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK

FORMATS = ("model-index", "eval-results", "both")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``geosharp card``."""
    p = subparsers.add_parser(
        "card",
        help="publish sharpness results in a model card (model-index) and/or .eval_results, optionally as a Hub PR",
        description="Merge sharpness results into MODEL/README.md (model-index) and/or MODEL/.eval_results/ "
        "(--format): other content is preserved and an entry with the same configuration is replaced.",
    )
    p.add_argument("model", type=Path, help="model folder (its README.md is edited or created) or a README.md path")
    p.add_argument("--results", type=Path, required=True, help="JSON from `geosharp run --json`")
    p.add_argument("--format", choices=FORMATS, default="model-index",
                   help="model-index (README front matter, any data), eval-results (.eval_results/*.yaml, needs "
                   "--benchmark) or both (default: model-index)")
    p.add_argument("--benchmark", metavar="DATASET_ID",
                   help="the Hub benchmark dataset (with an eval.yaml) that the .eval_results entries point at")
    p.add_argument("--benchmark-revision", help="git revision of the benchmark dataset")
    p.add_argument("--dataset", help="dataset for the card (default: the one recorded in the results)")
    p.add_argument("--dataset-revision", help="git revision of the Hub dataset the results were measured on")
    p.add_argument("--local-data", action="store_true",
                   help="the data was local (not a Hub dataset) even if its path no longer exists here")
    p.add_argument("--split", help="dataset split (default: the one recorded in the results)")
    p.add_argument("--task-type", help="Hub task type (default: from the model class, e.g. text-classification)")
    p.add_argument("--model-name", help="model name in the model-index (default: the card's, else the folder name)")
    p.add_argument("--source-url", help="where this run can be seen (a Space, a run log); written as the source")
    p.add_argument("--base-model", help="base_model for a card that has none")
    p.add_argument("--license", help="license for a card that has none")
    p.add_argument("--push", metavar="REPO_ID", help="also open a pull request with these entries on this Hub model")
    p.add_argument("--results-repo", metavar="DATASET_ID",
                   help="with --push: also commit the run JSON to this results dataset (<org>/<model>/results_*.json)")
    p.add_argument("--token", help="Hub token for --push (default: the one from `hf auth login` / HF_TOKEN)")
    p.add_argument("--force", action="store_true",
                   help="publish results whose recorded weights sha256 differs from the model folder's (the card "
                   "says so)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the entries, the files and (with --push) the pull request's title and body; write and "
                   "send nothing (works offline)")
    p.set_defaults(func=run)


def _prepare(args: argparse.Namespace) -> tuple[list, list, dict, str | None]:
    """All checks and entries, before anything is written; the last item is the card's note on how the numbers
    were measured (:func:`~hf_geosharp.hub.provenance.run_note`)."""
    if args.push and not args.dry_run:
        require_online(args.push)  # before anything is written: a failed command changes nothing
    if args.format != "model-index" and not args.benchmark:
        raise CardError(f"--format {args.format} needs --benchmark DATASET_ID: .eval_results entries point at a "
                        "benchmark dataset on the Hub that carries an eval.yaml (template: "
                        "hf_geosharp/hub/templates/eval.yaml). Use --format model-index for results on any dataset.")
    if args.results_repo and not args.push:
        raise CardError("--results-repo needs --push REPO_ID.")
    results, context = read_results(args.results)
    forced, warnings = check_weights(context, _folder(args.model), args.force)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    note = run_note(context, forced)
    dataset = dataset_info(context, name=args.dataset, split=args.split, revision=args.dataset_revision,
                           local=True if args.local_data else None)
    task = args.task_type or known_task(context.get("model_class"))
    if task is None:
        print(f"note: no Hub task type is known for model class {context.get('model_class')!r}; writing 'other'. "
              "Pass --task-type to name it.", file=sys.stderr)
    index = [eval_result(r, dataset, task or "other", url=args.source_url, extra_args=head_args(context))
             for r in results] if args.format != "eval-results" else []
    entries = [eval_result_entry(r, dataset, args.benchmark, url=args.source_url,
                                 benchmark_revision=args.benchmark_revision, note=note) for r in results] \
        if args.format != "model-index" else []
    folder = _folder(args.model)
    if index and readme_path(args.model).exists():  # a card we cannot read stops us before any write
        parse_card(read_card_text(readme_path(args.model)), str(readme_path(args.model)))
    for path in _existing_eval_files(folder, entries):  # a broken existing file stops us before any write
        read_entries(path.read_text())
    meta = model_metadata(folder, base_model=args.base_model, license=args.license)
    uncertified = [r for r in results if certified(r) is False]
    if uncertified:
        shown_values = ", ".join(f"{key_of_result(r)} {shown(float(r['value']), False)}" for r in uncertified)
        print(f"note: {len(uncertified)} of {len(results)} results are not certified, so each is published as "
              f"{LOWER_BOUND} (certified: false): {shown_values}. `geosharp run --steps auto` continues until "
              "certified or says why not.", file=sys.stderr)
    return index, entries, meta, note


def dry_run(args: argparse.Namespace, index: list, entries: list, meta: dict, note: str | None = None) -> None:
    """Print what the command would write and propose, touching no file and no network.

    Args:
        args: the parsed command line.
        index: the model-index entries.
        entries: the ``.eval_results`` entries.
        meta: the card metadata a new card would get.
        note: what the card's text would note of each entry.
    """
    folder = _folder(args.model)
    if index:
        print(card_yaml(index, args.model_name or folder.resolve().name))
        print(f"would write {len(index)} model-index entr{'y' if len(index) == 1 else 'ies'} into "
              f"{readme_path(args.model)}")
        if note:
            print(f"the card's text would note of each entry: {note}")
    if entries:
        print(entries_yaml(entries))
        print(f"would write {len(entries)} eval result(s) into "
              f"{', '.join(str(folder / eval_results_file(b)) for b in dict.fromkeys(e.dataset_id for e in entries))}")
    if args.push:
        pub = Publication(args.push, index, entries, meta, note)
        paths = proposed_paths(pub)
        title, body = pull_request_text(paths)
        print(f"would open a pull request on {args.push} changing {', '.join(paths)} (the entries merged into the "
              f"repo's current files)\n  title: {title}\n  body: {body}")
        if args.results_repo:
            print(f"would commit {args.results} to the dataset {args.results_repo} as {details_path(args.push)}")
    print("dry run: nothing was written or sent")


def _folder(model: Path) -> Path:
    return model if model.is_dir() or not model.suffix else model.parent


def _existing_eval_files(folder: Path, entries: list) -> list[Path]:
    return [p for p in (folder / eval_results_file(b) for b in dict.fromkeys(e.dataset_id for e in entries))
            if p.exists()]


def run(args: argparse.Namespace) -> int:
    """Write (or print) the model-card entries of a results file; the exit code."""
    try:
        readme_path(args.model)  # a model folder or its README.md; anything else (config.json!) is refused
        index, entries, meta, note = _prepare(args)
    except (CardError, ForeignResults) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.dry_run:
        dry_run(args, index, entries, meta, note)
        return EXIT_OK
    try:
        if index:
            path = write_card(args.model, index, args.model_name, meta, note)
            print(card_yaml(index, ModelCard.load(path).data.model_name))
            print(f"wrote {len(index)} model-index entr{'y' if len(index) == 1 else 'ies'} into {path}")
        if entries:
            paths = write_eval_results(_folder(args.model), entries)
            print(entries_yaml(entries))
            print(f"wrote {len(entries)} eval result(s) into {', '.join(map(str, paths))}")
    except OSError as err:  # disk full, a quota, a file-size limit: every file is written durably, so it is intact
        print(f"error: could not write into {str(_folder(args.model))!r} ({err.strerror or err}); the previous files "
              "are unchanged.", file=sys.stderr)
        return EXIT_FAILED
    if args.push:
        pub = Publication(args.push, index, entries, meta, note)
        try:
            urls = push(pub, token=args.token, results_repo=args.results_repo,
                        run_json=args.results.read_bytes() if args.results_repo else None)
        except CardError as err:
            print(f"error: {err}", file=sys.stderr)
            return EXIT_FAILED
        print(f"opened a pull request: {urls['pull_request']}")
        if "results" in urls:
            print(f"committed the run JSON: {urls['results']}")
    return EXIT_OK
