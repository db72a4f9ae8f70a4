"""`tctune inspect`: Tensor Core eligibility per GEMM/conv, before and after the passes, on the CPU."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tctune.errors import UsageError
from tctune.inspect import inspect_model_file

ROOT = Path(__file__).resolve().parents[1]
SEED_CNN = ROOT / "recipes" / "seed_cnn.py"

MLP_FILE = '''
import torch
from torch import nn


class MLP(nn.Module):
    """Linear 37 -> 61 -> 13 with GELU: every N and K is odd."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(37, 61)
        self.fc2 = nn.Linear(61, 13)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def build_model():
    torch.manual_seed(0)
    return MLP()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 37),)
'''

BERT_FILE = '''
import torch
from transformers import BertConfig, BertModel


class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        cfg = BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=96,
                         vocab_size=1000)
        self.bert = BertModel(cfg, add_pooling_layer=False)

    def forward(self, input_ids):
        return self.bert(input_ids=input_ids).last_hidden_state


def build_model():
    torch.manual_seed(0)
    return Encoder()


def example_inputs(batch_size):
    return (torch.randint(0, 1000, (batch_size, 16)),)
'''


@pytest.fixture(scope="module")
def mlp_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("mlp") / "odd_mlp.py"
    path.write_text(MLP_FILE)
    return path


@pytest.fixture(scope="module")
def seed_fp16():
    return inspect_model_file(str(SEED_CNN), target="h100", precision="fp16", batch_size=32)


@pytest.fixture(scope="module")
def mlp_fp16(mlp_file):
    # batch 64 keeps every linear above the "too small" threshold (64*13*61 > 2^15)
    return inspect_model_file(str(mlp_file), target="h100", precision="fp16", batch_size=64)


def _by_module(ins):
    return {p.before.module: p for p in ins.pairs if p.before is not None}


def test_seed_cnn_flags_unaligned_conv_and_linear_before(seed_fp16):
    nodes = _by_module(seed_fp16)
    conv, fc = nodes["conv1"].before, nodes["fc"].before
    assert conv.op == "conv2d" and not conv.tensor_core and "Cin=3 not a multiple of 8" in conv.reason
    assert fc.op == "linear" and not fc.tensor_core and "N=10 not a multiple of 8 (needs +6)" in fc.reason


def test_seed_cnn_passes_align_the_linear(seed_fp16):
    fc = _by_module(seed_fp16)["fc"]
    assert fc.after is not None and fc.after.tensor_core and fc.after.shapes["weight"] == [16, 8192]
    assert any(r.name == "pad_linear_dims" and r.count >= 1 for r in seed_fp16.passes)
    assert seed_fp16.share_after() > seed_fp16.share_before()


def test_linear_flops_are_exact(seed_fp16):
    fc = _by_module(seed_fp16)["fc"]
    assert fc.before.flops == 2 * 32 * 10 * 8192  # 2*M*N*K
    assert fc.after.flops == 2 * 32 * 16 * 8192  # padded work is reported as run...
    d = seed_fp16.to_dict()
    useful = sum(n["flops"] for n in d["nodes"])
    assert d["summary"]["total_gflop"] == pytest.approx(useful / 1e9)  # ...but the summary counts useful FLOPs


def test_conv_flops_are_exact(seed_fp16):
    conv = _by_module(seed_fp16)["conv1"].before
    assert conv.flops == 2 * 32 * 32 * 32 * 32 * 3 * 3 * 3  # 2*N*Cout*H*W*Cin*kh*kw


def test_odd_mlp_every_linear_flagged_before_and_aligned_after(mlp_fp16):
    pairs = [p for p in mlp_fp16.pairs if p.before is not None]
    assert {p.before.module for p in pairs} == {"fc1", "fc2"}
    for p in pairs:
        assert not p.before.tensor_core and "not a multiple of 8" in p.before.reason
        assert p.after.tensor_core, p.after.reason
        assert p.after.dtype == "fp16"
    assert mlp_fp16.share_before() == 0.0
    assert mlp_fp16.share_after() == pytest.approx(1.0)


def test_fp32_is_never_on_tensor_cores(mlp_file):
    ins = inspect_model_file(str(mlp_file), target="h100", precision="fp32", batch_size=64)
    ops = [p.before for p in ins.pairs] + [p.after for p in ins.pairs]
    assert ops and all(not o.tensor_core and "choose --precision tf32" in o.reason for o in ops)
    assert ins.share_before() == 0.0 and ins.share_after() == 0.0


def test_bf16_on_v100_is_a_usage_error(mlp_file):
    with pytest.raises(UsageError, match="supported: fp32, fp16"):
        inspect_model_file(str(mlp_file), target="v100", precision="bf16")


def test_json_has_exactly_the_documented_keys(seed_fp16):
    d = json.loads(json.dumps(seed_fp16.to_dict()))
    assert set(d) == {"model", "hardware", "precision", "batch_size", "nodes", "passes", "summary"}
    assert (d["model"], d["precision"], d["batch_size"]) == ("seed_cnn", "fp16", 32)
    node_keys = {"module", "op", "shapes", "dtype", "flops", "tensor_core", "reason"}
    for n in d["nodes"]:
        assert set(n) == node_keys | {"after"}
        assert n["after"] is None or set(n["after"]) == node_keys
    assert set(d["summary"]) == {"tensor_core_flop_share_before", "tensor_core_flop_share_after", "total_gflop"}
    assert {p["name"] for p in d["passes"]} >= {"pad_linear_dims"}


def test_cli_text_output_has_table_and_summary(mlp_file):
    r = subprocess.run([sys.executable, "-m", "tctune", "inspect", str(mlp_file), "--target", "h100",
                        "--precision", "fp16", "--batch-size", "64"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "MODULE" in r.stdout and "fc1" in r.stdout and "fc2" in r.stdout
    assert "Tensor Core FLOP share: 0.0% before -> 100.0% after passes" in r.stdout


def test_bert_reports_sdpa_and_named_linears(tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "tiny_bert.py"
    path.write_text(BERT_FILE)
    ins = inspect_model_file(str(path), target="h100", precision="bf16", batch_size=4)
    before = [p.before for p in ins.pairs if p.before is not None]
    modules = {o.module for o in before if o.op == "linear"}
    assert "bert.encoder.layer.0.attention.self.query" in modules
    assert "bert.encoder.layer.0.intermediate.dense" in modules
    sdpa = [o for o in before if o.op == "scaled_dot_product_attention"]
    assert len(sdpa) == 1
    q = sdpa[0].shapes["query"]  # (batch, heads, seq, head dim) = (4, 4, 16, 16)
    assert q == [4, 4, 16, 16]
    assert sdpa[0].flops == 2 * 4 * 4 * 16 * 16 * (16 + 16)  # its two GEMMs
    inter = next(o for o in before if o.module.endswith("intermediate.dense"))
    assert inter.tensor_core  # 64 -> 96 at bf16: aligned, and 64*16*96*64 multiply-adds


def test_cli_precision_choices_are_the_pass_precisions():
    import passes
    import tctune.inspect as ti

    assert ti._PRECISIONS == passes.PRECISIONS


def test_a_convolution_fused_with_its_relu_is_paired_and_still_counted(seed_fp16):
    """On a Hopper target the seed CNN's conv + ReLU becomes passes.fuse_conv_relu's cuDNN op: the inspection
    still sees a convolution there (same FLOPs, the op's name), paired with the one it replaced."""
    pair = _by_module(seed_fp16)["conv1"]
    assert any(r.name == "fuse_conv_relu" and r.count == 1 for r in seed_fp16.passes)
    assert pair.after is not None and pair.after.op == "conv2d_relu" and pair.after.kind == "conv"
    assert pair.after.flops == pair.before.flops
    assert "Cin=3 not a multiple of 8" in pair.after.reason


def test_a_model_that_does_not_run_is_named_with_its_line_and_fix(tmp_path):
    """A shape bug in forward made the capture fail and `inspect` blamed "a dynamic batch"; it now names the
    model's own error, line and fix, as `tctune optimize` does (exit 2: bad input)."""
    bug = tmp_path / "shape_bug.py"
    bug.write_text("import torch\n"
                   "class M(torch.nn.Module):\n"
                   "    def __init__(self):\n"
                   "        super().__init__()\n"
                   "        self.fc = torch.nn.Linear(16, 8)\n"
                   "    def forward(self, x):\n"
                   "        return self.fc(x.view(x.shape[0], 32))\n"
                   "def build_model():\n"
                   "    return M()\n"
                   "def example_inputs(batch_size):\n"
                   "    return (torch.randn(batch_size, 16),)\n")
    r = subprocess.run([sys.executable, "-m", "tctune", "inspect", str(bug), "--target", "h100"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "the model raised in FP32" in r.stderr and "shape_bug.py:7 in forward" in r.stderr
    assert "fix: make forward run" in r.stderr and "dynamic batch" not in r.stderr and "Traceback" not in r.stderr


def test_a_conv_whose_batchnorm_was_folded_is_not_called_unchanged(tmp_path):
    """Folding a BatchNorm into its convolution keeps the conv's shapes, so its "after" row read "unchanged" while
    the pass list below said ``fold_conv_batchnorm: 1 change(s): conv2d`` (fresh-user finding)."""
    from tctune.inspect import format_text

    f = tmp_path / "cnn.py"
    f.write_text('''import torch, torch.nn as nn
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 12, 3, padding=1); self.bn = nn.BatchNorm2d(12)
        self.c2 = nn.Conv2d(12, 20, 3, stride=2, padding=1)
    def forward(self, x):
        x = torch.relu(self.bn(self.c1(x)))
        return torch.relu(self.c2(x)).mean((2, 3))
def build_model():
    return Net()
def example_inputs(batch_size):
    return (torch.randn(batch_size, 3, 16, 16),)
''')
    text = format_text(inspect_model_file(f, batch_size=4))
    lines = text.splitlines()
    c1 = next(i for i, x in enumerate(lines) if x.startswith("c1 "))
    c2 = next(i for i, x in enumerate(lines) if x.startswith("c2 "))
    assert "same shapes, rewritten by fold_conv_batchnorm" in lines[c1 + 1], lines[c1 + 1]
    assert "unchanged" in lines[c2 + 1]  # no pass touched it
