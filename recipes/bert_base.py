"""BERT-base encoder (transformers ``BertModel``) from a config with random weights: no download.

Input: ``input_ids`` (batch, 128) int64 in [0, 30522). Output: the last hidden state (batch, 128, 768) float32.
Needs the ``transformers`` package (``pip install 'tctune[recipes]'``).
"""
import torch

SEQ_LEN = 128


class BertEncoder(torch.nn.Module):
    """Returns the last hidden state as a plain tensor (the encoder output the tuner compares)."""

    def __init__(self, bert):
        super().__init__()
        self.bert = bert

    def forward(self, input_ids):
        return self.bert(input_ids=input_ids).last_hidden_state


def build_model() -> torch.nn.Module:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig()  # bert-base-uncased sizes: 12 layers, hidden 768, 12 heads, vocab 30522
    return BertEncoder(BertModel(config, add_pooling_layer=False))


def example_inputs(batch_size: int):
    return (torch.randint(0, 30522, (batch_size, SEQ_LEN)),)


def example_targets(batch_size: int):
    """Regression targets for ``--mode train``: (batch, 128, 768) float32, fresh random data."""
    return torch.randn(batch_size, SEQ_LEN, 768)


def loss_fn(output, targets):
    """A fine-tuning step's shape of work: forward, a loss over the encoder output, backward, optimizer step.

    (MSE to random targets: the same kernels as fine-tuning with a head, without a labelled dataset.)
    """
    return torch.nn.functional.mse_loss(output, targets)
