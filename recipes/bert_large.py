"""BERT-large encoder (transformers ``BertModel``) from a config with random weights: no download.

Sizes of bert-large-uncased: 24 layers, hidden 1024, 16 heads, intermediate 4096, vocabulary 30522.
Input: ``input_ids`` (batch, 384) int64 in [0, 30522). Output: the last hidden state (batch, 384, 1024) float32.
Needs the ``transformers`` package (``pip install 'tctune[recipes]'``).

On the H200 (fp16, batch 64; benchmarks/NOTES.md, reference measurements): eager 1,797 seq/s, fp16
``torch.compile`` 955 seq/s (HF's SDPA call is decomposed under compile). The suite (``benchmarks/suite.py``)
measures it at batch 64.
"""
import torch

SEQ_LEN = 384
VOCAB_SIZE = 30522
#: bert-large-uncased sizes; ``make_model(**overrides)`` changes any of them (tests build a tiny one).
CONFIG = {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096,
          "vocab_size": VOCAB_SIZE, "max_position_embeddings": 512}


class BertEncoder(torch.nn.Module):
    """Returns the last hidden state as a plain tensor (the encoder output the tuner compares)."""

    def __init__(self, bert):
        super().__init__()
        self.bert = bert

    def forward(self, input_ids):
        return self.bert(input_ids=input_ids).last_hidden_state


def make_model(**overrides) -> torch.nn.Module:
    """BERT-large with ``CONFIG`` updated by ``overrides`` (``BertConfig`` field names), seeded random weights."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    return BertEncoder(BertModel(BertConfig(**{**CONFIG, **overrides}), add_pooling_layer=False))


def build_model() -> torch.nn.Module:
    return make_model()


def example_inputs(batch_size: int):
    return (torch.randint(0, VOCAB_SIZE, (batch_size, SEQ_LEN)),)
