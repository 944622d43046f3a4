"""Mirror of slime's `save_hf_model_to_path` (signature only): it reads the live model weights, so
the actor must be awake; the mirror writes a marker file and records that it ran."""

from __future__ import annotations

import json
from pathlib import Path

CALLS: list[str] = []  # per process: the directories written (the tests read it through the actor)


def save_hf_model_to_path(args, output_dir, model, *, model_name=None, quantization_config=None,
                          progress_desc: str = "Save HF checkpoint") -> None:
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "config.json").write_text(json.dumps({"mirror": True}))
    CALLS.append(str(output_dir))
