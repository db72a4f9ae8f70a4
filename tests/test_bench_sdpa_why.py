"""CPU tests of benchmarks/sdpa_why.py: every SDPA call of a model recorded and grouped by signature, each group
tried on every backend, the remedies it proposes, and the table."""
from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from torch import nn

from zoo import load_benchmark





why = load_benchmark("sdpa_why")


class _TwoBiases(nn.Module):
    """Three SDPA calls: two with the same permuted bias (one signature), one without a mask."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(10, 10, 4))

    def forward(self, q, k, v):
        mask = self.bias.permute(2, 0, 1).unsqueeze(0)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        b = F.scaled_dot_product_attention(a, k, v, attn_mask=mask)
        return F.scaled_dot_product_attention(b, k, v)


def test_calls_are_grouped_by_signature_with_their_layouts():
    q = k = v = torch.randn(2, 4, 10, 8)
    groups = why.record_calls(_TwoBiases().eval(), (q, k, v))
    assert [g["calls"] for g in groups] == [2, 1]
    assert groups[0]["kwargs"]["attn_mask"].stride() == (4, 1, 40, 4)
    assert why.describe(groups[0]["kwargs"]["attn_mask"])["stride"] == [4, 1, 40, 4]
    assert groups[1]["kwargs"].get("attn_mask") is None


def test_variants_offer_a_dense_mask_and_every_backend_is_tried():
    q = k = v = torch.randn(2, 4, 10, 8)
    mask = torch.randn(10, 10, 4).permute(2, 0, 1).unsqueeze(0)
    kw = {"attn_mask": mask}
    variants = why.variants(q, k, v, kw)
    dense = variants["mask_full_contiguous"][3]["attn_mask"]
    assert dense.is_contiguous() and dense.shape == (2, 4, 10, 10)
    assert "qkv_contiguous" not in variants  # q / k / v are contiguous already
    tried = why.try_backends(q, k, v, kw, iters=2, cuda=False)
    assert set(tried) == {"FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"}
    assert tried["MATH"]["ok"] and tried["MATH"]["ms"] > 0
    assert not tried["CUDNN_ATTENTION"]["ok"] and tried["CUDNN_ATTENTION"]["error"]  # no cuDNN attention on a CPU
    assert why._choice(q, k, v, kw) in ("FLASH_ATTENTION", "MATH")


def test_main_on_a_tiny_zoo_model_writes_json_and_table(tmp_path):
    rc = why.main(["--models", "BertForMaskedLM", "--tiny", "--device", "cpu", "--iters", "2", "--out", str(tmp_path)])
    assert rc == 0
    result = json.loads((tmp_path / "sdpa_why.json").read_text())
    groups = result["models"]["BertForMaskedLM"]["groups"]
    assert groups and sum(g["calls"] for g in groups) == 2  # the tiny config's two layers
    table = (tmp_path / "sdpa_why.md").read_text()
    assert table.startswith("| model | calls |") and "BertForMaskedLM" in table
