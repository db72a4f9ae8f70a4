"""Plots of a study through Optuna's visualization module: interactive HTML (plotly) and PNG (matplotlib).

Both libraries are optional (``pip install 'tctune[plots]'``); a missing one is reported, never an error.
"""
from __future__ import annotations

import logging
import warnings
from pathlib import Path

import optuna

log = logging.getLogger("tctune")


def _targets(study: optuna.Study):
    if len(study.directions) == 3:
        return ([lambda t: t.values[0], lambda t: t.values[1]], ["throughput (items/s)", "p99 latency (ms)"])
    name = "p99 latency (ms)" if study.directions[0] == optuna.study.StudyDirection.MINIMIZE else "throughput (items/s)"
    return None, [name]


def write_plots(study: optuna.Study, out_dir: str | Path) -> dict:
    """Write ``history.html/png`` (single objective) or ``pareto.html/png`` (Pareto study) into ``out_dir``.

    Returns:
        ``{name: path}`` for each file written, plus ``"skipped": reason`` when a library is missing or
        there are too few complete trials.
    """
    out = Path(out_dir)
    done = [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE]
    if len(done) < 2:
        return {"skipped": "fewer than 2 complete trials"}
    multi = len(study.directions) > 1
    name = "pareto" if multi else "history"
    targets, names = _targets(study)
    written: dict = {}
    skipped = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import plotly  # noqa: F401
            if multi:
                fig = optuna.visualization.plot_pareto_front(study, targets=lambda t: (t.values[0], t.values[1]),
                                                             target_names=names)
            else:
                fig = optuna.visualization.plot_optimization_history(study, target_name=names[0])
            path = out / f"{name}.html"
            fig.write_html(str(path), include_plotlyjs="cdn")
            written[f"{name}_html"] = str(path)
        except ImportError:
            skipped.append("HTML needs plotly (pip install 'tctune[plots]')")
        except Exception as exc:  # a plot must never cost the run
            skipped.append(f"HTML failed: {type(exc).__name__}: {exc}")
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            if multi:
                ax = optuna.visualization.matplotlib.plot_pareto_front(
                    study, targets=lambda t: (t.values[0], t.values[1]), target_names=names)
            else:
                ax = optuna.visualization.matplotlib.plot_optimization_history(study, target_name=names[0])
            path = out / f"{name}.png"
            ax.figure.savefig(path, dpi=110, bbox_inches="tight")
            plt.close(ax.figure)
            written[f"{name}_png"] = str(path)
        except ImportError:
            skipped.append("PNG needs matplotlib (pip install 'tctune[plots]')")
        except Exception as exc:
            skipped.append(f"PNG failed: {type(exc).__name__}: {exc}")
    if skipped:
        written["skipped"] = "; ".join(skipped)
    return written
