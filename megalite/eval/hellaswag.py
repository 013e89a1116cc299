"""HellaSwag (Zellers et al. 2019) examples: read, checked, rendered into token sequences.

An example is a context, four endings and the index of the right one. The official files
(https://github.com/rowanz/hellaswag, `data/hellaswag_val.jsonl`, 10,042 examples) hold one JSON
object per line with the fields `ctx`, `endings` and `label`; the hub's copies (parquet) have
the same fields, the label as a string. `eval.hellaswag` names a local file (`.jsonl`; `.json`:
JSON lines or one array; `.parquet`), or a hub dataset id whose `validation` split is read
with `datasets`.

Rendered as llm.c and build-nanogpt render it: the context's tokens, then the tokens of
" " + ending, each ending as its own sequence (`megalite.eval.choice` scores them).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Tuple

from megalite.config.errors import ConfigError
from megalite.config.schema import Config, resolve_path
from megalite.eval.choice import ChoiceSet, Ending

ENDINGS = 4
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
OFFICIAL_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
HUB_SPLIT = "validation"


@dataclass(frozen=True)
class Example:
    ctx: str
    endings: Tuple[str, ...]
    label: int


def _where(source: str) -> str:
    return f"eval.hellaswag={source!r}"


def is_local(source: str) -> bool:
    """A path (an existing one, or one that looks like a file) rather than a hub dataset id."""
    return (resolve_path(source).exists() or source.endswith(FILE_SUFFIXES)
            or source.startswith(("/", ".", "~")))


def _records(source: str) -> Iterator[Tuple[str, object]]:
    """(where, record) of every example of `source`, in file order; `where` names the file
    and the line (jsonl) or row (parquet, hub)."""
    path = resolve_path(source)
    if not is_local(source):
        yield from _hub_records(source)
        return
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "no such file"
        raise ConfigError(f"{_where(source)}: {what} ({path}); download the official "
                          f"validation set, e.g. `curl -LO {OFFICIAL_URL}`, and name it here")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several kinds for a file that is not parquet
            raise ConfigError(f"{_where(source)}: {path} is not a readable parquet file ({e})"
                              ) from e
        yield from ((f"{path} row {i}", row) for i, row in enumerate(rows))
        return
    if path.suffix == ".json" and path.read_text(encoding="utf-8").lstrip().startswith("["):
        yield from _json_array(source, path)
        return
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield f"{path} line {number}", json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{_where(source)}: {path} line {number} is not JSON ({e}); "
                                  "expected one HellaSwag example per line") from e


def _json_array(source: str, path: Path) -> Iterator[Tuple[str, object]]:
    """A .json file holding one array of examples (JSON lines otherwise)."""
    try:
        items = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{_where(source)}: {path} is not JSON ({e})") from e
    yield from ((f"{path} item {i}", item) for i, item in enumerate(items))


def _hub_records(source: str) -> Iterator[Tuple[str, object]]:
    try:
        import datasets

        rows = datasets.load_dataset(source, split=HUB_SPLIT)
    except Exception as e:  # no network, no such dataset, no such split: all end the run here
        raise ConfigError(f"{_where(source)}: not a local file, and the hub dataset's "
                          f"{HUB_SPLIT!r} split could not be loaded ({type(e).__name__}: {e}); "
                          f"name a local copy, e.g. hellaswag_val.jsonl from {OFFICIAL_URL}"
                          ) from e
    yield from ((f"{source} ({HUB_SPLIT}) row {i}", row) for i, row in enumerate(rows))


def _example(where: str, record) -> Example:
    """One record checked: a non-empty `ctx`, four non-empty `endings`, `label` 0-3 (an
    integer or its digit string)."""
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: not an object with fields ctx, endings, label")
    missing = [k for k in ("ctx", "endings", "label") if k not in record]
    if missing:
        raise ConfigError(f"{where}: no field {missing[0]!r} (a HellaSwag example has ctx, "
                          f"endings, label; this one has {sorted(record)})")
    ctx, endings, label = record["ctx"], record["endings"], record["label"]
    if not isinstance(ctx, str) or not ctx.strip():
        raise ConfigError(f"{where}: field 'ctx' must be a non-empty string, got {ctx!r}")
    if (not isinstance(endings, (list, tuple)) or len(endings) != ENDINGS
            or not all(isinstance(e, str) and e.strip() for e in endings)):
        raise ConfigError(f"{where}: field 'endings' must be a list of {ENDINGS} non-empty "
                          f"strings, got {endings!r}")
    if isinstance(label, str) and label.strip().isdigit():
        label = int(label)
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < ENDINGS:
        raise ConfigError(f"{where}: field 'label' must be the index of the right ending, "
                          f"0 to {ENDINGS - 1}, got {record['label']!r}")
    return Example(ctx, tuple(endings), label)


def read_examples(source: str, limit: Optional[int] = None) -> List[Example]:
    """The first `limit` examples of `source` (all with None), each checked; ConfigError
    naming the file, the line (or row) and the field of the first bad one, or too few."""
    examples: List[Example] = []
    for where, record in _records(source):
        if limit is not None and len(examples) == limit:
            break
        examples.append(_example(where, record))
    if not examples:
        raise ConfigError(f"{_where(source)}: holds no example")
    if limit is not None and len(examples) < limit:
        raise ConfigError(f"eval.hellaswag_examples={limit}: {source} holds only "
                          f"{len(examples)} examples; ask for at most that many, or null for all")
    return examples


def render(example: Example, encode, seq_len: int) -> List[Ending]:
    """The example's four sequences: context tokens + tokens of " " + ending, each cut on the
    left to its last seq_len + 1 tokens where longer. `encode(text)` -> token ids."""
    ctx = list(encode(example.ctx))
    endings = []
    for text in example.endings:
        tokens = ctx + list(encode(" " + text))
        cut = max(0, len(tokens) - (seq_len + 1))
        # the first token is never predicted: an ending token there does not count either
        scored_from = max(len(ctx) - cut, 1)
        endings.append(Ending(tuple(tokens[cut:]), scored_from, cut > 0))
    return endings


def tokenizer_dir(cfg: Config) -> Path:
    """The tokenizer the run's data was prepared with: `<data dir>/tokenizer` of the first
    dataset (blended datasets share one tokenizer)."""
    from megalite.data.loader import read_meta

    data_dir = cfg.data.sources()[0][0]
    return data_dir / read_meta(data_dir).get("tokenizer", {}).get("dir", "tokenizer")


def load_encoder(cfg: Config) -> Callable[[str], List[int]]:
    """text -> token ids (no special tokens) with the data's tokenizer: its tokenizer.json
    read by `tokenizers` (what a transformers fast tokenizer runs, without importing
    transformers on every rank), else `AutoTokenizer`."""
    path = tokenizer_dir(cfg)
    try:
        if (path / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            fast = Tokenizer.from_file(str(path / "tokenizer.json"))
            return lambda text: fast.encode(text, add_special_tokens=False).ids
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # a missing or unreadable tokenizer: a configuration problem
        raise ConfigError(f"{_where(cfg.eval.hellaswag)}: scored with the data's tokenizer, "
                          f"and {path} is not a readable tokenizer directory ({e}); prepare "
                          "the data with scripts/prepare_data.py (it saves the tokenizer "
                          "there)") from e
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


def check_hellaswag(cfg: Config) -> None:
    """Before launch: the examples `eval.hellaswag` names are readable and well formed, and
    the data's tokenizer loads. ConfigError naming the file, line and field otherwise."""
    if cfg.eval.hellaswag is None:
        return
    read_examples(cfg.eval.hellaswag, cfg.eval.hellaswag_examples)
    load_encoder(cfg)


def load_choices(cfg: Config) -> ChoiceSet:
    """The configured examples rendered with the data's tokenizer for train.seq_len."""
    examples = read_examples(cfg.eval.hellaswag, cfg.eval.hellaswag_examples)
    encode = load_encoder(cfg)
    return ChoiceSet([render(ex, encode, cfg.train.seq_len) for ex in examples],
                     [ex.label for ex in examples])
