"""The bf16 "pure" graph runs every GEMM in the dtype ``model.to(torch.bfloat16)`` runs it in.

cast_precision keeps ops the model itself up-casts (``x.to(torch.float32)`` in T5's RMSNorm, GPT-Neo's
``query.to(torch.float32)`` before its score matmul) in FP32, as ``model.to(dt)`` computes them. That rule must
not leave a GEMM in FP32 that ``model.to(dt)`` runs low (an FP32 GEMM runs on CUDA cores, 13x slower than bf16
Tensor Cores on the H200), nor lower one the model keeps FP32. Both graphs are captured as tctune captures
(``tctune.capture.capture``) and their GEMM-class nodes counted by output dtype.
"""
from __future__ import annotations

import collections
import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from tctune import hardware  # noqa: E402
from tctune.capture import capture  # noqa: E402
from tctune.trial import apply_passes  # noqa: E402

#: ATen ops that run on Tensor Cores in bf16 (the GEMM class a cast pass must not leave in FP32 by mistake).
GEMMS = frozenset({"linear", "mm", "bmm", "addmm", "baddbmm", "matmul", "scaled_dot_product_attention",
                   "convolution", "conv1d", "conv2d", "conv3d"})


def _gemm_dtypes(gm: torch.fx.GraphModule) -> collections.Counter:
    """``{(op name, dtype): count}`` over the GEMM-class nodes of ``gm`` (dtype of the node's output)."""
    counts: collections.Counter = collections.Counter()
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        name = node.target._schema.name.split("::")[1]
        val = node.meta.get("val")
        if name in GEMMS and isinstance(val, torch.Tensor):
            counts[(name, val.dtype)] += 1
    return counts


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


class _Seq2SeqLogits(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids, mask, decoder_ids):
        return self.model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits


class _Hidden(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids).last_hidden_state


def _mt5():
    cfg = transformers.MT5Config(vocab_size=97, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                 num_heads=4, decoder_start_token_id=0, use_cache=False)
    torch.manual_seed(0)
    model = _Seq2SeqLogits(transformers.MT5ForConditionalGeneration(cfg)).eval()

    def inputs(b):
        mask = torch.ones(b, 12, dtype=torch.long)
        mask[0, 8:] = 0  # one padded sequence
        return torch.randint(0, 97, (b, 12)), mask, torch.randint(0, 97, (b, 10))

    return model, inputs


def _gpt_neo():
    cfg = transformers.GPTNeoConfig(
        use_cache=False, vocab_size=97, max_position_embeddings=64, hidden_size=32, num_layers=2, num_heads=4,
        attention_types=[[["global", "local"], 1]], window_size=8, intermediate_size=64,
        bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return _Hidden(transformers.GPTNeoModel(cfg)).eval(), lambda b: (torch.randint(0, 97, (b, 16)),)


def _graphs(build):
    model, inputs = build()
    gm = capture(model, inputs(2))
    cast, results = apply_passes(gm, hardware.resolve("sm_90"), "bf16", policy="pure")
    ref = capture(copy.deepcopy(model).to(torch.bfloat16), inputs(2))
    return model, inputs, cast, results, ref


def test_mt5_bf16_pure_has_no_fp32_gemm_model_to_runs_low_and_matches_its_accuracy():
    model, inputs, cast, results, ref = _graphs(_mt5)
    got, want = _gemm_dtypes(cast), _gemm_dtypes(ref)

    fp32 = {k: v for k, v in got.items() if k[1] == torch.float32}
    assert all(v <= want[k] for k, v in fp32.items()), (got, want)  # no FP32 GEMM beyond model.to(bf16)'s
    assert got[("linear", torch.bfloat16)] > 0 and got[("scaled_dot_product_attention", torch.bfloat16)] > 0
    skipped = next(r for r in results if r.name == "cast_precision").skipped
    explicit = [s for s in skipped if s.reason.startswith("explicit FP32: ")]
    assert explicit, "T5's RMSNorm statistics (hidden.to(torch.float32).pow(2).mean) stay FP32"
    assert not [s for s in explicit if s.reason.split(":")[1].split()[0] in GEMMS], explicit
    torch.manual_seed(7)
    x = inputs(3)
    with torch.no_grad():
        ref_out = model(*x)
        eager = copy.deepcopy(model).to(torch.bfloat16)(*x).float()
        out = cast(*x)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert _rel(out, ref_out) <= 2 * _rel(eager, ref_out) + 1e-3, (_rel(out, ref_out), _rel(eager, ref_out))


def test_gpt_neo_explicit_fp32_score_matmul_stays_fp32_like_model_to():
    """GPT-Neo casts query and key to FP32 itself: ``model.to(bf16)`` runs that matmul in FP32, and so must we;
    its other GEMMs run bf16 in both graphs."""
    _, _, cast, _, ref = _graphs(_gpt_neo)
    got, want = _gemm_dtypes(cast), _gemm_dtypes(ref)

    assert want[("matmul", torch.float32)] > 0
    assert got[("matmul", torch.float32)] == want[("matmul", torch.float32)], (got, want)
    assert got[("matmul", torch.bfloat16)] == want[("matmul", torch.bfloat16)], (got, want)
    assert got[("linear", torch.float32)] == 0 and got[("linear", torch.bfloat16)] > 0
