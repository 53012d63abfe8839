"""`repro data verify PREFIX`: a prepared dataset's bytes against the sha256 `repro data prepare` recorded.

    repro data verify data/corpus           # every PREFIX_{train,valid,test}.{bin,idx} prepare wrote

The reader trusts the files: a .bin that lost or changed bytes on its way to a cluster (an rsync cut
short, a tarball, an object store) trains on wrong tokens without an error. `prepare` records each
split file's sha256 in PREFIX_prepare.json; this command reads every file again and compares, so a
copy can be checked once before a long run (a 40 GB corpus reads in a few minutes).
"""

from __future__ import annotations

from pathlib import Path

from repro.data.errors import DataError
from repro.data.fetch import sha256_file
from repro.data.prepare_checks import base_prefix, output_files


def digests(prefix: str, progress: bool = False) -> dict[str, str]:
    """sha256 of each existing split file of PREFIX, keyed by its name after the prefix (`_train.bin`)."""
    return {str(path)[len(prefix):]: sha256_file(path, progress)
            for path in output_files(prefix) if path.suffix in (".bin", ".idx") and path.exists()}


def verify(prefix: str | Path, progress: bool = False) -> list[tuple[str, str]]:
    """Compare each split file with the sha256 in PREFIX_prepare.json: (file, 'ok') per file; a
    DataError naming every file that differs or is missing, and the fix."""
    import json

    base = base_prefix(prefix)
    record_path = Path(f"{base}_prepare.json")
    if not record_path.is_file():
        raise DataError(f"{record_path} not found: nothing records what {base}'s splits should hold. Fix: give "
                        "the --output-prefix of `repro data prepare` (its PREFIX_prepare.json lies beside the splits)")
    try:
        text = record_path.read_bytes()
    except OSError as err:
        raise DataError(f"{record_path} cannot be read ({err}). Fix: make it readable (`ls -l {record_path}`)") from None
    try:
        record = json.loads(text)
    except ValueError as err:
        raise DataError(f"{record_path} is not valid JSON ({err}): it is damaged or not prepare's record. Fix: "
                        "copy it again from the machine that prepared the dataset, or prepare it again") from None
    if not isinstance(record, dict):
        raise DataError(f"{record_path} holds a JSON {type(record).__name__}, not the object `repro data prepare` "
                        "writes. Fix: copy it again from the machine that prepared the dataset, or prepare it again")
    try:
        recorded = record["report"]["sha256"]
    except (KeyError, TypeError):
        raise DataError(f"{record_path} holds no checksums (written by a `repro data prepare` from before they "
                        "were recorded). Fix: prepare the dataset again to record them") from None
    results, bad = [], []
    for suffix, want in sorted(recorded.items()):
        path = Path(base + suffix)
        if not path.exists():
            bad.append(f"{path}: missing")
            continue
        got = sha256_file(path, progress)
        if got != want:
            bad.append(f"{path}: sha256 {got[:16]}... but prepare wrote {want[:16]}...")
        results.append((str(path), "ok" if got == want else "DIFFERS"))
    if bad:
        raise DataError(f"{len(bad)} of {len(recorded)} files of {base} are not what `repro data prepare` wrote:\n  "
                        + "\n  ".join(bad) + "\nFix: copy them again from the machine that prepared them, or run "
                        "`repro data prepare` again")
    return results


def check_split_record(prefix: str | Path, num_documents: int) -> None:
    """Refuse a split whose document count differs from the one PREFIX_prepare.json beside it records:
    old and new files mixed (a `repro data prepare --overwrite` killed while swapping them in), which
    would otherwise train without a word. No record, or one without counts: nothing to check."""
    import json

    base = base_prefix(prefix)
    suffix = str(prefix)[len(base):]
    if not suffix:  # not a split of a prepared dataset
        return
    record_path = Path(f"{base}_prepare.json")
    try:
        outputs = json.loads(record_path.read_text())["report"]["outputs"]
        recorded = next(int(n) for key, n in outputs.items() if key.endswith(suffix))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, StopIteration):
        return
    if recorded != num_documents:
        raise DataError(f"{prefix}.idx holds {num_documents:,} documents, but {record_path} records {recorded:,} for "
                        f"this split: the files come from different `repro data prepare` runs (one killed while "
                        f"swapping its files in?). Fix: `repro data verify {base}` names the files that differ; "
                        "rerun `repro data prepare ... --overwrite` to rebuild the dataset")
