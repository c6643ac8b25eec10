"""From a model id and a dataset name or path to the labelled batches the engine consumes.

The engine takes a list of dicts that ``model(**batch)`` accepts, labels included. The faces (CLI, evaluate module,
leaderboard) all need the same steps: load the model and its tokenizer or image processor, load one split of a Hub
dataset or of local files, find the text / text-pair / label / image columns, pick examples deterministically, encode
them and pad each batch to its own longest row. They live here so that every face builds identical batches.

Example selection: the first ``n_examples`` rows after ``Dataset.shuffle(seed=seed)`` (or the first ``n_examples`` in
file order with ``shuffle=False``). The same arguments always give the same batches, also across processes.

Every mistake a user can fix raises :class:`DataError`, whose message names the bad field and the fix; the CLI turns it
into exit code 2.

The steps live in one module each, in the order a face calls them: :mod:`.spec` (what to read, :class:`DataError`),
:mod:`.models` (model, tokenizer or image processor, task), :mod:`.splits` (dataset split, columns, examples),
:mod:`.encoding` (token ids, masks, labels) and :mod:`.batches` (padding, the whole pipeline, the launcher). Import
from here, not from those modules.
"""

from .batches import launch_accelerator, load_batches, make_batches
from .encoding import IGNORE_INDEX, MLM_PROBABILITY, encode
from .models import (
    CODE_CONFIGS,
    MODEL_PATH_SUFFIXES,
    REMOTE_CODE_FIX,
    is_vision,
    load_model,
    load_processor,
    require_model,
    require_task,
    task_of,
)
from .spec import Columns, DataError, DataSpec, Task, hub_offline, require_existing_path
from .splits import (
    FILE_BUILDERS,
    IMAGE_COLUMNS,
    LABEL_COLUMNS,
    PAIR_COLUMNS,
    TEXT_COLUMNS,
    check_source,
    load_split,
    resolve_columns,
    select_examples,
)

__all__ = [
    "CODE_CONFIGS",
    "Columns",
    "DataError",
    "DataSpec",
    "FILE_BUILDERS",
    "IGNORE_INDEX",
    "IMAGE_COLUMNS",
    "LABEL_COLUMNS",
    "MLM_PROBABILITY",
    "MODEL_PATH_SUFFIXES",
    "PAIR_COLUMNS",
    "REMOTE_CODE_FIX",
    "TEXT_COLUMNS",
    "Task",
    "check_source",
    "encode",
    "hub_offline",
    "is_vision",
    "launch_accelerator",
    "load_batches",
    "load_model",
    "load_processor",
    "load_split",
    "make_batches",
    "require_existing_path",
    "require_model",
    "require_task",
    "resolve_columns",
    "select_examples",
    "task_of",
]
