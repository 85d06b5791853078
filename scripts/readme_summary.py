"""Copy the tables of the committed reports into README.md (the sweep's summary) and docs/quality.md (the
quality runs'), between their markers.

    python scripts/readme_summary.py results/cpu-reference/REPORT.md results/quality-reference/REPORT.md \
        results/quality-long/REPORT.md
"""
import re
import sys
from pathlib import Path


def replace_block(readme: str, marker: str, body: str) -> str:
    block = f"<!-- {marker}:start -->\n{body.strip()}\n<!-- {marker}:end -->"
    return re.sub(rf"<!-- {marker}:start -->.*<!-- {marker}:end -->", lambda m: block, readme, flags=re.S)


speed_report, quality_report, long_report = (Path(p).read_text() for p in sys.argv[1:4])
summary = speed_report.split("## Summary", 1)[1].split("## Every cell", 1)[0].strip()
summary_table = summary.split("\n", 2)[2]  # drop the report's sentence on exponents
quality = quality_report.split("## Quality: copy and associative recall", 1)[1].split("\n#", 1)[0].split("![", 1)[0].strip()
long_quality = long_report.split("## Quality: copy and associative recall", 1)[1].split("### Cost of a training step", 1)[0].strip().replace("\n### ", "\n#### ")
readme = Path("README.md").read_text()
readme = replace_block(readme, "summary", (
    f"Summary from [`{sys.argv[1]}`]({sys.argv[1]}) (exponents fitted on the upper half of the lengths; "
    f"\"beats full from N\": the smallest N from which the variant is faster at every larger N):\n\n{summary_table}"))
Path("README.md").write_text(readme)
page = Path("docs/quality.md").read_text()  # one folder down: its links go up first
page = replace_block(page, "quality", f"From [`{sys.argv[2]}`](../{sys.argv[2]}): {quality}")
page = replace_block(page, "quality-long", f"From [`{sys.argv[3]}`](../{sys.argv[3]}): {long_quality}")
Path("docs/quality.md").write_text(page)
