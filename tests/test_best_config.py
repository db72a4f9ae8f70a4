"""``best_config.json``: every key a run writes is explained where the file is documented (README's output-file
table and ``write_best_config``'s docstring), ``calibration`` (fp16 overflow calibration) included."""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from tctune.hardware import resolve
from tctune.optimize import write_best_config
from tctune.trial import TrialParams

ROOT = Path(__file__).resolve().parents[1]


def _written(tmp_path, precision: str, baseline: str | None, cast: bool = False) -> dict:
    """The best_config.json write_best_config writes for one trial, on a tuner with only what it reads."""
    tuner = SimpleNamespace(
        trial_params=lambda params, fp8_keep=None, fp8_fast_accum=False: TrialParams.from_params(
            params, fp8_keep or ("lm_head",), fp8_fast_accum=fp8_fast_accum),
        mf=SimpleNamespace(name="m", path=tmp_path / "m.py"), hw=resolve("h100"),
        cfg=SimpleNamespace(output_dtype="compute", batch_sizes=(8, 32), calibration=str(tmp_path / "calib")))
    attrs = {"throughput": 123.0, "max_rel_error": 1e-3, "fp8_keep": ["lm_head"], "fp8_fast_accum": True}
    if baseline:
        attrs["baseline"] = baseline
    if cast:
        attrs["model_cast"] = True
    trial = SimpleNamespace(params={"batch_size": 8, "precision": precision, "graph_passes": not baseline,
                                    "runtime": "eager"}, user_attrs=attrs, number=3)
    path = tmp_path / f"{precision}_{baseline}.json"
    write_best_config(path, tuner, trial, [{"name": "cast_precision"}], "study-1")
    return json.loads(path.read_text())


def _readme_row() -> str:
    return next(line for line in (ROOT / "README.md").read_text().splitlines()
                if line.startswith("| `best_config.json` |"))


@pytest.mark.parametrize("precision,baseline,cast", [("fp16", None, False), ("fp8", None, False),
                                                     ("bf16", "cast_bf16", True)])
def test_every_key_of_best_config_is_documented(tmp_path, precision, baseline, cast):
    cfg = _written(tmp_path, precision, baseline, cast)
    assert cfg["calibration"] is True  # what every run writes
    row, doc = _readme_row(), write_best_config.__doc__
    keys = set(cfg) | set(cfg["recommended"]) | set(cfg["params"])
    assert not [k for k in keys if f"`{k}`" not in row], row
    assert not [k for k in cfg if not re.search(rf"``{k}(``|: )", doc)], doc  # (``model_cast: true``)


def test_the_calibration_key_says_what_it_does():
    row = _readme_row()
    said = re.search(r"`calibration` \(([^)]*(?:\([^)]*\)[^)]*)*)\)", row)
    assert said and "fp16 overflow calibration" in said.group(1), row
    assert "65504" in row and "tctune export" in row  # what it keeps in FP32, and that the export repeats it
    assert "``calibration`` (fp16 overflow calibration" in " ".join(write_best_config.__doc__.split())
