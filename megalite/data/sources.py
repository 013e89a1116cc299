"""Where the documents of a preparation come from, in a fixed order, and why a source cannot load.

A source is read as the sequence of its documents' texts, document i being the i-th row of
`datasets.load_dataset(source, config_name, split=..., revision=...)` (or the i-th standard-library
file for `stdlib`), whether the dataset is downloaded first (`data.streaming=false`) or streamed
(`data.streaming=true`, a `datasets.IterableDataset`: nothing is downloaded whole). Both modes
yield the same documents in the same order, so a document's index — which decides its split —
is the same in both; a preparation resumes by starting the sequence at a document index.

The failures `datasets` reports while resolving a source (a loading script, a missing config
name, no hub and no cache) are turned into a DataError naming the dataset, the reason and what
would work, before anything is downloaded or tokenized.
"""
from __future__ import annotations

import glob
import os
import sysconfig
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

from megalite.config.schema import DataConfig
from megalite.data.errors import DataError

LOCAL_BUILDERS = ("text", "json", "parquet", "csv")
PARQUET_REVISION = "refs/convert/parquet"  # the hub's own Parquet conversion of every dataset


def stdlib_files() -> List[Path]:
    """Non-empty .py files of this interpreter's standard library, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py")
             if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)
             and p.is_file() and p.stat().st_size > 0]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def check_local_files(cfg: DataConfig) -> None:
    if cfg.source not in LOCAL_BUILDERS:
        return
    if not cfg.data_files:
        raise DataError(f"data.data_files={cfg.data_files!r}: data.source={cfg.source!r} "
                        "reads local files; list them, e.g. data.data_files=[/data/a.jsonl]")
    for pattern in cfg.data_files:
        if not glob.glob(os.path.expanduser(pattern)):
            raise DataError(f"data.data_files: {pattern!r} matches no file")


def _why_it_cannot_load(cfg: DataConfig, error: Exception) -> str:
    """The reason and the remedy for a `load_dataset` failure, in the user's keys."""
    name, text = repr(cfg.source), str(error)
    if "scripts are no longer supported" in text:
        return (f"{name} is a loading-script dataset, and datasets>=4 no longer runs loading "
                "scripts. What works: a Parquet revision of it, data.revision=main if its owner "
                f"converted it, or data.revision={PARQUET_REVISION} (the hub's own conversion, "
                "which stops at the first 5 GB of a larger dataset); a Parquet copy on the hub; "
                "or the files themselves with data=local data.source=json|parquet|text "
                "data.data_files=[...]")
    if "Config name is missing" in text or "BuilderConfig" in text:
        available = text[text.find("["):text.find("]") + 1] if "[" in text else "(see its card)"
        return (f"data.config_name={cfg.config_name!r}: {name} needs one of its configs "
                f"{available}, e.g. data.config_name=sample-10BT for the FineWeb samples")
    if isinstance(error, ConnectionError) or "Couldn't reach" in text or "offline" in text.lower():
        return (f"{name} is not reachable on the Hugging Face hub from here (no network, or "
                "HF_HUB_OFFLINE=1) and not in the local cache (HF_HOME / HF_DATASETS_CACHE). "
                "What works: run the preparation where the hub is reachable (or point HF_HOME "
                "at a cache that holds the dataset), or copy its files here and use data=local "
                "data.source=parquet data.data_files=[...]")
    return f"datasets.load_dataset failed: {type(error).__name__}: {text}"


def _hub_dataset(cfg: DataConfig):
    import datasets

    kwargs = {"data_files": [os.path.expanduser(f) for f in cfg.data_files]} \
        if cfg.data_files else {}
    if cfg.revision is not None:
        kwargs["revision"] = cfg.revision
    try:
        return datasets.load_dataset(cfg.source, cfg.config_name, split=cfg.split,
                                     streaming=cfg.streaming, **kwargs)
    except Exception as e:
        raise DataError(f"data.source={cfg.source!r} (data.config_name={cfg.config_name!r}, "
                        f"data.split={cfg.split!r}, data.revision={cfg.revision!r}) cannot load: "
                        f"{_why_it_cannot_load(cfg, e)}") from e


def _column_names(ds) -> List[str]:
    names = ds.column_names
    if names is None:  # a stream whose features are only known from its first row
        first = next(iter(ds.take(1)), None)
        names = sorted(first) if first is not None else []
    return list(names)


class DocumentSource:
    """The documents of `cfg`'s source, read in order from any document index."""

    def __init__(self, cfg: DataConfig):
        self.cfg = cfg
        self._files: Optional[List[Path]] = None
        self._ds = None
        if cfg.source == "stdlib":
            self._files = stdlib_files()
        else:
            check_local_files(cfg)
            self._ds = _hub_dataset(cfg)
            columns = _column_names(self._ds)
            if cfg.text_field not in columns:
                raise DataError(f"data.text_field={cfg.text_field!r}: {cfg.source!r} has the "
                                f"fields {columns}; set data.text_field to the one holding the "
                                "text")
            self._ds = self._ds.select_columns([cfg.text_field])

    def known_length(self) -> Optional[int]:
        """Documents that will be read (None for a stream of unknown length)."""
        n = len(self._files) if self._files is not None else (
            None if self.cfg.streaming else len(self._ds))
        if self.cfg.max_documents is not None:
            n = self.cfg.max_documents if n is None else min(n, self.cfg.max_documents)
        return n

    def batches(self, start: int, batch_size: int) -> Iterator[Tuple[int, List[str]]]:
        """(index of the first document, texts) of consecutive batches from document `start`;
        a missing text is "" (skipped by the tokenizer, its index kept)."""
        stop = self.cfg.max_documents
        index = start
        for texts in self._raw_batches(start, batch_size):
            if stop is not None:
                texts = texts[:max(0, stop - index)]
            if not texts:
                return
            yield index, [t or "" for t in texts]
            index += len(texts)

    def _raw_batches(self, start: int, batch_size: int) -> Iterator[List[str]]:
        if self._files is not None:
            for i in range(start, len(self._files), batch_size):
                yield [p.read_text(encoding="utf-8", errors="replace")
                       for p in self._files[i:i + batch_size]]
            return
        field = self.cfg.text_field
        if self.cfg.streaming:
            ds = self._ds.skip(start) if start else self._ds
        else:
            ds = self._ds.select(range(start, len(self._ds))) if start else self._ds
        for batch in ds.iter(batch_size=batch_size):
            yield batch[field]
