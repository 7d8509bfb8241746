"""Turn a suite result (bench/results/latest.json) into bench/RESULTS.md and a PNG plot.

Pure functions of the result dict: nothing here measures, so the test suite can feed them a
synthetic result (tests/test_bench_report.py). One renderer module per bench item
(:mod:`.throughput` with the sweep, :mod:`.faults`, :mod:`.state`, :mod:`.collectives`,
:mod:`.progress`, :mod:`.multihost`, :mod:`.observability`, :mod:`.stragglers`), the Targets
table (:mod:`.targets`), what they share (:mod:`.common`), the document that puts them in order
(:mod:`.markdown`), the PNG (:mod:`.figure`) and the files `make bench` writes (:mod:`.output`).
"""

from bench.report.figure import plot
from bench.report.markdown import render_markdown
from bench.report.output import write

__all__ = ["plot", "render_markdown", "write"]
