"""The captured FP32 graph is checked against the model run eagerly (``tctune.search.loop.capture_mismatch``):
a forward that takes another path in eager mode than under ``torch.export`` is said once, before the trials,
with the output, the error and the fix, and recorded in ``report.json``'s ``capture``."""
from __future__ import annotations

import logging

import torch

from tctune.capture import capture
from tctune.hardware import resolve
from tctune.modelfile import ModelFile
from tctune.search.config import TuneConfig
from tctune.search.loop import CAPTURE_MISMATCH_LIMIT, Tuner, capture_mismatch


class _Encoder(torch.nn.Module):
    """A padded-batch encoder as people write it: nn.TransformerEncoder with a key padding mask (in eager mode its
    nested-tensor fast path returns zeros at the padded positions; torch.export captures the regular path)."""

    def __init__(self, nested: bool = True) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 32)
        layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested)
        self.cls = torch.nn.Linear(32, 3)

    def forward(self, input_ids, attention_mask):
        h = self.enc(self.emb(input_ids), src_key_padding_mask=attention_mask == 0)
        return {"logits": self.cls(h[:, 0]), "hidden": h}


class _EagerOnly(torch.nn.Module):
    """A branch only eager mode takes, and an integer output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        y = self.fc(x)
        if not torch.compiler.is_exporting():
            y = y + 0.5 * y.abs().mean()
        return y, y.argmax(-1)


def _inputs(b: int):
    g = torch.Generator().manual_seed(b)
    ids = torch.randint(0, 50, (b, 10), generator=g)
    mask = torch.ones(b, 10, dtype=torch.long)
    mask[:, 7:] = 0
    return ids, mask


def test_eager_only_path_is_named_with_output_and_error():
    torch.manual_seed(0)
    model = _Encoder().eval()
    gm = capture(model, _inputs(2))
    text = capture_mismatch(model, gm, _inputs(3))
    assert text is not None
    assert "output ['hidden']" in text and "enable_nested_tensor=False" in text
    err = float(text.split("relative L2 error ")[1].split(" ")[0])
    assert err > 0.05  # the padded rows: zeros in eager mode, values in the graph

    branch = _EagerOnly().eval()
    text = capture_mismatch(branch, capture(branch, (torch.randn(2, 8),)), (torch.randn(3, 8),))
    assert text is not None and "output [0]" in text


def test_faithful_capture_is_not_flagged():
    torch.manual_seed(0)
    model = _Encoder(nested=False).eval()  # the regular path in both modes
    assert capture_mismatch(model, capture(model, _inputs(2)), _inputs(3)) is None
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()
    x = torch.randn(2, 8) * 100
    assert capture_mismatch(mlp, capture(mlp, (x,)), (x,)) is None
    assert CAPTURE_MISMATCH_LIMIT < 1e-2  # stricter than the default accuracy limit of every candidate


def test_tuner_warns_once_and_report_records_it(tmp_path, caplog):
    torch.manual_seed(0)
    ids, mask = _inputs(4)
    mf = ModelFile.from_module(_Encoder(), {"attention_mask": mask, "input_ids": ids})
    cfg = TuneConfig(out_dir=str(tmp_path / "out"), batch_sizes=(4,), trials=1, quiet=True, export=False)
    with caplog.at_level(logging.WARNING, logger="tctune"):
        t = Tuner(cfg, mf, resolve(None), device=torch.device("cpu"))
    said = [r.getMessage() for r in caplog.records if "differs from the model run eagerly" in r.getMessage()]
    assert len(said) == 1 and "output ['hidden']" in said[0]
    assert t.captured.info()["eager_mismatch"] == said[0]

    caplog.clear()
    mf = ModelFile.from_module(_Encoder(nested=False), {"attention_mask": mask, "input_ids": ids})
    with caplog.at_level(logging.WARNING, logger="tctune"):
        t = Tuner(cfg, mf, resolve(None), device=torch.device("cpu"))
    assert not [r for r in caplog.records if "differs from the model run eagerly" in r.getMessage()]
    assert "eager_mismatch" not in t.captured.info()
