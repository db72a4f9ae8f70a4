"""A BERT-style encoder trained on a synthetic counting task: a transformer with trained weights and a task metric.

Task ("more A than B"): a sequence of ``seq_len`` token ids is ``[CLS]`` followed by tokens ``A``, ``B`` and
filler tokens in random order; the label is 1 when it holds more ``A`` than ``B`` and 0 when fewer (never a
tie). The counts are drawn so that counting one token alone does not answer it: ``n_B`` uniform in
``count_range``, ``|n_A - n_B|`` uniform in 1..``max_diff``, labels exactly balanced. The classifier sees the
``[CLS]`` position only (BERT's pooler), so attention must gather the counts from the whole sequence: chance
is 50 %; the differences of 1 are the hard cases. (On the CPU, the base task at hidden 64 and 2 layers reached
96.3 % after 100 steps of batch 64 and 99.2 % after 300; the base size itself 97.3 % after 150 steps of batch 32;
``tiny`` reaches 100 % in its 200 steps. The base size at peak lr 1e-3 and batch 128 -- its former settings --
scored 0.587 after its 800 steps on an H200: see ``lr`` below.) Sequences
come from a seeded ``torch.Generator``: the training stream (``TRAIN_SEED``), the held-out set
(``TEST_SEED``, ``TEST_SIZE`` sequences) and the calibration batches (``CALIBRATION_SEED``) never share a seed.

Model: ``transformers`` ``BertForSequenceClassification`` from a ``BertConfig`` (no download, no dropout),
wrapped so that ``forward(input_ids)`` returns the ``(batch, 2)`` logits tensor. Sizes (``SIZES``), chosen by
the environment variable ``TCTUNE_SEQ_ENCODER_SIZE`` (default ``base``) when the module is imported:

- ``base``: seq_len 128, hidden 256, 4 layers, 4 heads, FFN 1024, vocab 32 (3.27 M parameters); trained
  ``steps`` = 800 AdamW steps of batch 128 in FP32 at peak lr 3e-4 (80 warm-up steps, gradient norm clipped
  to 1) -- estimated at well under a minute on one H200 (``benchmarks/trained.py`` records the measured time
  as ``build_s``), about 6 s a step on one busy CPU core. Peak lr 1e-3 is too high for this post-LN encoder at
  batch 128: on the CPU its gradient norm reached 21 (before clipping) by step 25 while lr 3e-4's stayed
  near 1, and on an H200 the 800-step training ended at 0.587 held-out accuracy.
- ``tiny``: seq_len 32, hidden 64, 2 layers, 2 heads, FFN 128; 200 steps of batch 64, 10-30 s on one CPU
  core (the CPU tests and ``benchmarks/trained.py --tiny``).

Every linear of the encoder has K and N multiples of 16 (FP8-eligible for tctune); the classifier (N = 2)
does not.

Functions (tctune's model-file contract):

- ``build_model()``: the trained model (``eval()``, FP32) on the GPU when there is one, else the CPU. Trained
  on that device on first use, refused with ``TrainingFailedError`` (and not cached) when its held-out accuracy
  is below ``MIN_ACCURACY`` = 0.9 (seeded data, init and order: deterministic on the CPU; on a GPU the CUDA
  kernels of the backward pass may add atomics' nondeterminism) and cached as
  ``seq_encoder-<size>-<hash of the size's settings>.safetensors`` in ``$TCTUNE_CACHE_DIR`` (default
  ``~/.cache/tctune``); later calls load it.
- ``example_inputs(batch_size)``: ``(input_ids,)``, ``(batch_size, seq_len)`` int64, fresh task sequences.
- ``calibration_inputs()``: ``CALIBRATION_BATCHES`` batches ``(input_ids,)`` of ``(64, seq_len)`` int64.
- ``score(model)``: accuracy on the ``TEST_SIZE`` held-out sequences, a float in [0, 1].
- ``example_targets(batch_size)`` / ``loss_fn(output, targets)``: int64 labels and cross-entropy.
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

import torch
import torch.nn as nn

#: Token ids: ``PAD`` (unused: every sequence is full length), ``CLS`` at position 0, the counted ``A`` and
#: ``B``, and fillers ``FILLER..vocab-1``.
PAD, CLS, A, B, FILLER = 0, 1, 2, 3, 4

SIZES = {
    "base": {"seq_len": 128, "hidden": 256, "layers": 4, "heads": 4, "ffn": 1024, "vocab": 32,
             "count_range": (8, 40), "max_diff": 8,
             "steps": 800, "batch": 128, "lr": 3e-4, "warmup": 80, "weight_decay": 0.01, "seed": 0},
    "tiny": {"seq_len": 32, "hidden": 64, "layers": 2, "heads": 2, "ffn": 128, "vocab": 32,
             "count_range": (4, 10), "max_diff": 4,
             "steps": 200, "batch": 64, "lr": 2e-3, "warmup": 20, "weight_decay": 0.01, "seed": 0},
}
#: The size this module builds (``TCTUNE_SEQ_ENCODER_SIZE``, read at import).
SIZE = os.environ.get("TCTUNE_SEQ_ENCODER_SIZE", "base")
if SIZE not in SIZES:
    raise ValueError(f"TCTUNE_SEQ_ENCODER_SIZE={SIZE!r} is not a size of recipes/seq_encoder.py; "
                     f"set it to one of {', '.join(SIZES)}")

TRAIN_SEED, TEST_SEED, CALIBRATION_SEED, EXAMPLE_SEED_BASE = 1, 2, 3, 4
TEST_SIZE = 2048
CALIBRATION_BATCHES = 4
CALIBRATION_BATCH = 64
SCORE_BATCH = 512
#: Bumped when the model, data or training code changes in a way ``SIZES`` does not show.
VERSION = 2
#: Chance accuracy of the task (two exactly balanced classes).
CHANCE = 0.5
#: :func:`build_model` refuses a freshly trained model whose held-out accuracy is below this (a training that
#: diverged or collapsed to a constant prediction scores about ``CHANCE``).
MIN_ACCURACY = 0.9


class TrainingFailedError(RuntimeError):
    """A freshly trained model scored below :data:`MIN_ACCURACY` on the held-out set (its weights are not cached)."""


def make_batch(n: int, generator: torch.Generator, size: str | dict = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` task sequences and their labels from ``generator`` (CPU): ``(ids (n, seq_len) int64, labels (n,)
    int64)``. Labels are exactly balanced for even ``n`` (one more 0 for odd ``n``), in random order.

    Raises:
        ValueError: the size's counts do not fit in ``seq_len - 1`` positions.
    """
    s = _settings(size)
    L, (lo, hi), dmax = s["seq_len"], s["count_range"], s["max_diff"]
    if 2 * hi + dmax > L - 1 or lo < dmax:
        raise ValueError(f"count_range {lo, hi} with max_diff {dmax} does not fit seq_len {L} (need "
                         f"2*hi + max_diff <= seq_len - 1 and lo >= max_diff)")
    labels = (torch.arange(n) % 2)[torch.randperm(n, generator=generator)]
    n_b = torch.randint(lo, hi + 1, (n,), generator=generator)
    diff = torch.randint(1, dmax + 1, (n,), generator=generator)
    n_a = torch.where(labels == 1, n_b + diff, n_b - diff)
    body = torch.randint(FILLER, s["vocab"], (n, L - 1), generator=generator)
    pos = torch.arange(L - 1)
    body = torch.where(pos < n_a[:, None], A, torch.where(pos < (n_a + n_b)[:, None], B, body))
    order = torch.rand(n, L - 1, generator=generator).argsort(dim=1)  # shuffle each row
    body = body.gather(1, order)
    ids = torch.cat([torch.full((n, 1), CLS), body], dim=1)
    return ids, labels


def _settings(size) -> dict:
    if isinstance(size, dict):
        return size
    return SIZES[size or SIZE]


class SeqClassifier(nn.Module):
    """``BertForSequenceClassification`` returning its ``(batch, 2)`` logits as a plain tensor."""

    def __init__(self, bert):
        super().__init__()
        self.bert = bert

    def forward(self, input_ids):
        return self.bert(input_ids=input_ids).logits


def make_model(size: str | dict = None) -> SeqClassifier:
    """An untrained classifier of ``size`` (a ``SIZES`` name or dict; default ``SIZE``), seeded with its ``seed``.

    Raises:
        ImportError: ``transformers`` is missing (the message names the install command).
    """
    try:
        from transformers import BertConfig, BertForSequenceClassification
    except ImportError as exc:
        raise ImportError("recipes/seq_encoder.py needs transformers: pip install 'tctune[recipes]'") from exc
    s = _settings(size)
    config = BertConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                        num_attention_heads=s["heads"], intermediate_size=s["ffn"],
                        max_position_embeddings=s["seq_len"], type_vocab_size=1, num_labels=2,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=PAD)
    torch.manual_seed(s["seed"])
    return SeqClassifier(BertForSequenceClassification(config))


def train(size: str | dict = None, steps: int | None = None, device: str | torch.device = "cpu") -> SeqClassifier:
    """Train a fresh model of ``size`` for ``steps`` (default: the size's) AdamW steps on fresh task batches
    from ``TRAIN_SEED`` (linear warm-up, then linear decay to 0), on ``device``; returns it in ``eval()`` mode."""
    s = _settings(size)
    steps = s["steps"] if steps is None else steps
    device = torch.device(device)
    model = make_model(s).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=s["lr"], weight_decay=s["weight_decay"])
    warm = min(s["warmup"], max(1, steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min((i + 1) / warm, max(0.0, (steps - i) / max(1, steps - warm))))
    gen = torch.Generator().manual_seed(TRAIN_SEED)
    threads = torch.get_num_threads()
    if device.type == "cpu":  # same reduction order everywhere; small kernels gain nothing from threads
        torch.set_num_threads(1)
    try:
        for _ in range(steps):
            ids, labels = make_batch(s["batch"], gen, s)
            loss = nn.functional.cross_entropy(model(ids.to(device)), labels.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    finally:
        torch.set_num_threads(threads)
    return model.eval()


def cache_path(size: str | None = None) -> Path:
    """Where the trained ``state_dict`` of ``size`` is cached, keyed by a hash of its settings."""
    name = size or SIZE
    key = json.dumps({"settings": SIZES[name], "seeds": [TRAIN_SEED], "version": VERSION}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = Path(os.environ.get("TCTUNE_CACHE_DIR") or Path.home() / ".cache" / "tctune").expanduser()
    return root / f"seq_encoder-{name}-{digest}.safetensors"


def build_model() -> nn.Module:
    """The trained ``SIZE`` model (``eval()``, FP32) on CUDA when available, else the CPU: from the cache, or
    trained, checked (:func:`check_trained`) and cached.

    Raises:
        TrainingFailedError: a fresh training scored below :data:`MIN_ACCURACY` held-out accuracy (nothing is
            cached; the message names the setting to change).
    """
    from safetensors.torch import load_file, save_file

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = cache_path()
    if path.is_file():
        model = make_model()
        model.load_state_dict(load_file(str(path)))
        return model.to(device).eval()
    model = train(device=device)
    check_trained(model)
    _save(save_file, {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, path)
    return model


def check_trained(model, size: str | None = None) -> float:
    """The held-out accuracy (:func:`score` on ``size``'s test set, default ``SIZE``) of a freshly trained
    ``model``, in [0, 1].

    Raises:
        TrainingFailedError: the accuracy is below :data:`MIN_ACCURACY`: the training diverged, collapsed to a
            constant prediction or stopped too early. The message names the size's ``lr`` and ``steps``.
    """
    name = size or SIZE
    acc = accuracy(model, *test_set(name))
    if acc < MIN_ACCURACY:
        s = SIZES[name]
        raise TrainingFailedError(
            f"recipes/seq_encoder.py: the {name!r} model scored {acc:.4f} held-out accuracy after {s['steps']} "
            f"training steps (chance {CHANCE}, required {MIN_ACCURACY}): the training did not converge. Lower "
            f"SIZES[{name!r}]['lr'] (now {s['lr']:g}) or raise SIZES[{name!r}]['steps'] (now {s['steps']}); "
            "the weights were not cached")
    return acc


def _save(save_file, state: dict, path: Path) -> None:
    """Write ``state`` to ``path`` atomically (a concurrent reader sees no file or the whole file); a cache that
    cannot be written only costs the next call a retraining, so that is a warning, not an error."""
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(state, str(tmp))
        os.replace(tmp, path)
    except OSError as exc:
        warnings.warn(f"cannot cache the trained weights in {path.parent} ({exc.strerror or exc}); set "
                      "TCTUNE_CACHE_DIR to a writable folder to train only once", stacklevel=3)


_example_calls = 0


def example_inputs(batch_size: int):
    """``(input_ids,)`` of fresh task sequences: each call draws new ones (seeded per call, from
    ``EXAMPLE_SEED_BASE``)."""
    global _example_calls
    _example_calls += 1
    gen = torch.Generator().manual_seed(EXAMPLE_SEED_BASE * 1_000_003 + _example_calls)
    return (make_batch(batch_size, gen)[0],)


def example_targets(batch_size: int):
    return torch.randint(0, 2, (batch_size,))


def loss_fn(output, targets):
    return nn.functional.cross_entropy(output, targets)


def calibration_inputs():
    """``CALIBRATION_BATCHES`` tuples ``(input_ids,)``, ``(64, seq_len)`` int64, from ``CALIBRATION_SEED``."""
    gen = torch.Generator().manual_seed(CALIBRATION_SEED)
    for _ in range(CALIBRATION_BATCHES):
        yield (make_batch(CALIBRATION_BATCH, gen)[0],)


def test_set(size: str | dict = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The held-out ``(ids (TEST_SIZE, seq_len) int64, labels (TEST_SIZE,) int64)`` from ``TEST_SEED``."""
    return make_batch(TEST_SIZE, torch.Generator().manual_seed(TEST_SEED), size)


def model_device(model) -> torch.device:
    """The device of ``model``'s first parameter or buffer; CUDA when it has none and a GPU is there, else CPU."""
    if isinstance(model, nn.Module):
        for t in (*model.parameters(), *model.buffers()):
            return t.device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def logits_of(out) -> torch.Tensor:
    """The logits tensor of a model output: the tensor itself, ``.logits``, or the first tensor of a tuple/list."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"cannot find logits in a model output of type {type(out).__name__}: return the (batch, 2) "
                    "logits tensor")


def predict(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits ``(n, 2)`` float32 on the CPU for ``ids`` ``(n, seq_len)`` int64, fed in ``SCORE_BATCH`` chunks on
    :func:`model_device` (the model as given: any dtype, any wrapper)."""
    device = model_device(model)
    outs = []
    with torch.inference_mode():
        for chunk in ids.split(SCORE_BATCH):
            outs.append(logits_of(model(chunk.to(device))).float().cpu())
    return torch.cat(outs)


def accuracy(model, ids: torch.Tensor, labels: torch.Tensor) -> float:
    """Top-1 accuracy of ``model`` on ``(ids, labels)``, in [0, 1]."""
    return float((predict(model, ids).argmax(-1) == labels).float().mean())


def score(model) -> float:
    """Accuracy of ``model`` on the held-out set (:func:`test_set`), in [0, 1] (higher is better)."""
    return accuracy(model, *test_set())
