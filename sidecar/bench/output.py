"""A bench's result: printed as JSON, and written to ``--out`` when given."""

from __future__ import annotations

import json
from typing import Any


def emit(result: dict[str, Any], out: str | None, indent: int = 1) -> None:
    text = json.dumps(result, indent=indent)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
