"""GPT-2 small language model (transformers ``GPT2LMHeadModel``) from ``GPT2Config()``, random weights: no download.

Default sizes: 12 layers, hidden 768, 12 heads, context 1024, vocabulary V = 50257 (not a multiple of 8: the
LM head's N is misaligned for fp16/bf16 Tensor Cores; 13.2 ms vs 2.09 ms for the bf16 LM head at V = 50257
vs 50264 on the H200, benchmarks/NOTES.md, reference measurements: the case ``pad_linear_dims`` exists for).
Input: ``input_ids`` (batch, 512) int64 in [0, 50257). Output: the logits (batch, 512, 50257) float32
(no KV cache is built or returned). Needs the ``transformers`` package (``pip install 'tctune[recipes]'``).
"""
import torch

SEQ_LEN = 512
VOCAB_SIZE = 50257


class GPT2Logits(torch.nn.Module):
    """Runs the LM without a KV cache and returns the logits as a plain tensor."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids):
        return self.lm(input_ids=input_ids, use_cache=False).logits


def make_model(**overrides) -> torch.nn.Module:
    """``GPT2LMHeadModel(GPT2Config(**overrides))`` with seeded random weights (no overrides: GPT-2 small)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2Logits(GPT2LMHeadModel(GPT2Config(**overrides)))


def build_model() -> torch.nn.Module:
    return make_model()


def example_inputs(batch_size: int):
    return (torch.randint(0, VOCAB_SIZE, (batch_size, SEQ_LEN)),)
