"""The trial record: what a stored trial is, in one place for the whole engine.

- `keys`: the attribute names trials and studies are stored under;
- `status`: the status words and the one rule deriving them (`status_of`);
- `trial`: `TrialRecord`, one stored trial, from SQL or from Optuna's FrozenTrial;
- `ranking`: `rank_trials`, the one definition of best, runner-up, tie, loss drift, constraint;
- `reader`: the one reader of Optuna's tables (bulk, incremental, cached: `read_study`);
- `snapshot`, `importance`: the study snapshot and knob importance the reader keeps.

`keys` and `status` import nothing heavy (trial ranks use them); the rest loads on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "TrialRecord": "tuner.record.trial",
    "from_frozen": "tuner.record.trial",
    "Ranked": "tuner.record.ranking",
    "Ranking": "tuner.record.ranking",
    "rank_trials": "tuner.record.ranking",
    "StudyRecord": "tuner.record.reader",
    "read_study": "tuner.record.reader",
    "with_all_attrs": "tuner.record.reader",
    "status_of": "tuner.record.status",
    "Status": "tuner.record.status",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tuner.record' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
