"""What `make bench` writes from a suite result: latest.json, latest.png (where matplotlib is
there) and RESULTS.md, with the Soak section of `make soak`'s own result kept."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from bench.report.figure import plot
from bench.report.markdown import render_markdown
from bench.soak import report as soak_report


def write(results: dict[str, Any], results_dir: Path, markdown: Path) -> list[Path]:
    """Write latest.json, latest.png (when matplotlib is there) and the Markdown; their paths."""
    results_dir.mkdir(parents=True, exist_ok=True)
    json_path = results_dir / "latest.json"
    json_path.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    png_path = results_dir / "latest.png"
    try:
        plot(results, png_path)
        link: str | None = os.path.relpath(png_path, markdown.resolve().parent)
    except ImportError:
        link = None
    markdown.write_text(render_markdown(results, link))
    soak = results_dir / "soak.json"
    if soak.is_file():
        # The soak's section comes from its own run (`make soak`), kept through this one.
        soak_report.update(markdown, json.loads(soak.read_text()))
    return [json_path, markdown, *([png_path] if link else [])]
