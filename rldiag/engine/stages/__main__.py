"""``python -m rldiag.engine.stages`` prints the metrics table of docs/metrics.md."""

from rldiag.engine.stages import markdown_table

print(markdown_table(), end="")
