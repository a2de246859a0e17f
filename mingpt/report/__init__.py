"""A run's report: `python -m mingpt.report RUN_DIR` prints a one-screen summary and writes
RUN_DIR/report.html (plots need the optional `report` extra: matplotlib). goodput.py accounts a job's
wall time from its metrics; summary.py writes the text; html.py the page."""
