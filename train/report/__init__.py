"""Training-health report: `python -m train.report RUN_DIR [RUN_DIR ...] [key=value ...]`
(`make report RUN=...`).

Reads each run's metrics.jsonl (+ config.json, run.json, data_plan.json), writes `report.md` and
PNG plots into the first run directory (or `out=DIR`) and prints a one-screen summary with the
alarms. The first run is the one reported in detail; the others are overlaid and compared with it
(name the keys they are meant to differ in with `ablated=loss.gamma,optim.lr`). Thresholds are
the fields of `ReportConfig` (`python -m train.report --help` lists them).

Modules: `config` (ReportConfig, thresholds), `load` (tolerant reading), `analysis` (measurements),
`stats` (numpy), `compare` (runs side by side), `alarms` (judging), `markdown` (report.md, summary),
`plots` (PNGs), `make` (the whole report), `__main__` (the command). It imports nothing from the
trainer: it reads the run directory's files (docs/ARCHITECTURE.md, "Run directory").
"""
