"""Progress bars for long work (compiles, conversions, many-prompt generation): tqdm on a
terminal, nothing when the output goes elsewhere (a log file, CI)."""
from __future__ import annotations

import sys


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress(total: int, desc: str, enabled: bool = True):
    """A bar counting to ``total`` on stderr when it is a terminal and ``enabled``."""
    if not (enabled and sys.stderr.isatty()):
        return _Silent()
    from tqdm import tqdm
    return tqdm(total=total, desc=f"[rltjax] {desc}", leave=False, file=sys.stderr, dynamic_ncols=True)
