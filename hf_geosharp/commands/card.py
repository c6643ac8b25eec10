"""``geosharp card``: put sharpness results into a model card's ``model-index``, locally or as a Hub pull request.

Reads the JSON of ``geosharp run --json`` (or ``SharpnessResult.to_dict()`` output), merges one eval result per
measure into ``MODEL/README.md`` (other content kept; an entry with the same configuration is replaced, not
duplicated) and prints the YAML. ``--push REPO_ID`` opens a pull request on the Hub with the user's token.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import yaml
from huggingface_hub import ModelCard

from ..cards import (
    CardError,
    card_yaml,
    dataset_info,
    eval_result,
    push_card,
    read_results,
    require_online,
    task_type,
    write_card,
)
from .common import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "card",
        help="write sharpness results into a model card (model-index), optionally as a Hub pull request",
        description="Merge sharpness results into the model-index of MODEL/README.md (or a README.md path): other "
        "content is preserved and an entry with the same configuration is replaced instead of duplicated.",
    )
    p.add_argument("model", type=Path, help="model folder (its README.md is edited or created) or a README.md path")
    p.add_argument("--results", type=Path, required=True, help="JSON from `geosharp run --json`")
    p.add_argument("--dataset", help="dataset name for the card (default: the one recorded in the results)")
    p.add_argument("--split", help="dataset split (default: the one recorded in the results)")
    p.add_argument("--task-type", help="Hub task type (default: from the model class, e.g. text-classification)")
    p.add_argument("--model-name", help="model name in the model-index (default: the card's, else the folder name)")
    p.add_argument("--push", metavar="REPO_ID", help="also open a pull request with these entries on this Hub model")
    p.add_argument("--token", help="Hub token for --push (default: the one from `hf auth login` / HF_TOKEN)")
    p.set_defaults(func=run)


def card_problem(target: Path) -> str | None:
    """Why ``target`` cannot take a card, or ``None``: it must be a model folder (an existing one, or a new path
    without a suffix) or a ``README.md``, whose front matter, if it exists, must be readable. Anything else, such as
    ``MODEL/config.json``, would be turned into Markdown and stop the model from loading."""
    if target.is_dir():
        target = target / "README.md"
    elif target.name.lower() != "readme.md" and (target.exists() or target.suffix):
        return (f"{str(target)!r} is neither a model folder nor a README.md; pass the model folder (its README.md is "
                "edited or created) or the README.md itself. Nothing was written.")
    if not target.exists():
        return None
    try:
        ModelCard.load(target)
    except UnicodeDecodeError:
        return f"{str(target)!r} is not UTF-8 text; save it as UTF-8 first. Nothing was written."
    except (yaml.YAMLError, ValueError) as err:  # ValueError: front matter that is a list, not a mapping
        first = str(err).splitlines()[0]
        return (f"the front matter of {str(target)!r} (the YAML block between the '---' lines) cannot be read "
                f"({first}); fix it to a YAML mapping (key: value lines) or remove it. Nothing was written.")
    return None


def run(args: argparse.Namespace) -> int:
    problem = card_problem(args.model)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        if args.push:
            require_online(args.push)  # before anything is written: a failed command changes nothing
        results, context = read_results(args.results)
        bad = [r["measure"] for r in results
               if not isinstance(r["value"], (int, float)) or not math.isfinite(r["value"])]
        if bad:
            raise CardError(f"{', '.join(bad)} in {str(args.results)!r} is not a finite number, and a card must not "
                            "show one; measure again (e.g. with a smaller --rho). Nothing was written.")
        dataset = dataset_info(context, name=args.dataset, split=args.split)
        task = args.task_type or task_type(context.get("model_class"))
        entries = [eval_result(r, dataset, task) for r in results]
    except CardError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        path = write_card(args.model, entries, args.model_name)
    except OSError as err:  # disk full, a quota, a file-size limit: the card is written durably, so it is intact
        print(f"error: could not write the card into {str(args.model)!r} ({err.strerror or err}); the previous "
              "README.md is unchanged.", file=sys.stderr)
        return EXIT_FAILED
    print(card_yaml(entries, ModelCard.load(path).data.model_name))
    print(f"wrote {len(entries)} eval result(s) into {path}")
    if args.push:
        try:
            url = push_card(args.push, entries, token=args.token)
        except CardError as err:
            print(f"error: {err}", file=sys.stderr)
            return EXIT_FAILED
        print(f"opened a pull request: {url}")
    return EXIT_OK
