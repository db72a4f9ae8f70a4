"""``--calibration DIR``: a batch file that cannot be read gets one error naming the file, the cause and what a
batch file must hold; folder entries that are not batch files are named, and a folder without one is an error."""
from __future__ import annotations

import logging
import subprocess
import sys

import numpy as np
import pytest
import torch

from tctune.calibration import read_folder
from tctune.errors import UsageError

EXAMPLE = (torch.randn(2, 6), torch.randint(0, 5, (2,)))
WANT = "input_0: float32 (B, 6), input_1: int64 (B)"


def _good(path):
    np.savez(path, input_0=np.random.randn(4, 6).astype(np.float32), input_1=np.arange(4, dtype=np.int64))


def _npz_bytes(tmp_path):
    _good(tmp_path / "src.npz")
    data = (tmp_path / "src.npz").read_bytes()
    (tmp_path / "src.npz").unlink()
    return data


def _corrupt(tmp_path, case):
    """A batch file named like a batch, broken in the way ``case`` says."""
    d = tmp_path / "calib"
    d.mkdir()
    name = "001.safetensors" if case == "safetensors" else "001.npz"
    f = d / name
    if case == "not_npz":
        f.write_bytes(b"x0,x1,x2\n0.1,0.2,0.3\n" * 4)  # a CSV under an .npz name
    elif case == "empty":
        f.write_bytes(b"")
    elif case == "truncated":
        f.write_bytes(_npz_bytes(tmp_path)[:200])
    elif case == "npy":
        with f.open("wb") as fh:
            np.save(fh, np.random.randn(4, 6).astype(np.float32))
    elif case == "object":
        np.savez(f, input_0=np.array([{"a": 1}], dtype=object), input_1=np.arange(1))
    elif case == "strings":
        np.savez(f, input_0=np.array(["a", "b"]), input_1=np.arange(2))
    elif case == "safetensors":
        f.write_bytes(b"\xff" * 64)
    _good(d / "000.npz")  # a good batch before it: the error is about the broken file only
    return d, f


@pytest.mark.parametrize("case,cause", [
    ("not_npz", "it is not an .npz archive (a zip of .npy arrays)"),
    ("empty", "the file is empty (0 bytes)"),
    ("truncated", "it is a damaged .npz (zip) archive"),
    ("npy", "it is a single .npy array (numpy.save), not an .npz archive of named arrays"),
    ("object", "its array 'input_0' holds Python objects (dtype object)"),
    ("strings", "its array 'input_0' has dtype <U1, which is not a tensor dtype"),
    ("safetensors", "it is not a valid safetensors file"),
])
def test_an_unreadable_batch_file_gets_one_error_with_the_file_the_cause_and_the_fix(tmp_path, case, cause):
    d, f = _corrupt(tmp_path, case)
    with pytest.raises(UsageError) as e:
        read_folder(d, EXAMPLE)
    msg = str(e.value)
    assert e.value.field == "calibration"
    assert msg.startswith(f"calibration file {f}: cannot be read: {cause}"), msg
    if case != "object":
        assert "pickle" not in msg, msg  # numpy's "pickled data" guess is not the cause of a damaged file
    assert "allow_pickle" not in msg and "Traceback" not in msg
    fix = msg.split("\n  fix: ")
    assert len(fix) == 2, msg  # one cause, one fix line
    assert f"named input_0, input_1, ... ({WANT})" in fix[1] and "numpy.savez(" in fix[1]
    assert "safetensors.torch.save_file(" in fix[1]


def test_entries_that_are_not_batch_files_are_named_in_one_warning(tmp_path, caplog):
    d = tmp_path / "calib"
    d.mkdir()
    _good(d / "000.npz")
    with (d / "001.NPZ").open("wb") as fh:  # the suffix in any case (numpy.savez would append .npz to a path)
        _good(fh)
    np.save(d / "002.npy", np.zeros((4, 6), np.float32))
    (d / "notes.txt").write_text("how these were made")
    (d / "more").mkdir()
    (d / ".DS_Store").write_bytes(b"\0")
    with caplog.at_level(logging.WARNING, logger="tctune"):
        batches = read_folder(d, EXAMPLE)
    assert [b.source for b in batches] == ["000.npz", "001.NPZ"]
    warned = [r.getMessage() for r in caplog.records if r.name == "tctune" and r.levelno == logging.WARNING]
    assert warned == [f"calibration {d}: not read (not .safetensors / .npz batch files): 002.npy, more/, notes.txt"]


def test_a_folder_of_good_batches_warns_nothing(tmp_path, caplog):
    d = tmp_path / "calib"
    d.mkdir()
    _good(d / "000.npz")
    with caplog.at_level(logging.WARNING, logger="tctune"):
        assert len(read_folder(d, EXAMPLE)) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_folder_without_a_batch_file_is_an_error_naming_what_it_holds(tmp_path):
    d = tmp_path / "calib"
    d.mkdir()
    for i in range(10):
        np.save(d / f"{i:03d}.npy", np.zeros((4, 6), np.float32))
    with pytest.raises(UsageError) as e:
        read_folder(d, EXAMPLE)
    msg = str(e.value)
    assert msg.startswith(f"calibration {d} holds no .safetensors or .npz file (it holds 000.npy, 001.npy, ")
    assert "007.npy and 2 more, none of them a batch file)" in msg
    assert msg.count("\n  fix: ") == 1 and WANT in msg
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match=r"holds no \.safetensors or \.npz file \(it is empty\)"):
        read_folder(tmp_path / "empty", EXAMPLE)


TWO_INPUTS = '''
import torch
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(5, 6)
        self.lin = torch.nn.Linear(6, 3)
    def forward(self, x, ids):
        return self.lin(x + self.emb(ids))
def build_model():
    return M().eval()
def example_inputs(batch_size):
    return (torch.randn(batch_size, 6), torch.randint(0, 5, (batch_size,)))
'''


def test_cli_names_the_flag_the_file_and_the_cause(tmp_path):
    f = tmp_path / "two.py"
    f.write_text(TWO_INPUTS)
    d, bad = _corrupt(tmp_path, "not_npz")
    r = subprocess.run([sys.executable, "-m", "tctune", "optimize", str(f), "--out", str(tmp_path / "out"), "--quiet",
                        "--no-export", "--batch-sizes", "4", "--trials", "1", "--calibration", str(d)],
                       capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert r.returncode == 2, r.stderr
    assert f"--calibration file {bad}: cannot be read: it is not an .npz archive" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "allow_pickle" not in r.stderr
