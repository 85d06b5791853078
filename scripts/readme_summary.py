"""Copy the summary table of a REPORT.md into README.md between the summary markers.

    python scripts/readme_summary.py results/cpu-reference/REPORT.md
"""
import re
import sys
from pathlib import Path

report = Path(sys.argv[1]).read_text()
table = report.split("## Summary", 1)[1].split("## Every cell", 1)[0].strip()
readme = Path("README.md").read_text()
block = f"<!-- summary:start -->\nSummary from `results/cpu-reference/REPORT.md` (exponents fitted on the upper half of the lengths; \"beats full from N\": the smallest N from which the variant is faster at every larger N):\n\n{table.split(chr(10), 2)[2].strip()}\n<!-- summary:end -->"
readme = re.sub(r"<!-- summary:start -->.*<!-- summary:end -->", lambda m: block, readme, flags=re.S)
Path("README.md").write_text(readme)
