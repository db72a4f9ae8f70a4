"""A small CNN trained on scikit-learn's handwritten digits: a model with trained weights and a task metric.

Data: ``sklearn.datasets.load_digits`` (1,797 grey 8x8 images of the digits 0-9, pixel values 0..16, shipped
inside the scikit-learn package: nothing is downloaded). Pixels are scaled to [0, 1] (divided by 16). The
split is a seeded random permutation (``SPLIT_SEED``): the last ``TEST_SIZE`` (360, 20 %) images are the test
set, the rest (1,437) the training set.

Model: conv 1->16 3x3 pad 1, ReLU, conv 16->32 3x3 pad 1, ReLU, max-pool 2, flatten (32*4*4 = 512),
``fc1`` 512->128, ReLU, ``fc2`` 128->64, ReLU, ``head`` 64->10. ``fc1`` and ``fc2`` are FP8-eligible for
tctune (K and N multiples of 16); ``head`` (N = 10) is not. The forward casts its input to the dtype of the
first convolution's weight, so a ``model.to(torch.bfloat16)`` copy accepts the same FP32 images.

Functions (tctune's model-file contract):

- ``build_model()``: the trained model in ``eval()`` mode on the CPU. Trained here with a fixed seed (AdamW,
  ``TRAIN["epochs"]`` epochs of batch ``TRAIN["batch"]``: 345 steps of about 15 ms on one CPU core, measured, so
  about 5 s; one thread, whatever the machine) on first use; the trained
  ``state_dict`` is cached as ``digits_cnn-<hash of TRAIN and the split>.safetensors`` in ``$TCTUNE_CACHE_DIR``
  (default ``~/.cache/tctune``), so later calls load it (well under a second).
- ``example_inputs(batch_size)``: ``(x,)``, x ``(batch_size, 1, 8, 8)`` float32, fresh uniform [0, 1) noise.
- ``calibration_inputs()``: ``CALIBRATION_BATCHES`` real training batches ``(x,)``, x ``(64, 1, 8, 8)`` float32.
- ``score(model)``: test-set top-1 accuracy, a float in [0, 1] (0.972 for the trained FP32 model on the CPU).
- ``example_targets(batch_size)`` / ``loss_fn(output, targets)``: int64 class ids and cross-entropy.

Output of the model: ``(batch, 10)`` logits, float32 for the FP32 model.
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

import torch
import torch.nn as nn

#: Seed of the train/test permutation, and the number of test images (20 % of 1,797).
SPLIT_SEED = 0
TEST_SIZE = 360
#: Training settings; any change gives a new cache key (and a retrained model).
TRAIN = {"seed": 0, "epochs": 15, "batch": 64, "lr": 2e-3, "weight_decay": 1e-4}
#: Real batches ``calibration_inputs()`` yields, of ``CALIBRATION_BATCH`` training images each.
CALIBRATION_BATCHES = 4
CALIBRATION_BATCH = 64
#: Images per forward pass in ``score``.
SCORE_BATCH = 512
#: Bumped when the model or data code changes in a way the settings above do not show.
VERSION = 1


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions, a 2x2 max-pool and three linears; (batch, 1, 8, 8) -> (batch, 10) logits."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(32 * 4 * 4, 128)
        self.fc2 = nn.Linear(128, 64)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        x = x.to(self.conv1.weight.dtype)  # FP32 images into a low-precision copy too
        x = torch.relu(self.conv1(x))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.relu(self.fc1(x.flatten(1)))
        x = torch.relu(self.fc2(x))
        return self.head(x)


def load_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train, y_train, x_test, y_test)``: images ``(n, 1, 8, 8)`` float32 in [0, 1], labels ``(n,)`` int64.

    Raises:
        ImportError: scikit-learn is missing (the message names the install command).
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ImportError("recipes/digits_cnn.py needs scikit-learn for its data: pip install scikit-learn "
                          "(or pip install 'tctune[recipes]')") from exc
    digits = load_digits()
    x = torch.as_tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.as_tensor(digits.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(SPLIT_SEED))
    train, test = perm[:-TEST_SIZE], perm[-TEST_SIZE:]
    return x[train], y[train], x[test], y[test]


def cache_path() -> Path:
    """Where the trained ``state_dict`` is cached: keyed by a hash of the training settings and the split."""
    key = json.dumps({"train": TRAIN, "split": [SPLIT_SEED, TEST_SIZE], "version": VERSION}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = Path(os.environ.get("TCTUNE_CACHE_DIR") or Path.home() / ".cache" / "tctune").expanduser()
    return root / f"digits_cnn-{digest}.safetensors"


def train(settings: dict | None = None) -> DigitsCNN:
    """Train a :class:`DigitsCNN` on the CPU from scratch (deterministic for fixed ``settings``; default ``TRAIN``)."""
    s = dict(TRAIN, **(settings or {}))
    x, y, _, _ = load_data()
    threads = torch.get_num_threads()
    # One thread: the same reduction order on every machine, and no oversubscription on a busy CPU (these
    # kernels are far too small to gain from threads: about 15 ms per step on one core).
    torch.set_num_threads(1)
    try:
        torch.manual_seed(s["seed"])
        model = DigitsCNN()
        opt = torch.optim.AdamW(model.parameters(), lr=s["lr"], weight_decay=s["weight_decay"])
        gen = torch.Generator().manual_seed(s["seed"])
        model.train()
        for _ in range(s["epochs"]):
            for idx in torch.randperm(len(y), generator=gen).split(s["batch"]):
                loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
    finally:
        torch.set_num_threads(threads)
    return model.eval()


def build_model() -> nn.Module:
    """The trained model (``eval()``, FP32, CPU): loaded from the cache, or trained and cached (see above)."""
    from safetensors.torch import load_file, save_file

    path = cache_path()
    model = DigitsCNN()
    if path.is_file():
        model.load_state_dict(load_file(str(path)))
        return model.eval()
    model = train()
    _save(save_file, {k: v.contiguous() for k, v in model.state_dict().items()}, path)
    return model


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


def example_inputs(batch_size: int):
    return (torch.rand(batch_size, 1, 8, 8),)


def example_targets(batch_size: int):
    return torch.randint(0, 10, (batch_size,))


def loss_fn(output, targets):
    return nn.functional.cross_entropy(output, targets)


def calibration_inputs():
    """``CALIBRATION_BATCHES`` tuples ``(x,)`` of real training images, x ``(64, 1, 8, 8)`` float32 in [0, 1]."""
    x, _, _, _ = load_data()
    for i in range(CALIBRATION_BATCHES):
        yield (x[i * CALIBRATION_BATCH:(i + 1) * CALIBRATION_BATCH],)


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
    raise TypeError(f"cannot find logits in a model output of type {type(out).__name__}: return the (batch, 10) "
                    "logits tensor")


def predict(model, x: torch.Tensor) -> torch.Tensor:
    """Logits ``(n, 10)`` float32 on the CPU for images ``x`` (n, 1, 8, 8) float32, fed in ``SCORE_BATCH`` chunks
    on :func:`model_device` (the model as given: any dtype, any wrapper)."""
    device = model_device(model)
    outs = []
    with torch.inference_mode():
        for chunk in x.split(SCORE_BATCH):
            outs.append(logits_of(model(chunk.to(device))).float().cpu())
    return torch.cat(outs)


def score(model) -> float:
    """Top-1 accuracy of ``model`` on the ``TEST_SIZE`` test images, in [0, 1] (higher is better)."""
    _, _, x, y = load_data()
    return float((predict(model, x).argmax(-1) == y).float().mean())
