"""The paper's reference values, read from paper_values.csv (one row per number, with its origin)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

PAPER_FILE = Path(__file__).with_name("paper_values.csv")


def paper_values(path: Path = PAPER_FILE) -> pd.DataFrame:
    """All reference values: columns table, item, metric, value, unit, source."""
    frame = pd.read_csv(path)
    missing = frame[frame["source"].isna() | (frame["source"].astype(str).str.strip() == "")]
    if len(missing):
        raise ValueError(f"{path}: rows without a source: {missing[['table', 'item', 'metric']].values.tolist()}")
    return frame


def paper_value(frame: pd.DataFrame, table: str, item: str, metric: str) -> float | None:
    """One reference value, or None when the paper gives none."""
    hit = frame[(frame["table"] == table) & (frame["item"] == item) & (frame["metric"] == metric)]
    return float(hit["value"].iloc[0]) if len(hit) else None


def paper_items(frame: pd.DataFrame, table: str) -> list[str]:
    """Items (model sizes) of one table, in file order."""
    items = frame.loc[frame["table"] == table, "item"]
    return list(dict.fromkeys(items))
