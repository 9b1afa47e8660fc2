"""Notebook support: parameters -> config, tables and plots, the live training dashboard, the papermill runner.

The numbered notebooks in `notebooks/` stay thin: a `parameters` cell of plain literals, a `config` cell
(`job = job_from_params(...)`), then one call per cell into `workbench` (this package, `workbench.train`,
`workbench.run.profiling`, `workbench.bench`, `workbench.compare`).

This is the only package that imports ipywidgets, and it does so lazily (only when a live dashboard opens),
so `python -m workbench.notebook run` and the config checks work without a frontend. The names below are
loaded on first use for the same reason.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    # params
    "job_from_params": "params", "repo_root": "params", "resolve_path": "params", "PARAM_KEYS": "params",
    "resolve_dataset": "params",
    "bench_jobs": "params", "write_job_toml": "params",
    # reports
    "environment_report": "reports", "asset_facts": "reports", "config_table": "reports",
    "flavor_table": "reports", "metrics_frame": "reports", "read_metrics": "reports", "read_summary": "reports",
    "summary_table": "reports", "run_folder_table": "reports", "plot_metrics": "reports",
    "profile_report": "reports", "performance_table": "reports", "plot_breakdown": "reports",
    "metrics_table": "reports", "training_checks": "reports", "run_summary": "reports",
    # comparisons (05) and the benchmark matrix (06)
    "comparison_summary": "comparisons", "largest_differences": "comparisons", "parity_facts": "comparisons",
    "token_agreement": "comparisons", "bench_table": "comparisons", "trn2_model_table": "comparisons",
    "plot_bench": "comparisons", "loss_agreement": "comparisons", "shared_init": "comparisons",
    "measured_on_h200": "comparisons",
    # memory plans (07)
    "plan_table": "memory_plans", "plan_advice": "memory_plans", "trn2_plans": "memory_plans",
    "trn2_plans_table": "memory_plans", "plan_chart": "memory_plans",
    "plan_with_status": "dashboard", "compare_with_status": "dashboard",
    # display
    "Table": "display", "checks": "display", "key_values": "display", "plot_title": "display",
    # dashboard
    "Dashboard": "dashboard", "TrainingFailed": "dashboard", "live_frontend": "dashboard",
    "train_with_dashboard": "dashboard", "fresh_run_dir": "dashboard", "transient_progress": "dashboard",
    "status_line": "dashboard",
    # chat fine-tuning (09)
    "chat_data": "chat", "Conversation": "chat", "packing_table": "chat", "initial_weights": "chat",
    "replies": "chat",
    # runner
    "run_notebooks": "runner", "NotebookParameterError": "runner",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))


__all__ = list(_EXPORTS)
