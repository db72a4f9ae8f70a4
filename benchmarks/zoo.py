"""Model zoo: the tctune backend against Inductor on the public Hugging Face, TIMM and torchvision models.

Usage::

    python benchmarks/zoo.py --slice 1/8 --out $OUT/zoo --budget-s 560      # one ten-minute GPU call
    python benchmarks/zoo.py --gpus 0,1,2,3 --slice 1/2 --out $OUT/zoo --budget-s 560   # four models at a time
    python benchmarks/zoo.py --gpus 0 --jobs-per-gpu 4 --out $OUT/zoo --budget-s 540    # four sharing one GPU
    python benchmarks/zoo.py --models BertForMaskedLM,resnet50 --out DIR      # named models
    python benchmarks/zoo.py --merge DIR [DIR ...]                            # summary of every slice
    python benchmarks/zoo.py --list                                           # the model list, then exit
    python benchmarks/zoo.py --models BertForMaskedLM --tiny --device cpu --out /tmp/z   # CPU dry run

Models. The model names and default batch sizes of the Hugging Face and TIMM suites that the PyTorch compiler
team benchmarks ``torch.compile`` with (``benchmarks/dynamo/huggingface_models_list.txt`` and
``timm_models_list.txt`` of pytorch/pytorch, as stored in 2026), kept below as data (:data:`HF_MODELS`,
:data:`TIMM_MODELS`), plus six torchvision classifiers (:data:`TORCHVISION_MODELS`, batch sizes chosen here).
Every model has random weights; nothing is downloaded:

- Hugging Face: ``transformers``' config class with its defaults (:data:`HF_SPECS` names the config and model
  class; where the suite name is a hub checkpoint, the published configuration's sizes are written there as
  keyword arguments), ``use_cache=False``. Inputs: ``input_ids`` of shape (batch, seq), int64, uniform over the
  vocabulary; encoder-decoder models also get ``decoder_input_ids`` (batch, seq); Whisper gets
  ``input_features`` (batch, mel bins, 2 x max_source_positions) float32 N(0, 1) and ``decoder_input_ids``.
  ``seq`` = min(512, the longest sequence the config's position table holds) (``--seq`` changes 512): 512 for
  most, 128 for Blenderbot, 448 for Whisper's decoder, 510 for Roberta-style position tables (offset by
  ``pad_token_id + 1``). The model returns its first output tensor (logits, or start logits for question
  answering).
- TIMM: ``timm.create_model(name, pretrained=False)``, input (batch, *pretrained_cfg["input_size"]) N(0, 1).
- torchvision: ``torchvision.models.get_model(name, weights=None)``, input (batch, 3, 224, 224) N(0, 1).
- TIMM and torchvision: weights the constructor leaves all zero (a zero-initialised head, timm's
  ``zero_init_last`` BatchNorm scales) are re-drawn (:func:`redraw_zero_weights`, named in the row's ``note``),
  so the accuracy check compares outputs that depend on the input.

A model that cannot be built (class missing in this ``transformers``, package missing, weights larger than
``--max-memory-frac`` of the GPU for FP32 + dt copy + tctune's cast copy at 8 bytes per parameter, or any
exception) gets a row with ``status: not_built`` and the reason. ``--tiny`` builds every Hugging Face model at
tiny sizes (hidden 64, 2 layers, 4 heads, vocabulary 512; seq 32) for CPU tests and dry runs.

Variants (``--variants``), on the same seeded inputs, each in ``torch.no_grad``:

=================  ======================================================================================
``fp32_eager``     the FP32 model (TF32 off): the reference every error is taken against
``eager``          ``copy.deepcopy(model).to(dt)`` run eagerly (floating inputs cast to dt)
``eager_cg``       that, captured as one CUDA graph
``inductor``       ``torch.compile(model.to(dt))`` (Inductor, mode default)
``inductor_cg``    that compiled callable captured as one CUDA graph
``tctune``         ``torch.compile(fp32 model, backend="tctune", options={"precision": dt, "policy": "pure",
                   "output_dtype": "compute"})``: outputs left in dt, the contract of ``torch.compile(model.to(dt))``
                   it is compared with (:data:`TCTUNE_OUTPUT_DTYPE`; recorded as each row's ``output_dtype``)
``tctune_cg``      that compiled callable captured as one CUDA graph
``inductor_fp32in`` optional (``--variants +inductor_fp32in``): ``torch.compile`` of ``model.to(dt)`` behind the
                   cast of the floating inputs to dt, inside the compiled callable, handed the FP32 inputs
                   the tctune variant gets (:func:`cast_inputs_inside`). ``inductor`` is handed inputs
                   already in dt, cast outside the timing, while tctune casts its FP32 inputs inside its
                   graph: this variant prices that entry cast the same way on both sides. Timed
                   interleaved with ``inductor`` and ``tctune``; summarized as
                   ``speedup_vs_inductor_fp32in``; no CUDA-graph variant
``tctune_freezing`` optional (``--variants +tctune_freezing``): ``tctune`` with Inductor's ``freezing`` config on
                   (``options["inductor"] = {"freezing": True}``): Inductor treats the frozen weights as
                   constants (constant folding, weight layouts chosen at compile time). Timed interleaved with
                   ``inductor`` and ``tctune``; summarized as ``speedup_freezing_vs_inductor``
``inductor_freezing`` optional (``--variants +inductor_freezing``): ``torch.compile(model.to(dt),
                   options={"freezing": True})``, the same lever on the plain side; summarized as
                   ``speedup_freezing_vs_inductor_freezing`` (tctune_freezing over it)
``inductor_again`` optional (``--variants +inductor_again``): ``inductor`` compiled a second time, on its own copy
                   of the dt model in a fresh cache, through a backend function that calls Inductor's
                   ``compile_fx`` as ``torch.compile``'s own Inductor backend does (:func:`inductor_anew`; with
                   ``backend="inductor"`` again Dynamo would reuse the first compile's cache entry): the same
                   graph, so its ratio to ``inductor`` is the compile-to-compile spread of this method (Triton's
                   run-time autotuning of each compile, allocation). Summarized as ``inductor_again_vs_inductor``
``tctune_lowtrace`` optional (``--variants +tctune_lowtrace``): the backend on ``model.to(dt)`` handed dt inputs,
                   so Dynamo traces the dt model as it does for ``inductor``, with tctune's options: against
                   ``tctune`` it isolates what tracing the FP32 model and casting it costs. Summarized as
                   ``speedup_lowtrace_vs_inductor``
``tctune_fp32``    optional (``--variants +tctune_fp32``; one more compile per model, so not in the default):
                   ``torch.compile(fp32 model, backend="tctune", options=parity_options(dt))``: every structural
                   pass of the backend's default pipeline as it plans at dt (padding to dt's alignment), the
                   cast passes left out, so the graph computes in FP32 (:func:`parity_options`). Run last,
                   after a Dynamo reset; not timed
=================  ======================================================================================

FP32 parity (``tctune_fp32``). The accuracy rule below compares bf16 errors, and bf16 noise on random weights
hides an FP32-level error of a wrong rewrite (fuse_qkv on Longformer's ``as_strided`` chunks: 2.2e-2 at FP32).
``tctune_fp32`` is compared with ``fp32_eager`` on every output (:func:`parity_error`: max |out - ref| / max
|ref| per floating output, other outputs exactly) and recorded as ``fp32_parity_rel_err`` in the variant (above
:data:`FP32_PARITY_TOL`, also FP32 eager's own distance from a float64 run, ``fp32_rounding_err``, and the
limit it allows, :func:`parity_limit`), with
``row["tctune_fp32"]`` giving the rewrites per pass (``fired``) and fallbacks; the summary counts the models
over their limit (``fp32_parity_over_tol``). tests/test_zoo_parity.py runs the same check on the CPU
at ``--tiny`` sizes, executing the rewritten graphs without Inductor.

CUDA graphs: both sides are captured the same way, by this script (``torch.cuda.CUDAGraph`` around one call of
the compiled callable after three warm-up calls on a side stream; each replay first copies the inputs into the
static input tensors, and that copy is timed). One capture's replay time can differ from another capture's of
the same callable (where the capture's memory pool places the buffers), so ``--cg-captures K`` (default 3)
captures both sides K times: capture k of both, timed interleaved (the side captured first alternates with k),
then released before capture k + 1. A CUDA-graph variant's ``ms`` is the median of its K per-capture medians
(``captures_ms`` lists them, ``repeats_ms`` every repeat of every capture). Inductor's ``mode="reduce-overhead"`` is not used, because the
tctune backend ignores ``mode``: the same capture on both sides compares like with like. CUDA-graph variants
need a CUDA device (on the CPU they are recorded as skipped).

Measurement: compile seconds = wall time of the first call (Dynamo, the backend and kernel compilation; for
eager variants it is the first call). The tctune backend is compiled before Inductor, and each of the two
compiles runs inside its own fresh Inductor / Triton cache (``torch._inductor.utils.fresh_cache``: new cache
folders, in-memory code caches cleared; ``compile_cache`` in the row), so Inductor's compile cannot reuse the
Triton kernels tctune's compile built moments before (with one shared cache it did: kernels of identical source
are compiled once per process). The one-off costs of a process's first Inductor compile (starting Inductor's
compile worker pool, Triton and C++ toolchain checks) are paid before either, by compiling a tiny unrelated
function and waiting until the worker pool answers (``warm_compile_s``, ``warm_pool`` in the row): charged to
the first compile they were part of tctune's compile seconds (CPU, tiny DistilBERT: the process's first compile
of either side took about twice as long as the same compile second; benchmarks/NOTES.md, "where the backend's
compile time goes"; Inductor compiles kernels in the main process, one at a time, until its pool is ready).
Each model runs in its own process with fresh Inductor and Triton cache folders (``--warm-cache`` keeps the
user's, and then the two sides also share one cache). Throughput:
items (sequences or images) per second = batch / median ms per call; a repeat is ``iters`` calls timed with
CUDA events (``time.perf_counter`` on the CPU), ``iters`` chosen so a repeat lasts about ``--repeat-s``
seconds after two warm-up calls; ``--repeats`` repeats (default 5). Inductor and tctune are timed interleaved:
repeat r times Inductor then tctune, repeat r + 1 tctune then Inductor (likewise for the two CUDA-graph
variants). Error: relative L2 of the output against ``fp32_eager``'s, in float64 (non-finite values counted).
Fallbacks: the reason of every ``tctune.backend.reports`` entry whose ``fallback`` is set (one entry per Dynamo
subgraph the backend compiled).

``tctune optimize`` (``--optimize NAMES``, or ``default`` for :data:`OPTIMIZE_DEFAULT`): in its own process
after the variants, ``tctune.optimize(model_file, TuneConfig(batch_sizes=(batch,), trials=--optimize-trials,
timeout_s=--optimize-budget-s, export=False))`` on a generated model file (``build_model`` /
``example_inputs`` of this zoo entry), then ``report.json`` is read. ``optimize_speedup_vs_best_baseline`` =
the report's ``best.speedup_vs_best_baseline`` where the report names its ``best_baseline`` (the best trial and
the fastest plain baseline at its batch size timed side by side after the search: the number ``report.md``
gives), else the best trial's throughput / the fastest feasible *model-as-written* trial (``graph_passes``
false: FP32 eager and the plain low-precision runtimes the search enqueues) at the same batch size, both first
timings from that report (kept as ``speedup_vs_best_baseline_first_timings`` beside the report's number);
``optimize_speedup_vs_fp32_eager`` is the report's ``best.speedup_vs_fp32_eager`` (older reports:
``best.speedup_vs_best_baseline``, whose baseline was FP32 eager), or, when the report lacks both, computed from the report's ``baselines`` at the same batch size (the row
then says so in ``optimize_speedup_source``).

Output: every model writes ``OUT/rows/NAME.json`` (and ``NAME.optimize.json``) after each variant, so a killed
model keeps what it finished. ``--merge DIR...`` reads every row under the folders (the newest ``ok`` row wins
for a model measured twice), writes ``--merge-out`` (default ``benchmarks/results/zoo/latest.json``)::

    {"device", "date", "torch", "dtype", "models": {NAME: {"suite", "batch_size", "dtype", "output_dtype", "status",
     "tctune_ok", "fallbacks", "speedup_vs_inductor", "speedup_vs_inductor_cg", "accuracy_consistent",
     "rel_err", "eager_rel_err", "inductor_rel_err", "compile_s", "inductor_compile_s",
     "optimize_speedup_vs_best_baseline", "fp32_parity_rel_err", "fp32_parity_ok", ...}}}

and prints a markdown table for benchmarks/RESULTS.md. ``tctune_ok``: the tctune variant ran and none of its
subgraphs fell back. ``accuracy_consistent``: tctune's relative error <= 2 x that of ``model.to(dt)`` eager +
1e-3. ``speedup_vs_inductor``: tctune items/s / Inductor items/s, without CUDA graphs (``_cg``: both with).

Time limits: ``--model-timeout`` s per model process (killed with its process group after that; the row is
kept as ``timeout`` with the variant that was running), ``--budget-s`` for the whole call: no model is
started with less than ``--min-model-s`` left, and each gets at most what is left minus 10 s; the models not
started are written as ``skipped`` rows and listed with a ``--models`` line that runs them.

Order and size limit. Without ``--models`` the selection (after ``--slice``, which is taken on the list order)
runs smallest first by parameter count (``--order size``; from a meta-device build, no memory), so a call that
runs out of ``--budget-s`` leaves the largest models for later; ``--models`` keeps the given order unless
``--order size`` is passed. ``--max-params N`` writes every model above N parameters as ``skipped`` with the
reason (default: no limit).

Slots, sharing a GPU. ``--gpus 0,1,..`` lists one slot per entry, and a GPU may be listed several times
(``--gpus 0,0,0,0``), or ``--jobs-per-gpu N`` repeats every listed GPU N times (``cuda`` without ``--gpus``
means GPU 0). One model process runs per slot (``CUDA_VISIBLE_DEVICES`` set to the slot's GPU; Inductor's
compile threads, ``TORCHINDUCTOR_COMPILE_THREADS``, divided among all slots). Processes on one GPU build and
compile at the same time, but every timed section (each throughput timing of :func:`time_interleaved`, its
warm-up and calibration calls included: eager, compiled and CUDA-graph replays alike) holds an exclusive
``fcntl.flock`` on ``OUT/.gpu-<id>.lock``, so no two processes on one GPU time at once. Each row records the
seconds it waited for that lock (``gpu_lock.wait_s``) and ``procs_per_gpu``. What the lock does not remove: a
process that is building, compiling or running a first call uses the GPU and the host CPU while another one
times, so launch-bound variants without CUDA graphs can time slower (the CUDA-graph variants far less). Compile
seconds are wall time under the contention of ``procs_per_gpu`` concurrent processes (and the divided compile
threads); tctune's and Inductor's compile seconds of a model are compared with each other within one row (both
compiled with the same number of concurrent processes, though the momentary load of the others varies), not
with rows of a call with another ``procs_per_gpu``. ``--lock-compiles`` puts each variant's compile and first call
under the same lock (``lock_compiles`` in the row): builds still overlap, compiles and timings no longer do
(:data:`NOISY_SPREAD` says why that matters). A ``tctune optimize``
job holds its GPU's lock for its whole search (its trials compile and time inside it; ``gpu_lock_wait_s``).

Memory guard. A model does not start on a GPU while the estimates of the models running there plus its own exceed
``--max-memory-frac`` (0.8) of the GPU's memory (read with NVML, else ``nvidia-smi``; when it cannot be read,
models run one at a time per GPU). The estimate (:func:`memory_need`): 1 GiB (CUDA context, workspaces) +
``BYTES_PER_PARAM`` (8) x parameters + 2 x the peak of live activation bytes of one FP32 eager forward at the
zoo batch on the meta device (the FP32 reference output and the two CUDA-graph memory pools stay alive); when
that meta forward fails (data-dependent ops such as the attention-mask checks of Hugging Face decoders), the
activations are taken as 4 x parameters bytes (at least 4 GiB) + 3 x the FP32 bytes of the batch's language-model
logits (batch x decoder sequence x vocabulary) for Hugging Face models.
A model whose estimate is unknown runs alone on its GPU. Each row records the estimate
(``memory_estimate_gib``) and, on CUDA, ``torch.cuda.max_memory_allocated`` (``max_memory_allocated_gib``).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as _dt
import fcntl
import glob
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

_T0 = time.perf_counter()
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tctune and passes, when tctune is not installed
DEFAULT_MERGE_OUT = ROOT / "benchmarks" / "results" / "zoo" / "latest.json"

# ------------------------------------------------------------------------------------------------ model lists

#: pytorch/pytorch benchmarks/dynamo/huggingface_models_list.txt: suite name -> default batch size.
HF_MODELS: dict[str, int] = {
    "AlbertForMaskedLM": 8, "AlbertForQuestionAnswering": 8, "AllenaiLongformerBase": 8, "BartForCausalLM": 8,
    "BartForConditionalGeneration": 4, "BertForMaskedLM": 32, "BertForQuestionAnswering": 32,
    "BlenderbotForCausalLM": 32, "BlenderbotForConditionalGeneration": 16, "BlenderbotSmallForCausalLM": 256,
    "BlenderbotSmallForConditionalGeneration": 128, "CamemBert": 32, "DebertaV2ForMaskedLM": 8,
    "DebertaV2ForQuestionAnswering": 8, "DistilBertForMaskedLM": 256, "DistilBertForQuestionAnswering": 512,
    "DistillGPT2": 32, "ElectraForCausalLM": 64, "ElectraForQuestionAnswering": 128,
    "GPT2ForSequenceClassification": 8, "GPTJForCausalLM": 1, "GPTJForQuestionAnswering": 1,
    "GPTNeoForCausalLM": 32, "GPTNeoForSequenceClassification": 32, "GoogleFnet": 32, "LayoutLMForMaskedLM": 32,
    "LayoutLMForSequenceClassification": 32, "M2M100ForConditionalGeneration": 64, "MBartForCausalLM": 8,
    "MBartForConditionalGeneration": 4, "MT5ForConditionalGeneration": 32, "MegatronBertForCausalLM": 16,
    "MegatronBertForQuestionAnswering": 16, "MobileBertForMaskedLM": 256, "MobileBertForQuestionAnswering": 256,
    "OPTForCausalLM": 4, "PLBartForCausalLM": 16, "PLBartForConditionalGeneration": 8, "PegasusForCausalLM": 128,
    "PegasusForConditionalGeneration": 64, "RobertaForCausalLM": 32, "RobertaForQuestionAnswering": 32,
    "T5ForConditionalGeneration": 8, "T5Small": 8, "TrOCRForCausalLM": 64, "XGLMForCausalLM": 32,
    "XLNetLMHeadModel": 16, "YituTechConvBert": 32, "meta-llama/Llama-3.2-1B": 8, "google/gemma-2-2b": 8,
    "google/gemma-3-4b-it": 8, "openai/whisper-tiny": 8, "Qwen/Qwen3-0.6B": 8,
    "mistralai/Mistral-7B-Instruct-v0.3": 8, "openai/gpt-oss-20b": 8,
}

#: pytorch/pytorch benchmarks/dynamo/timm_models_list.txt: timm model name -> default batch size.
TIMM_MODELS: dict[str, int] = {
    "adv_inception_v3": 128, "beit_base_patch16_224": 128, "convnextv2_nano.fcmae_ft_in22k_in1k": 128,
    "deit_base_distilled_patch16_224": 128, "deit_tiny_patch16_224.fb_in1k": 128, "dm_nfnet_f0": 128,
    "ghostnet_100": 512, "inception_v3": 128, "mobilenetv2_100": 128, "mobilenetv3_large_100": 512,
    "mobilevit_s": 128, "nfnet_l0": 128, "repvgg_a2": 128, "swin_base_patch4_window7_224": 128,
    "tf_efficientnet_b0": 128, "visformer_small": 128, "vit_base_patch14_dinov2.lvd142m": 128,
    "vit_base_patch16_siglip_256": 128,
}

#: torchvision classifiers (not in the dynamo suites; batch sizes chosen here: 128 for ~4 GFLOP/image CNNs,
#: 256 for the mobile ones, 64 for the ViT / Swin transformers).
TORCHVISION_MODELS: dict[str, int] = {
    "resnet50": 128, "mobilenet_v3_large": 256, "efficientnet_b0": 128, "convnext_tiny": 128, "vit_b_16": 64,
    "swin_t": 64,
}

#: Self-test entries (never in the default list; only by name in --models): a small MLP, and one whose build
#: sleeps ZOO_TEST_SLEEP_S seconds (default 600), for the runner's timeout path.
TEST_MODELS: dict[str, int] = {"zoo_test_mlp": 4, "zoo_test_sleep": 1}

#: Hugging Face suite name -> (config class, model class, config keyword arguments). Keyword arguments are the
#: published configuration's sizes where the suite name is a hub checkpoint (nothing is downloaded).
HF_SPECS: dict[str, tuple[str, str, dict]] = {
    "AllenaiLongformerBase": ("LongformerConfig", "LongformerForMaskedLM",
                              {"max_position_embeddings": 4098, "attention_window": 512}),
    "CamemBert": ("CamembertConfig", "CamembertForMaskedLM", {"vocab_size": 32005, "max_position_embeddings": 514}),
    "DistillGPT2": ("GPT2Config", "GPT2LMHeadModel", {"n_layer": 6}),
    "GoogleFnet": ("FNetConfig", "FNetForMaskedLM", {}),
    "T5Small": ("T5Config", "T5ForConditionalGeneration", {}),
    "YituTechConvBert": ("ConvBertConfig", "ConvBertForMaskedLM", {}),
    "GPT2ForSequenceClassification": ("GPT2Config", "GPT2ForSequenceClassification", {"pad_token_id": 50256}),
    "GPTNeoForSequenceClassification": ("GPTNeoConfig", "GPTNeoForSequenceClassification", {"pad_token_id": 50256}),
    "XLNetLMHeadModel": ("XLNetConfig", "XLNetLMHeadModel", {"use_mems_eval": False}),
    "meta-llama/Llama-3.2-1B": ("LlamaConfig", "LlamaForCausalLM", {
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 131072,
        "tie_word_embeddings": True}),
    "google/gemma-2-2b": ("Gemma2Config", "Gemma2ForCausalLM", {}),
    "google/gemma-3-4b-it": ("Gemma3TextConfig", "Gemma3ForCausalLM", {  # the language model only, no vision tower
        "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 262208}),
    "openai/whisper-tiny": ("WhisperConfig", "WhisperForConditionalGeneration", {}),
    "Qwen/Qwen3-0.6B": ("Qwen3Config", "Qwen3ForCausalLM", {
        "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
        "tie_word_embeddings": True}),
    "mistralai/Mistral-7B-Instruct-v0.3": ("MistralConfig", "MistralForCausalLM", {"vocab_size": 32768}),
    "openai/gpt-oss-20b": ("GptOssConfig", "GptOssForCausalLM", {}),
}

#: Model classes whose suite name is the class name: config class = the prefix before "For"/"LMHead".
#: (Prefixes whose config class is spelled differently.)
_CONFIG_PREFIX = {"DebertaV2": "DebertaV2", "BlenderbotSmall": "BlenderbotSmall", "MegatronBert": "MegatronBert",
                  "MobileBert": "MobileBert", "LayoutLM": "LayoutLM", "M2M100": "M2M100", "MBart": "MBart",
                  "MT5": "MT5", "PLBart": "PLBart", "TrOCR": "TrOCR", "XGLM": "XGLM", "OPT": "OPT", "GPTJ": "GPTJ",
                  "GPTNeo": "GPTNeo"}

#: ``--optimize default``: one model of each kind the recipes cover (BERT, GPT-2, T5, ResNet-50, ViT).
OPTIMIZE_DEFAULT = ("BertForMaskedLM", "GPT2ForSequenceClassification", "T5Small", "resnet50", "vit_b_16")

VARIANTS = ("fp32_eager", "eager", "eager_cg", "inductor", "inductor_cg", "tctune", "tctune_cg")
#: Variants measured only when named in ``--variants`` (one more compile per model; see the module docstring).
OPTIONAL_VARIANTS = ("tctune_fp32", "inductor_fp32in", "tctune_freezing", "inductor_freezing", "inductor_again",
                     "tctune_lowtrace")
ALL_VARIANTS = VARIANTS + OPTIONAL_VARIANTS
#: FP32 parity limit of ``tctune_fp32``: max |tctune - FP32 eager| / max |FP32 eager| per floating output, or,
#: for a model whose FP32 eager output is itself far from a float64 run, :data:`FP32_ROUNDING_FACTOR` x that
#: distance (:func:`parity_limit`). Rewrites that keep the arithmetic (concatenated weights, zero padding, folded
#: masks, copies) change an FP32 output by rounding only; folding BN into conv weights rounds the folded weights
#: once more. Measured on the CPU by tests/test_zoo_parity.py (the backend's structural passes planned for
#: sm_90, the rewritten graph run eagerly, batch 2): the 55 tiny Hugging Face models at most 3.8e-7 (Gemma 3);
#: of the 24 TIMM / torchvision models at full size all but one at most 3.0e-6 (mobilenetv3_large_100, 46 BN
#: folds: FP32 eager is 2.2e-6 from float64 there, tctune's graph 1.4e-6). A wrong rewrite is far above:
#: fuse_qkv on Longformer's as_strided chunks (its refusal turned off) gave 3.9e-4 on the tiny Longformer on the
#: CPU and 2.2e-2 at full size.
FP32_PARITY_TOL = 1e-5
#: Above :data:`FP32_PARITY_TOL`, the limit is this many times FP32 eager's own distance from a float64 run of
#: the model (:func:`float64_distance`): two FP32 evaluations of one function, each within e of the exact value,
#: differ by at most 2e; 4 leaves tctune's rounding up to three times eager's. visformer_small (random weights,
#: 4 BN folds, CPU): FP32 eager 7.5e-6 from float64, tctune 1.1e-5, the two 1.08e-5 apart: rounding.
FP32_ROUNDING_FACTOR = 4.0
#: The tctune variant's output contract (the backend's ``output_dtype``): its baseline ``torch.compile(model.to(dt))``
#: returns dt outputs, so tctune's are left in dt too ("compute") instead of the backend's default FP32 up-cast.
#: Rows written before this key (no ``output_dtype`` in ``row["tctune"]["options"]``) ran the default, "fp32".
TCTUNE_OUTPUT_DTYPE = "compute"
DTYPES = ("bf16", "fp16")
#: Relative slack of the accuracy rule: tctune's error <= ACC_FACTOR x eager dt error + ACC_ABS.
ACC_FACTOR, ACC_ABS = 2.0, 1e-3
#: A compared variant whose median timed repeat is more than this many times its fastest (within one CUDA-graph
#: capture) was disturbed for most of its repeats, so its median is too: another model process's compile (Inductor
#: autotunes kernels on the GPU outside the timing lock) or a clock change. Seen on the H200 with three processes
#: per GPU: vit_b_16's tctune repeats read 7.0, 7.4, 10.3, 13.4, 13.7 ms, its median ratio 0.68x (results/zoo/
#: 2026-12-02-h200-regress13/). One or two slow repeats of five leave the median alone and are not flagged.
#: Such a row is flagged (``timing_noisy``, a dagger in the table); a merge still takes the newest row (an older
#: clean row may predate a fix).
NOISY_SPREAD = 1.1
#: The variants whose timings make the speedup columns.
COMPARED = ("tctune", "inductor", "tctune_cg", "inductor_cg")
#: Bytes per parameter a model needs on the GPU here: FP32 model + dt copy + tctune's dt cast of the weights.
BYTES_PER_PARAM = 8


@dataclass(frozen=True)
class Entry:
    """One zoo model: ``name`` (the suite's), ``suite`` (huggingface, timm, torchvision, test) and its default
    batch size (items per call)."""

    name: str
    suite: str
    batch_size: int


def all_entries(include_test: bool = False) -> dict[str, Entry]:
    """Every zoo entry by name, in list order (Hugging Face, TIMM, torchvision; test entries when asked)."""
    out: dict[str, Entry] = {}
    for suite, table in (("huggingface", HF_MODELS), ("timm", TIMM_MODELS), ("torchvision", TORCHVISION_MODELS)):
        for name, bs in table.items():
            out[name] = Entry(name, suite, bs)
    if include_test:
        for name, bs in TEST_MODELS.items():
            out[name] = Entry(name, "test", bs)
    return out


def parse_slice(text: str) -> tuple[int, int]:
    """``"i/n"`` -> (i, n) with 1 <= i <= n.

    Raises:
        ValueError: not two positive integers with i <= n.
    """
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--slice must look like 2/5 (slice i of n), got {text!r}") from None
    if not 1 <= i <= n:
        raise ValueError(f"--slice {text}: need 1 <= i <= n")
    return i, n


def select(models: str | None = None, slice_: str | None = None, suites: str | None = None) -> list[Entry]:
    """The entries to run: ``models`` (comma-separated names, test entries allowed) or the whole list filtered
    by ``suites`` (comma-separated), then slice i of n: every n-th entry from the i-th (round robin, so each
    slice mixes suites and costs about the same).

    Raises:
        ValueError: an unknown model or suite name, or a bad slice.
    """
    every = all_entries(include_test=True)
    if models:
        names = [m.strip() for m in models.split(",") if m.strip()]
        unknown = [m for m in names if m not in every]
        if unknown:
            raise ValueError(f"unknown model(s) {unknown}; see `python benchmarks/zoo.py --list`")
        chosen = [every[m] for m in names]
    else:
        chosen = [e for e in every.values() if e.suite != "test"]
        if suites:
            wanted = {s.strip() for s in suites.split(",")}
            bad = wanted - {"huggingface", "timm", "torchvision"}
            if bad:
                raise ValueError(f"unknown suite(s) {sorted(bad)}; choose from huggingface, timm, torchvision")
            chosen = [e for e in chosen if e.suite in wanted]
    if slice_:
        i, n = parse_slice(slice_)
        chosen = chosen[i - 1::n]
    return chosen


def scaled_batch(batch_size: int, scale: float) -> int:
    """``max(1, round(batch_size * scale))``."""
    return max(1, int(round(batch_size * scale)))


# ------------------------------------------------------------------------------------------------ building


class NotBuildable(Exception):
    """The model cannot be built here (missing class or package, too large); the message says why."""


@dataclass
class Built:
    """A built FP32 eval model and its input maker.

    Attributes:
        model: eval-mode module returning one tensor.
        make_inputs: ``(batch, device, seed) -> tuple of tensors`` (batch on dim 0).
        desc: the inputs in words (shapes and dtypes at batch B), for the row.
        params: parameter count.
        note: how the model was built (config, overrides).
        item_out_elems: elements per batch item of the largest output the model may return (Hugging Face: decoder
            sequence x vocabulary, the language-model logits); 0 when not known. Used by the memory estimate.
    """

    model: Any
    make_inputs: Callable[[int, Any, int], tuple]
    desc: str
    params: int = 0
    note: str = ""
    item_out_elems: int = 0


def _wrapper_class():
    import torch

    class HFFirstOutput(torch.nn.Module):
        """Calls a Hugging Face model with keyword inputs from positional tensors; returns its first output."""

        def __init__(self, model, names: tuple[str, ...]) -> None:
            super().__init__()
            self.model = model
            self.names = names

        def forward(self, *args):
            out = self.model(**dict(zip(self.names, args)))
            if isinstance(out, torch.Tensor):
                return out
            return out[0]

    return HFFirstOutput


def cast_inputs_inside(low_model, dt) -> Callable:
    """``low_model`` (already in ``dt``) behind a cast of its floating tensor inputs to ``dt``: called with the FP32
    inputs, it computes what ``low_model`` computes on ``x.to(dt)``; compiled whole, the cast is part of the
    compiled graph (Inductor fuses it into the first kernel that reads the input), as tctune's entry cast is."""
    import torch

    def call(*args):
        return low_model(*(a.to(dt) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args))
    return call


def place(model, device):
    """Move every tensor ``model`` holds onto ``device``, in place; returns ``model``.

    ``with torch.device(device):`` at construction does not reach every tensor: legacy constructors
    (``torch.FloatTensor(...)``, which XLNet's attention uses for its ``q``/``k``/``v``/``o``/``r`` weights) always
    allocate on the CPU, and a plain tensor attribute of a submodule (not a parameter or buffer) is skipped by
    ``Module.to``. So: ``Module.to(device)`` for parameters and buffers, then every tensor stored directly as a
    submodule attribute. ``device`` may be ``"meta"`` (no memory: the size estimates).
    """
    import torch

    model.to(device)
    for mod in model.modules():
        for key, value in list(vars(mod).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                moved = value.to(device)
                if moved is not value:
                    object.__setattr__(mod, key, moved)
    return model


def tensor_devices(model) -> dict[str, str]:
    """``{qualified name: device}`` of every tensor ``model`` holds: parameters, buffers and plain tensor
    attributes of its submodules (what :func:`place` moves)."""
    import torch

    out = {n: str(t.device) for n, t in model.named_parameters(remove_duplicate=False)}
    out.update({n: str(t.device) for n, t in model.named_buffers(remove_duplicate=False)})
    for prefix, mod in model.named_modules(remove_duplicate=False):
        for key, value in vars(mod).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                out[f"{prefix}.{key}" if prefix else key] = str(value.device)
    return out


#: ``--tiny`` sizes, applied to whichever of these attributes a config has.
TINY: dict[str, Any] = {
    "hidden_size": 64, "d_model": 64, "n_embd": 64,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "encoder_layers": 2, "decoder_layers": 2,
    "num_decoder_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
    "num_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 128, "d_ff": 128, "n_inner": 128, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
    "d_inner": 128, "ffn_dim": 128,
    "vocab_size": 512, "embedding_size": 32, "head_dim": 16, "d_kv": 16, "d_head": 16, "rotary_dim": 8,
    "intra_bottleneck_size": 64, "attention_window": 16, "max_source_positions": 16,
    "num_local_experts": 4, "num_experts_per_tok": 2,
    "dim": 64, "n_layers": 2, "n_heads": 4, "hidden_dim": 128,
}
TINY_SEQ = 32
_TOKEN_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
               "cls_token_id", "unk_token_id", "mask_token_id", "forced_bos_token_id", "forced_eos_token_id")


def hf_spec(name: str) -> tuple[str, str, dict]:
    """(config class, model class, config kwargs) of a Hugging Face suite entry."""
    if name in HF_SPECS:
        return HF_SPECS[name]
    for sep in ("For", "LMHead"):
        if sep in name:
            prefix = name.split(sep)[0]
            return f"{_CONFIG_PREFIX.get(prefix, prefix)}Config", name, {}
    raise NotBuildable(f"no config/model class mapping for {name!r}")


def tiny_kwargs(defaults: dict) -> dict:
    """The :data:`TINY` sizes for the attributes present in a config's ``to_dict()``; token ids moved below the
    tiny vocabulary; a per-layer ``attention_types`` list (GPT-Neo) resized to the tiny layer count."""
    kw = {k: v for k, v in TINY.items() if k in defaults}
    vocab = kw.get("vocab_size", defaults.get("vocab_size"))
    for k in _TOKEN_KEYS:
        v = defaults.get(k)
        if isinstance(v, int) and vocab is not None and v >= vocab:
            kw[k] = min(v, 3)
    if isinstance(defaults.get("attention_types"), list):
        layers = kw.get("num_layers", TINY["num_layers"])
        kw["attention_types"] = [[["global", "local"], max(1, layers // 2)]]
    if isinstance(defaults.get("attention_window"), list):
        kw["attention_window"] = TINY["attention_window"]
    return kw


def _seq_limit(config) -> int | None:
    """Longest sequence the config's position table holds (None: no table, e.g. relative positions)."""
    for key in ("max_position_embeddings", "n_positions", "max_target_positions"):
        limit = getattr(config, key, None)
        if isinstance(limit, int) and limit > 0:
            if getattr(config, "model_type", "") in ("roberta", "camembert", "longformer", "xlm-roberta"):
                limit -= (getattr(config, "pad_token_id", 0) or 0) + 1  # positions start after the pad index
            return limit
    return None


def build_hf(name: str, tiny: bool = False, seq: int = 512, device: str = "cpu") -> Built:
    """Build a Hugging Face suite entry from its config class with random weights (see the module docstring).

    Args:
        name: a key of :data:`HF_MODELS`.
        tiny: :func:`tiny_kwargs` sizes and sequence :data:`TINY_SEQ`.
        seq: the sequence-length cap (tokens).
        device: where every tensor of the model is placed (:func:`place`).

    Raises:
        NotBuildable: ``transformers`` missing, or lacks the config/model class.
    """
    import torch

    try:
        import transformers
    except ImportError as exc:
        raise NotBuildable(f"transformers is not installed ({exc})") from None
    cfg_name, model_name, kwargs = hf_spec(name)
    cfg_cls, model_cls = getattr(transformers, cfg_name, None), getattr(transformers, model_name, None)
    missing = [n for n, c in ((cfg_name, cfg_cls), (model_name, model_cls)) if c is None]
    if missing:
        raise NotBuildable(f"transformers {transformers.__version__} has no {' / '.join(missing)}")
    kwargs = dict(kwargs)
    defaults = cfg_cls(**kwargs).to_dict()
    if "use_cache" in defaults:
        kwargs["use_cache"] = False
    if model_name.endswith("ForCausalLM") and defaults.get("is_decoder") is False:
        kwargs["is_decoder"] = True  # a causal LM head on an encoder config: causal attention, as its class asks
    if tiny:
        kwargs.update(tiny_kwargs(defaults))
        seq = TINY_SEQ
    config = cfg_cls(**kwargs)
    with torch.device(device):
        hf = model_cls(config)
    place(hf, device).eval()
    cfg = hf.config
    limit = _seq_limit(cfg)
    enc_dec = bool(getattr(cfg, "is_encoder_decoder", False))
    main = getattr(hf, "main_input_name", "input_ids")
    vocab = int(cfg.vocab_size)
    if main == "input_features":  # speech encoder-decoder (Whisper): mel frames, then decoder tokens
        mels, frames = int(cfg.num_mel_bins), 2 * int(cfg.max_source_positions)
        dec_seq = min(seq, limit) if limit else seq
        names = ("input_features", "decoder_input_ids")

        def make(batch: int, dev, seed: int) -> tuple:
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(batch, mels, frames, generator=g)
            ids = torch.randint(0, vocab, (batch, dec_seq), generator=g)
            return x.to(dev), ids.to(dev)

        desc = f"input_features (B, {mels}, {frames}) float32, decoder_input_ids (B, {dec_seq}) int64"
        out_seq = dec_seq
    elif main == "input_ids":
        s = min(seq, limit) if limit else seq
        names = ("input_ids", "decoder_input_ids") if enc_dec else ("input_ids",)

        def make(batch: int, dev, seed: int) -> tuple:
            g = torch.Generator().manual_seed(seed)
            return tuple(torch.randint(0, vocab, (batch, s), generator=g).to(dev) for _ in names)

        desc = ", ".join(f"{n} (B, {s}) int64" for n in names)
        out_seq = s
    else:
        raise NotBuildable(f"{model_name}: main input {main!r} is not handled by the zoo")
    model = _wrapper_class()(hf, names).eval()
    n_params = sum(p.numel() for p in hf.parameters())
    note = f"{model_name}({cfg_name}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}))"
    return Built(model, make, desc, n_params, note, item_out_elems=out_seq * vocab)


def redraw_zero_weights(model, seed: int = 0) -> list[str]:
    """Re-draw the floating weights a constructor leaves all zero, in place; returns their names.

    torchvision's ViT zero-initialises its classification head and timm's ResNets the last BatchNorm scale of
    each block (``zero_init_last``): with random weights the logits are then all zero (or residual branches
    contribute nothing), and every relative error against FP32 reads 0.0 — an accuracy check that cannot fail.
    Parameters named ``*weight`` of at least two elements that are all zero get N(0, 0.02) (matrices,
    convolutions) or ones (1-D scales); biases stay as built. Meta tensors are left alone."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if (not name.endswith("weight") or p.numel() < 2 or not p.is_floating_point()
                    or p.device.type == "meta" or bool(p.count_nonzero())):
                continue
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            else:
                p.fill_(1.0)
            out.append(name)
    return out


def _vision(model, size: tuple[int, ...], note: str) -> Built:
    import torch

    redrawn = redraw_zero_weights(model)
    if redrawn:
        note += f"; all-zero weights re-drawn: {', '.join(redrawn[:6])}" + (
            f" and {len(redrawn) - 6} more" if len(redrawn) > 6 else "")

    def make(batch: int, dev, seed: int) -> tuple:
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(batch, *size, generator=g).to(dev),)

    return Built(model.eval(), make, f"x (B, {', '.join(map(str, size))}) float32",
                 sum(p.numel() for p in model.parameters()), note)


def build(entry: Entry, tiny: bool = False, seq: int = 512, device: str = "cpu") -> Built:
    """Build ``entry``'s FP32 eval model (random weights) on ``device`` and its input maker.

    Raises:
        NotBuildable: the reason it cannot be built here (missing package or class); other exceptions from the
            model's own constructor propagate.
    """
    import torch

    if entry.suite == "huggingface":
        return build_hf(entry.name, tiny, seq, device)
    if entry.suite == "timm":
        try:
            import timm
        except ImportError as exc:
            raise NotBuildable(f"timm is not installed ({exc})") from None
        with torch.device(device):
            model = place(timm.create_model(entry.name, pretrained=False), device)
        size = tuple(getattr(model, "pretrained_cfg", {}).get("input_size") or (3, 224, 224))
        return _vision(model, size, f"timm {timm.__version__} create_model({entry.name!r}, pretrained=False)")
    if entry.suite == "torchvision":
        try:
            import torchvision
        except ImportError as exc:
            raise NotBuildable(f"torchvision is not installed ({exc})") from None
        with torch.device(device):
            model = place(torchvision.models.get_model(entry.name, weights=None), device)
        return _vision(model, (3, 224, 224), f"torchvision {torchvision.__version__} get_model({entry.name!r})")
    if entry.name == "zoo_test_sleep":
        time.sleep(float(os.environ.get("ZOO_TEST_SLEEP_S", "600")))
    torch.manual_seed(0)
    with torch.device(device):
        mlp = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 8))
    return _vision(mlp, (24,), "self-test MLP 24-40-8")


def estimate_params(entry: Entry, tiny: bool = False) -> int | None:
    """Parameter count from a meta-device build (no memory used), or None when that build fails."""
    try:
        return build(entry, tiny, device="meta").params
    except Exception:  # noqa: BLE001 - only an estimate; the real build reports the error
        return None


def _meta_activation_peak(built: Built, batch: int) -> int:
    """Peak of live activation bytes over one forward of ``built.model`` at ``batch`` on the meta device.

    Every non-aliasing op output is counted from its creation until its Python object is freed (as in eager).

    Raises:
        Exception: whatever the meta forward raises (e.g. an op that reads a value, ``Tensor.item``).
    """
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    state = {"live": 0, "peak": 0}

    def free(n: int) -> None:
        state["live"] -= n

    class _Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not any(r.alias_info is not None for r in func._schema.returns):  # views / in-place: no new bytes
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        n = t.numel() * t.element_size()
                        state["live"] += n
                        weakref.finalize(t, free, n)
                state["peak"] = max(state["peak"], state["live"])
            return out

    inputs = built.make_inputs(batch, "meta", 0)
    with torch.no_grad(), _Track():
        out = built.model(*inputs)
    del out
    return state["peak"]


@dataclass
class Plan:
    """The runner's size estimates of one entry (meta-device build; no memory used).

    Attributes:
        params: parameter count, or None when the meta build failed (or a self-test entry).
        need: estimated peak GPU bytes of the model's process (:func:`memory_need`), or None when unknown.
        how: how ``need`` was estimated, in words.
    """

    params: int | None = None
    need: int | None = None
    how: str = "unknown"


def memory_need(params: int, activation_peak: int | None, out_bytes: int = 0) -> tuple[int, str]:
    """Estimated peak GPU bytes of one model process: 1 GiB + BYTES_PER_PARAM x params + 2 x the FP32 activation
    peak; when that peak is unknown, max(4 x params, 4 GiB) + 3 x ``out_bytes`` (the FP32 bytes of the largest
    output at the batch: the reference and the two CUDA-graph outputs) for the activations.

    Returns:
        (bytes, how it was estimated in words).
    """
    base = 2**30 + BYTES_PER_PARAM * params
    if activation_peak is not None:
        return base + 2 * activation_peak, "meta forward"
    return base + max(4 * params, 4 * 2**30) + 3 * out_bytes, "rough (meta forward failed)"


def plan_entry(entry: Entry, tiny: bool = False, seq: int = 512, scale: float = 1.0) -> Plan:
    """:class:`Plan` of ``entry`` at its scaled batch size (self-test entries: nothing known, nothing built)."""
    if entry.suite == "test":
        return Plan()
    try:
        built = build(entry, tiny, seq, device="meta")
    except Exception:  # noqa: BLE001 - only an estimate; the real build reports the error
        return Plan()
    try:
        peak = _meta_activation_peak(built, scaled_batch(entry.batch_size, scale))
    except Exception:  # noqa: BLE001 - data-dependent ops cannot run on meta
        peak = None
    need, how = memory_need(built.params, peak, 4 * scaled_batch(entry.batch_size, scale) * built.item_out_elems)
    return Plan(built.params, need, how)


def gpu_total_memory(gpu: str) -> int | None:
    """Total bytes of physical GPU ``gpu`` from NVML (``pynvml``), else ``nvidia-smi``; None when neither works.
    Does not initialise CUDA in this process."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(int(gpu))).total)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - not installed or no driver: try nvidia-smi
        pass
    try:
        out = subprocess.run(["nvidia-smi", "-i", str(gpu), "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
        return int(float(out.stdout.strip().splitlines()[0])) * 2**20 if out.returncode == 0 else None
    except Exception:  # noqa: BLE001 - no nvidia-smi
        return None


def fits(need: int | None, running: list[int | None], total: int | None, frac: float) -> bool:
    """Whether a model of estimated ``need`` bytes may start on a GPU where models of estimates ``running`` run.

    Always when nothing runs there; otherwise only when every estimate and ``total`` are known and the sum stays
    within ``frac`` x ``total``.
    """
    if not running:
        return True
    if need is None or total is None or any(r is None for r in running):
        return False
    return need + sum(running) <= frac * total


def gpu_slots(gpus: str | None, jobs_per_gpu: int, cuda: bool) -> list[str | None]:
    """The runner's slots: each GPU of comma-separated ``gpus`` (repeats allowed) ``jobs_per_gpu`` times; GPU 0
    when ``gpus`` is empty on CUDA with ``jobs_per_gpu`` > 1; else one slot without a GPU set.

    Raises:
        ValueError: a GPU that is not a non-negative integer, or ``jobs_per_gpu`` < 1.
    """
    if jobs_per_gpu < 1:
        raise ValueError(f"--jobs-per-gpu must be >= 1, got {jobs_per_gpu}")
    ids = [g.strip() for g in gpus.split(",") if g.strip()] if gpus else []
    bad = [g for g in ids if not g.isdigit()]
    if bad:
        raise ValueError(f"--gpus takes comma-separated GPU indices such as 0,1 or 0,0,0,0; got {bad}")
    if not ids and cuda and jobs_per_gpu > 1:
        ids = ["0"]
    if not ids:
        return [None]
    return [g for g in ids for _ in range(jobs_per_gpu)]


def order_and_limit(entries: list[Entry], plans: dict[str, Plan], order: str,
                    max_params: float | None) -> tuple[list[Entry], list[tuple[Entry, str]]]:
    """(entries to run, (entry, reason) to skip): with ``order`` "size" sorted by parameter count, smallest first
    (stable; unknown counts first: such a model fails fast or is a self-test entry); above ``max_params`` skipped."""
    run, skip = [], []
    for e in entries:
        n = plans[e.name].params if e.name in plans else None
        if max_params is not None and n is not None and n > max_params:
            skip.append((e, f"--max-params {max_params:.3g}: {n / 1e9:.2f} B parameters"))
        else:
            run.append(e)
    if order == "size":
        run.sort(key=lambda e: (plans[e.name].params or 0) if e.name in plans else 0)
    return run, skip


@contextlib.contextmanager
def gpu_timing_lock(path: str | os.PathLike | None, waits: list[float]):
    """Hold an exclusive ``fcntl.flock`` on ``path`` (created if missing) for the block; append the seconds
    spent waiting for it to ``waits``. ``path`` None: no lock, a wait of 0."""
    if not path:
        waits.append(0.0)
        yield
        return
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        t = time.perf_counter()
        fcntl.flock(fd, fcntl.LOCK_EX)
        waits.append(time.perf_counter() - t)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


# ------------------------------------------------------------------------------------------------ measuring


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (at most 300 characters)."""
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0][:300] if msg else ''}".rstrip(": ")


def rel_err(out, ref, chunk: int = 1 << 24) -> dict:
    """Relative L2 error of ``out`` against ``ref``, accumulated in float64 over chunks of ``chunk`` elements
    on the tensors' device (a (64, 512, 128112) logits tensor is never copied whole to float64), and the count
    of non-finite values in ``out``.

    Returns:
        ``{"rel_err": float, "nonfinite": int}`` (rel_err is inf when the shapes differ).
    """
    import torch

    o, r = out.detach(), ref.detach()
    if o.shape != r.shape:
        return {"rel_err": math.inf, "nonfinite": int((~torch.isfinite(o)).sum())}
    o, r = o.reshape(-1), r.reshape(-1)
    num = den = 0.0
    nonfinite = 0
    for i in range(0, o.numel(), chunk):
        a, b = o[i:i + chunk].double(), r[i:i + chunk].double()
        num += float(((a - b) ** 2).sum())
        den += float((b * b).sum())
        nonfinite += int((~torch.isfinite(a)).sum())
    return {"rel_err": math.sqrt(num) / max(math.sqrt(den), 1e-30), "nonfinite": nonfinite}


def _max_rel_chunked(o, r, chunk: int) -> tuple[float, int]:
    """(max |o - r| / max |r| in float64 over chunks, elements where exactly one of o, r is finite or both are
    non-finite and differ)."""
    import torch

    o, r = o.reshape(-1), r.reshape(-1)
    diff = scale = 0.0
    bad = 0
    for i in range(0, o.numel(), chunk):
        a, b = o[i:i + chunk].double(), r[i:i + chunk].double()
        fa, fb = torch.isfinite(a), torch.isfinite(b)
        both = fa & fb
        bad += int((fa != fb).sum()) + int((~fa & ~fb & ~((a == b) | (a.isnan() & b.isnan()))).sum())
        if bool(both.any()):
            diff = max(diff, float((a[both] - b[both]).abs().max()))
            scale = max(scale, float(b[both].abs().max()))
    return diff / max(scale, 1e-30), bad


def parity_error(out, ref, chunk: int = 1 << 24) -> dict:
    """How far ``out`` is from ``ref`` on every output: the FP32 parity measure of ``tctune_fp32``.

    Both are flattened with ``torch.utils._pytree`` (tuples, lists, dicts, Hugging Face ``ModelOutput``s). A
    floating tensor's error is max |out - ref| / max |ref| (its scale), in float64 over chunks of ``chunk``
    elements on the tensors' device; non-finite values must sit where ``ref`` has the same one. Any other
    tensor (integer, bool) and any non-tensor leaf must be equal exactly.

    Returns:
        ``{"max_rel_err": float (the worst output; inf on any mismatch below), "outputs": number of leaves,
        "worst_output": its index, "mismatch": None or one line naming the first output that differs in
        structure, shape, dtype, non-finite positions or (non-floating) value}``.
    """
    import torch
    from torch.utils._pytree import tree_flatten

    got, got_spec = tree_flatten(out)
    want, want_spec = tree_flatten(ref)
    res: dict = {"max_rel_err": 0.0, "outputs": len(want), "worst_output": None, "mismatch": None}

    def fail(i: int, why: str) -> dict:
        res.update(max_rel_err=math.inf, worst_output=i, mismatch=f"output {i}: {why}")
        return res

    if len(got) != len(want) or str(got_spec) != str(want_spec):
        return fail(0, f"structure differs ({len(got)} leaves, expected {len(want)})")
    for i, (o, r) in enumerate(zip(got, want)):
        if not isinstance(r, torch.Tensor) or not isinstance(o, torch.Tensor):
            if type(o) is not type(r) or o != r:
                return fail(i, f"{o!r} != {r!r}")
            continue
        if o.shape != r.shape or o.dtype != r.dtype:
            return fail(i, f"{tuple(o.shape)} {o.dtype}, expected {tuple(r.shape)} {r.dtype}")
        if not r.is_floating_point() and not r.is_complex():
            differ = int((o != r).sum())
            if differ:
                return fail(i, f"{differ} of {r.numel()} {r.dtype} elements differ (compared exactly)")
            continue
        if r.is_complex():
            o, r = torch.view_as_real(o), torch.view_as_real(r)
        err, bad = _max_rel_chunked(o.detach(), r.detach(), chunk)
        if bad:
            return fail(i, f"{bad} non-finite value(s) where the reference differs")
        if res["worst_output"] is None or err > res["max_rel_err"]:
            res.update(max_rel_err=err, worst_output=i)
    return res


def float64_distance(model, inputs: tuple, ref) -> float | None:
    """FP32 eager's own rounding error: :func:`parity_error` of ``ref`` (the FP32 model's output on ``inputs``)
    against a float64 copy of ``model`` run on ``inputs`` cast to float64 (the exact value, to FP32's
    precision). None when the float64 run fails (an op without a float64 kernel) or its outputs differ in
    structure or in a non-floating output."""
    import torch

    try:
        with torch.no_grad():
            exact = copy.deepcopy(model).double()(*[x.double() if x.is_floating_point() else x for x in inputs])
    except Exception:  # noqa: BLE001 - no float64 run: the fixed limit stands
        return None
    from torch.utils._pytree import tree_map

    exact = tree_map(lambda t: t.to(dtype=torch.float32) if isinstance(t, torch.Tensor) and t.dtype ==
                     torch.float64 else t, exact)
    res = parity_error(ref, exact)
    return None if res["mismatch"] else res["max_rel_err"]


def parity_limit(fp32_rounding: float | None) -> float:
    """The FP32 parity limit: :data:`FP32_PARITY_TOL`, or :data:`FP32_ROUNDING_FACTOR` x FP32 eager's distance
    from float64 (:func:`float64_distance`) when that is larger (None: not measured)."""
    return max(FP32_PARITY_TOL, FP32_ROUNDING_FACTOR * (fp32_rounding or 0.0))


def structural_passes() -> tuple[str, ...]:
    """The tctune backend's default pipeline (``tctune.backend.BACKEND_PIPELINE``) without the passes that cast
    (``passes.CASTS``): every rewrite that must keep an FP32 graph's values (fold BN, simplify masks, fuse QKV,
    padding, input copies, epilogue fusion)."""
    import tctune.backend as tb
    from passes import CASTS

    return tuple(n for n in tb.BACKEND_PIPELINE if n not in CASTS)


def parity_options(dtype: str, target: str | None = None) -> dict:
    """The tctune backend options of ``tctune_fp32``: ``precision`` ``dtype`` (so each pass plans as it does at
    dt: padding to dt's Tensor Core alignment, dt's padding rules) with ``passes`` :func:`structural_passes`,
    so nothing is cast and the graph computes in FP32. ``target``: plan for this GPU (``"sm_90"``) when the
    inputs are on the CPU (the CPU test); None: the GPU the inputs are on."""
    opts = {"precision": dtype, "policy": "pure", "passes": structural_passes()}
    if target is not None:
        opts["target"] = target
    return opts


def fired_passes(reports) -> dict[str, int]:
    """Rewrites per pass name summed over backend ``SubgraphReport``s (passes that rewrote nothing left out)."""
    fired: dict[str, int] = {}
    for rep in reports:
        for r in rep.results:
            if r.count:
                fired[r.name] = fired.get(r.name, 0) + r.count
    return fired


def _sync(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


def profile_by_name(fn, args: tuple, iters: int, cuda: bool) -> dict[str, tuple[int, float]]:
    """``torch.profiler`` over ``iters`` calls of ``fn(*args)`` (the caller warms up first): kernel name ->
    (calls, total self microseconds), CUDA device events (kernels, memcpy, memset) on CUDA, CPU operators
    otherwise; events with no time are dropped. Used by ``zoo_ablate.py`` and ``zoo_profile.py``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    _sync(cuda)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(iters):
            fn(*args)
        _sync(cuda)
    out: dict[str, tuple[int, float]] = {}
    for evt in prof.key_averages():
        if cuda != (getattr(evt, "device_type", None) == torch.autograd.DeviceType.CUDA):
            continue
        us = _self_us(evt, cuda)
        if us > 0:
            c, t = out.get(evt.key, (0, 0.0))
            out[evt.key] = (c + int(evt.count), t + us)
    return out


def _self_us(evt, cuda: bool) -> float:
    """Self time of a ``key_averages`` entry in microseconds (device time on CUDA)."""
    if cuda:
        for attr in ("self_device_time_total", "self_cuda_time_total", "device_time_total", "cuda_time_total"):
            v = getattr(evt, attr, None)
            if v is not None:
                return float(v)
        return 0.0
    return float(evt.self_cpu_time_total)


def _block_ms(fn, args, iters: int, cuda: bool) -> float:
    """Milliseconds per call over one block of ``iters`` calls (CUDA events, or perf_counter on the CPU)."""
    import torch

    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn(*args)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(*args)
    return (time.perf_counter() - t0) * 1e3 / iters


def time_interleaved(fns: dict[str, tuple[Callable, tuple]], cuda: bool, repeats: int = 5,
                     repeat_s: float = 0.05, max_iters: int = 200) -> dict[str, dict]:
    """Time several callables with their repeats interleaved.

    Each gets two warm-up calls and one synchronized calibration call; ``iters`` = ceil(repeat_s / that call's
    time), in [1, max_iters]. Repeat r times them in order, repeat r + 1 in reverse order.

    Returns:
        name -> ``{"ms": median ms per call, "repeats_ms": [...], "iters": int}``.
    """
    iters = {}
    for name, (fn, args) in fns.items():
        fn(*args)
        fn(*args)
        _sync(cuda)
        t0 = time.perf_counter()
        fn(*args)
        _sync(cuda)
        iters[name] = max(1, min(max_iters, math.ceil(repeat_s / max(time.perf_counter() - t0, 1e-6))))
    samples: dict[str, list[float]] = {n: [] for n in fns}
    names = list(fns)
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            fn, args = fns[name]
            samples[name].append(_block_ms(fn, args, iters[name], cuda))
    return {n: {"ms": statistics.median(s), "repeats_ms": [round(x, 5) for x in s], "iters": iters[n]}
            for n, s in samples.items()}


def combine_captures(captures: list[dict], batch: int) -> dict:
    """One CUDA-graph variant's timing from K captures (``--cg-captures``), each timed on its own.

    Args:
        captures: per capture, the variant's fields after its timing: ``ok``, ``ms`` (median ms per call),
            ``repeats_ms`` (list of ms), ``error`` / ``skipped`` when that capture did not run.
        batch: items per call (for ``items_per_s``).

    Returns:
        Fields to update the variant with: ``ms`` = median of the per-capture medians, ``captures_ms`` (those
        medians, in capture order), ``repeats_ms`` (every repeat of every capture), ``items_per_s``,
        ``captures`` (K), ``capture_errors`` (the errors of captures that did not time); ``ok`` is True when at
        least one capture timed. When none did, only ``captures`` and ``capture_errors`` (the variant keeps
        the last capture's error).
    """
    timed_ok = [c for c in captures if c.get("ok") and c.get("ms") is not None]
    errors = [c.get("error") or c.get("skipped") for c in captures if c not in timed_ok]
    out: dict = {"captures": len(captures), "capture_errors": [e for e in errors if e]}
    if not timed_ok:
        return out
    ms = statistics.median(c["ms"] for c in timed_ok)
    out.update(ok=True, ms=ms, items_per_s=batch / (ms / 1e3), captures_ms=[round(c["ms"], 5) for c in timed_ok],
               repeats_ms=[x for c in timed_ok for x in (c.get("repeats_ms") or [])])
    return out


@contextlib.contextmanager
def compile_cache(fresh: bool):
    """A fresh Inductor / Triton cache for one compile (``torch._inductor.utils.fresh_cache``) when ``fresh``.

    Yields:
        A note for the row: ``"fresh"`` (new cache folders under the process's cache root, in-memory code caches
        cleared), ``"shared"`` (not asked for: ``--warm-cache``, or not a compiled variant) or
        ``"shared: <why>"`` when this torch has no ``fresh_cache``.
    """
    if not fresh:
        yield "shared"
        return
    try:
        from torch._inductor.utils import fresh_cache
    except ImportError as exc:
        yield f"shared: {one_line(exc)}"
        return
    root = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with fresh_cache(dir=root if root and os.path.isdir(root) else None, delete=False):
        yield "fresh"


def warm_compile_pool(timeout_s: float = 120.0) -> dict:
    """Start Inductor's compile worker pool and wait until it answers (``AsyncCompile.wait_pool_ready``).

    Until the pool is ready Inductor compiles kernels in the calling process one at a time, so the first model
    compile of a process would otherwise pay for the pool's start. Returns ``{"ready", "s"}`` (seconds waited),
    ``{"ready": False, "error"}`` when this torch lacks the call or the pool failed (the timing still runs).
    """
    t = time.perf_counter()
    try:
        from torch._inductor.async_compile import AsyncCompile

        AsyncCompile.warm_pool()
        AsyncCompile.wait_pool_ready(timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - a warm-up only
        return {"ready": False, "error": one_line(exc), "s": round(time.perf_counter() - t, 3)}
    return {"ready": True, "s": round(time.perf_counter() - t, 3)}


def inductor_anew(gm, example_inputs):
    """A Dynamo backend compiling with Inductor's ``compile_fx``, as ``backend="inductor"`` does with no options; a
    function of its own, so Dynamo compiles a model again instead of reusing an earlier ``inductor`` cache entry
    of the same code (``inductor_again``)."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)


def cuda_graph(fn: Callable, args: tuple) -> Callable:
    """``fn`` captured as one CUDA graph: three warm-up calls on a side stream, then capture of one call.

    Returns:
        ``run(*args)``: copies ``args`` into the static inputs, replays, returns the static output.
    """
    import torch

    static = tuple(a.clone() for a in args)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static)

    def run(*new_args):
        for s, a in zip(static, new_args):
            s.copy_(a)
        graph.replay()
        return out

    run.graph = graph  # keep the graph (and its memory pool) alive with the callable
    return run


# ------------------------------------------------------------------------------------------------ one model


def _write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def row_path(out: Path, name: str, kind: str = "") -> Path:
    """``OUT/rows/<name with / as __>[.kind].json``."""
    safe = name.replace("/", "__")
    return Path(out) / "rows" / (f"{safe}.{kind}.json" if kind else f"{safe}.json")


def _env() -> dict:
    import torch

    env = {"torch": torch.__version__, "python": platform.python_version(), "host": platform.node()}
    env["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({platform.machine()})"
    for pkg in ("transformers", "timm", "torchvision"):
        try:
            env[pkg] = __import__(pkg).__version__
        except Exception:  # noqa: BLE001 - not installed
            env[pkg] = None
    return env


def measure_model(entry: Entry, args: argparse.Namespace) -> dict:
    """Build one model and measure every requested variant; rewrites its row file after each step.

    Returns:
        The row: ``status`` (ok, not_built, error), ``variants`` {name: {ok, error, compile_s, ms,
        items_per_s, rel_err, nonfinite, ...}}, ``tctune`` {fallbacks, subgraphs, summaries, stage_seconds and
        pass_seconds per subgraph (``SubgraphReport.seconds`` / ``.pass_seconds``)}, and the setup.
    """
    import torch

    cuda = args.device.startswith("cuda")
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    batch = scaled_batch(entry.batch_size, args.scale)
    path = row_path(Path(args.out), entry.name)
    row: dict = {"name": entry.name, "suite": entry.suite, "batch_size": batch, "default_batch_size":
                 entry.batch_size, "dtype": args.dtype, "output_dtype": TCTUNE_OUTPUT_DTYPE, "tiny": bool(args.tiny),
                 "device": args.device, "status": "running", "current": "build", "variants": {}, "started": _dt.datetime.now().isoformat(
                     timespec="seconds"), "env": _env()}
    lock_path = os.environ.get("ZOO_GPU_LOCK") or None
    procs = int(os.environ.get("ZOO_PROCS_PER_GPU", "1"))
    waits: list[float] = []
    row.update(procs_per_gpu=procs, lock_compiles=bool(getattr(args, "lock_compiles", False)),
               gpu_lock={"file": lock_path, "wait_s": 0.0, "sections": 0},
               compile_note=f"compile seconds measured with {procs} concurrent model process(es) on this GPU")
    if os.environ.get("ZOO_MEM_ESTIMATE"):
        row["memory_estimate_gib"] = round(int(os.environ["ZOO_MEM_ESTIMATE"]) / 2**30, 2)
    save = lambda: _write_json(path, row)  # noqa: E731
    save()
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        total = torch.cuda.get_device_properties(0).total_memory
        n = estimate_params(entry, args.tiny) if entry.suite != "test" else None
        if n is not None and n * BYTES_PER_PARAM > args.max_memory_frac * total:
            row.update(status="not_built", reason=f"{n / 1e9:.1f} B parameters need {n * BYTES_PER_PARAM / 2**30:.0f} "
                       f"GiB for FP32 + {args.dtype} + tctune's cast copy, over {args.max_memory_frac:.0%} of the "
                       f"GPU's {total / 2**30:.0f} GiB", params=n)
            save()
            return row
    t0 = time.perf_counter()
    try:
        torch.manual_seed(0)
        built = build(entry, args.tiny, args.seq, args.device)
    except NotBuildable as exc:
        row.update(status="not_built", reason=str(exc))
        save()
        return row
    except Exception as exc:  # noqa: BLE001 - the model's own constructor failed: recorded, not dropped
        row.update(status="not_built", reason=f"build failed: {one_line(exc)}")
        save()
        return row
    row.update(build_s=round(time.perf_counter() - t0, 2), params=built.params, inputs=built.desc, note=built.note)
    model = built.model
    inputs = built.make_inputs(batch, args.device, 1234)
    low_inputs = tuple(x.to(dt) if x.is_floating_point() else x for x in inputs)
    wanted = [v for v in ALL_VARIANTS if v in args.variants]
    outs: dict = {}
    fns: dict[str, tuple[Callable, tuple]] = {}

    def record(name: str, make: Callable[[], Callable], call_args: tuple, needs: str | None = None,
               fresh_cache: bool = False) -> bool:
        row["current"] = name
        save()
        v = row["variants"].setdefault(name, {})
        if name not in wanted:
            v.update(ok=False, skipped="not requested (--variants)")
            return False
        if name.endswith("_cg") and not cuda:
            v.update(ok=False, skipped="CUDA graphs need a CUDA device")
            return False
        if needs is not None and needs not in fns:
            v.update(ok=False, skipped=f"needs the {needs} variant, which did not run")
            return False
        lock = gpu_timing_lock(lock_path, waits) if getattr(args, "lock_compiles", False) else contextlib.nullcontext()
        try:
            with lock, compile_cache(fresh_cache and not args.warm_cache) as cache_note:
                t = time.perf_counter()  # after the lock: the wait for it is not compile time
                fn = make()
                out = fn(*call_args)
                _sync(cuda)
            if fresh_cache:
                row.setdefault("compile_cache", {})[name] = cache_note
        except Exception as exc:  # noqa: BLE001 - recorded per variant
            v.update(ok=False, error=one_line(exc))
            if os.environ.get("ZOO_TRACEBACK"):
                traceback.print_exc()
            if cuda:
                torch.cuda.empty_cache()
            return False
        v.update(ok=True, compile_s=round(time.perf_counter() - t, 3))
        fns[name] = (fn, call_args)
        if name == "fp32_eager":
            outs[name] = out  # the reference; other outputs are compared now and dropped
        elif "fp32_eager" in outs:
            v.update(rel_err(out, outs["fp32_eager"]))
            if name == "tctune_fp32":  # every output, against the FP32 model's (parity_error)
                par = parity_error(out, outs["fp32_eager"])
                v.update(fp32_parity_rel_err=par["max_rel_err"], fp32_parity_mismatch=par["mismatch"])
                if par["mismatch"] is None and par["max_rel_err"] > FP32_PARITY_TOL:  # rounding, or a rewrite?
                    v["fp32_rounding_err"] = float64_distance(model, call_args, outs["fp32_eager"])
                    v["fp32_parity_limit"] = parity_limit(v["fp32_rounding_err"])
        del out
        return True

    def timed(*names: str) -> None:
        todo = {n: fns[n] for n in names if n in fns}
        if not todo:
            return
        row["current"] = "timing " + ", ".join(todo)
        save()
        try:
            with gpu_timing_lock(lock_path, waits):
                row["gpu_lock"].update(wait_s=round(sum(waits), 3), sections=len(waits))
                res = time_interleaved(todo, cuda, args.repeats, args.repeat_s)
        except Exception as exc:  # noqa: BLE001
            for n in todo:
                row["variants"][n].update(ok=False, error=f"timing: {one_line(exc)}")
            return
        for n, r in res.items():
            row["variants"][n].update(r, items_per_s=batch / (r["ms"] / 1e3))
        save()

    with torch.no_grad():
        record("fp32_eager", lambda: model, inputs)
        if "fp32_eager" not in outs:
            row.update(status="error", reason=f"fp32 eager failed: {row['variants']['fp32_eager'].get('error')}")
            save()
            return row
        timed("fp32_eager")
        low = None
        if any(v in wanted for v in ("eager", "eager_cg", "inductor", "inductor_cg", "inductor_again",
                                     "tctune_lowtrace")):
            low = copy.deepcopy(model).to(dt).eval()
        record("eager", lambda: low, low_inputs)
        timed("eager")
        record("eager_cg", lambda: cuda_graph(low, low_inputs), low_inputs)
        timed("eager_cg")
        fns.pop("eager", None), fns.pop("eager_cg", None)  # only the compiled pairs stay alive
        if "tctune" in wanted or "inductor" in wanted:
            row["current"] = "warm-up compile"
            save()
            t = time.perf_counter()
            try:  # one-off costs of the process's first compile, paid by neither side (module docstring)
                torch.compile(lambda v: (v * 2).sin() + 1)(torch.randn(64, device=args.device))
                _sync(cuda)
                row["warm_compile_s"] = round(time.perf_counter() - t, 3)
                row["warm_pool"] = warm_compile_pool()
            except Exception as exc:  # noqa: BLE001 - only a warm-up; the variants report their own errors
                row["warm_compile_s"] = None
                row["warm_compile_error"] = one_line(exc)
            torch._dynamo.reset()
        if "tctune" in wanted:
            import tctune.backend as tb

            tb.reset()
            backend = "tctune" if "tctune" in torch._dynamo.list_backends() else tb.tctune_backend
            options = {"precision": args.dtype, "policy": "pure", "output_dtype": TCTUNE_OUTPUT_DTYPE}
            record("tctune", lambda: torch.compile(model, backend=backend, options=options), inputs, fresh_cache=True)
            reports = list(tb.reports)
            row["tctune"] = {"backend": backend if isinstance(backend, str) else "tctune.backend.tctune_backend",
                             "options": options, "subgraphs": len(reports),
                             "fallbacks": [(r.fallback.strip().splitlines() or [""])[0][:300]
                                           for r in reports if r.fallback],
                             "summaries": [r.summary()[:400] for r in reports[:32]],
                             "stage_seconds": [dict(r.seconds) for r in reports[:32]],
                             "pass_seconds": [dict(getattr(r, "pass_seconds", {})) for r in reports[:32]]}
        else:
            record("tctune", lambda: model, inputs)  # records it as not requested
        record("inductor", lambda: torch.compile(low), low_inputs, fresh_cache=True)
        record("inductor_fp32in", lambda: torch.compile(cast_inputs_inside(low, dt)), inputs, fresh_cache=True)
        if "tctune_freezing" in wanted:
            import tctune.backend as tb

            tb.reset()
            backend = "tctune" if "tctune" in torch._dynamo.list_backends() else tb.tctune_backend
            fopts = {"precision": args.dtype, "policy": "pure", "output_dtype": TCTUNE_OUTPUT_DTYPE,
                     "inductor": {"freezing": True}}
            fmodel = copy.deepcopy(model)  # its own Dynamo cache entry, not a recompile of the tctune variant's
            record("tctune_freezing", lambda: torch.compile(fmodel, backend=backend, options=fopts), inputs,
                   fresh_cache=True)
            row["tctune_freezing"] = {"options": fopts, "fallbacks": [
                (r.fallback.strip().splitlines() or [""])[0][:300] for r in tb.reports if r.fallback]}
        else:
            record("tctune_freezing", lambda: model, inputs)  # records it as not requested
        record("inductor_freezing", lambda: torch.compile(copy.deepcopy(low), options={"freezing": True}),
               low_inputs, fresh_cache=True)
        record("inductor_again", lambda: torch.compile(copy.deepcopy(low), backend=inductor_anew), low_inputs,
               fresh_cache=True)
        if "tctune_lowtrace" in wanted:
            import tctune.backend as tb

            tb.reset()
            backend = "tctune" if "tctune" in torch._dynamo.list_backends() else tb.tctune_backend
            lopts = {"precision": args.dtype, "policy": "pure", "output_dtype": TCTUNE_OUTPUT_DTYPE}
            lmodel = copy.deepcopy(low)
            record("tctune_lowtrace", lambda: torch.compile(lmodel, backend=backend, options=lopts), low_inputs,
                   fresh_cache=True)
            row["tctune_lowtrace"] = {"options": lopts, "summaries": [r.summary()[:400] for r in tb.reports[:8]],
                                      "fallbacks": [(r.fallback.strip().splitlines() or [""])[0][:300]
                                                    for r in tb.reports if r.fallback]}
        else:
            record("tctune_lowtrace", lambda: model, inputs)  # records it as not requested
        timed("inductor", "tctune", "inductor_fp32in", "tctune_freezing", "inductor_freezing", "inductor_again",
              "tctune_lowtrace")
        for name in ("inductor_fp32in", "tctune_freezing", "inductor_freezing", "inductor_again", "tctune_lowtrace"):
            fns.pop(name, None)
        cg_args = {"tctune_cg": ("tctune", inputs), "inductor_cg": ("inductor", low_inputs)}
        per_capture: dict[str, list[dict]] = {n: [] for n in cg_args}
        for k in range(max(1, args.cg_captures)):  # K captures of both sides (module docstring, CUDA graphs)
            for name in (list(cg_args) if k % 2 == 0 else list(cg_args)[::-1]):
                base, call_args = cg_args[name]
                record(name, lambda b=base, a=call_args: cuda_graph(fns[b][0], a), call_args, needs=base)
            timed("inductor_cg", "tctune_cg")
            for name in cg_args:
                v = row["variants"][name]
                per_capture[name].append({key: v.get(key) for key in ("ok", "ms", "repeats_ms", "error", "skipped")})
                fns.pop(name, None)  # releases capture k (graph and memory pool) before capture k + 1
            if cuda:
                torch.cuda.synchronize()
        for name, caps in per_capture.items():
            if len(caps) > 1:
                row["variants"][name].update(combine_captures(caps, batch))
        fns.pop("inductor", None), fns.pop("tctune", None)
        fns.clear()
        if "tctune_fp32" in wanted:  # last: the Dynamo reset below invalidates the compiled callables above
            import tctune.backend as tb

            torch._dynamo.reset()
            tb.reset()
            backend = "tctune" if "tctune" in torch._dynamo.list_backends() else tb.tctune_backend
            popts = parity_options(args.dtype)
            record("tctune_fp32", lambda: torch.compile(model, backend=backend, options=popts), inputs)
            reports = list(tb.reports)
            row["tctune_fp32"] = {"options": {**popts, "passes": list(popts["passes"])}, "subgraphs": len(reports),
                                  "tol": FP32_PARITY_TOL, "fired": fired_passes(reports),
                                  "fallbacks": [(r.fallback.strip().splitlines() or [""])[0][:300]
                                                for r in reports if r.fallback]}
            fns.clear()
    if cuda:
        row["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    row.update(status="ok", current=None, finished=_dt.datetime.now().isoformat(timespec="seconds"),
               wall_s=round(time.perf_counter() - t0, 1))
    save()
    return row


# ------------------------------------------------------------------------------------------------ optimize


_MODEL_FILE = '''"""Zoo entry {name!r} as a tctune model file (generated by benchmarks/zoo.py)."""
import importlib.util
import sys

_spec = importlib.util.spec_from_file_location("tctune_bench_zoo", {zoo!r})
_zoo = sys.modules["tctune_bench_zoo"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_zoo)
_ENTRY = _zoo.all_entries(include_test=True)[{name!r}]
_built = None


def build_model():
    global _built
    import torch
    torch.manual_seed(0)  # the same weights on every call
    _built = _zoo.build(_ENTRY, tiny={tiny!r}, seq={seq!r})
    return _built.model


def example_inputs(batch_size):
    global _built
    if _built is None:
        build_model()
    import random
    return _built.make_inputs(batch_size, "cpu", random.randrange(1 << 30))
'''


def optimize_fields(report: dict) -> dict:
    """The zoo's numbers from a ``tctune optimize`` ``report.json`` (see the module docstring).

    Returns:
        ``speedup_vs_best_baseline`` (best trial / fastest feasible model-as-written trial at its batch size),
        ``best_plain`` (that trial's params and throughput), ``speedup_vs_fp32_eager`` and
        ``optimize_speedup_source``, ``best_params``, ``best_throughput``, ``confirmed_throughput``,
        ``compiled_baseline`` (whether a plain ``torch.compile`` runtime was among the model-as-written trials at
        that batch size: a short budget can end the search before it reaches them, and then the speedup is
        against eager baselines only); None values where the report has no best trial.
    """
    best = report.get("best") or {}
    out: dict = {"best_params": best.get("params"), "best_throughput": best.get("throughput"),
                 "confirmed_throughput": best.get("confirmed_throughput"), "best_rel_err": best.get("max_rel_error"),
                 "speedup_vs_best_baseline": None, "best_plain": None, "speedup_vs_fp32_eager": None,
                 "optimize_speedup_source": None, "compiled_baseline": None,
                 "speedup_vs_best_baseline_source": None}
    if not best or not best.get("throughput"):
        return out
    bs = (best.get("params") or {}).get("batch_size")
    plain = [t for t in report.get("trials", []) if t.get("state") == "COMPLETE" and t.get("feasible")
             and not (t.get("params") or {}).get("graph_passes") and (t.get("params") or {}).get("batch_size") == bs
             and t.get("throughput")]
    out["compiled_baseline"] = any("inductor" in str((t.get("params") or {}).get("runtime", "")) for t in plain)
    if plain:
        top = max(plain, key=lambda t: t["throughput"])
        out["best_plain"] = {"params": top["params"], "throughput": top["throughput"], "trial": top.get("number")}
        out["speedup_vs_best_baseline"] = best["throughput"] / top["throughput"]
        out["speedup_vs_best_baseline_source"] = "first timings of the two trials"
    if isinstance(best.get("best_baseline"), dict) and best.get("speedup_vs_best_baseline") is not None:
        # Reports that name their best plain baseline: the report's own headline (the two timed side by side,
        # interleaved, after the search), so the zoo and report.md give one number.
        out["speedup_vs_best_baseline_first_timings"] = out["speedup_vs_best_baseline"]
        out["speedup_vs_best_baseline"] = best["speedup_vs_best_baseline"]
        out["speedup_vs_best_baseline_source"] = "report best.speedup_vs_best_baseline (side by side)"
        out["best_plain"] = dict(out["best_plain"] or {}, report_best_baseline=best["best_baseline"])
    if best.get("speedup_vs_fp32_eager") is not None:  # reports with plain baselines: this run's side-by-side
        out["speedup_vs_fp32_eager"] = best["speedup_vs_fp32_eager"]
        out["optimize_speedup_source"] = "report best.speedup_vs_fp32_eager"
    elif best.get("speedup_vs_best_baseline") is not None:  # older reports: their only baseline was FP32 eager
        out["speedup_vs_fp32_eager"] = best["speedup_vs_best_baseline"]
        out["optimize_speedup_source"] = "report best.speedup_vs_best_baseline (against FP32 eager)"
    else:
        same = [b for b in report.get("baselines", []) if b.get("batch_size") == bs and b.get("throughput")
                and b.get("name", "fp32_eager") == "fp32_eager"]
        if same:
            out["speedup_vs_fp32_eager"] = best["throughput"] / same[0]["throughput"]
            out["optimize_speedup_source"] = ("computed here: report lacks best.speedup_vs_best_baseline; best "
                                              "throughput / the report's FP32 eager baseline at the same batch size")
    return out


def run_optimize(entry: Entry, args: argparse.Namespace) -> dict:
    """Run ``tctune.optimize`` on ``entry`` at its zoo batch size; write and return the optimize row."""
    path = row_path(Path(args.out), entry.name, "optimize")
    batch = scaled_batch(entry.batch_size, args.scale)
    row: dict = {"name": entry.name, "batch_size": batch, "status": "running",
                 "trials": args.optimize_trials, "budget_s": args.optimize_budget_s}
    _write_json(path, row)
    work = Path(args.out) / "optimize" / entry.name.replace("/", "__")
    work.mkdir(parents=True, exist_ok=True)
    model_file = work / f"zoo_{entry.name.replace('/', '_').replace('-', '_').replace('.', '_')}.py"
    model_file.write_text(_MODEL_FILE.format(name=entry.name, zoo=str(Path(__file__).resolve()), tiny=bool(args.tiny),
                                             seq=args.seq))
    t0 = time.perf_counter()
    try:
        from tctune import TuneConfig
        from tctune.optimize import optimize  # (`from tctune import optimize` can yield the submodule)

        cfg = TuneConfig(out_dir=str(work / "run"), batch_sizes=(batch,), trials=args.optimize_trials,
                         timeout_s=args.optimize_budget_s, export=False, quiet=True)
        waits: list[float] = []
        with gpu_timing_lock(os.environ.get("ZOO_GPU_LOCK") or None, waits):  # its trials time inside the search
            row["gpu_lock_wait_s"] = round(waits[0], 3)
            _write_json(path, row)
            optimize(model_file, cfg)
        report = json.loads((work / "run" / "report.json").read_text())
    except Exception as exc:  # noqa: BLE001 - recorded
        row.update(status="error", error=one_line(exc), wall_s=round(time.perf_counter() - t0, 1))
        _write_json(path, row)
        return row
    row.update(optimize_fields(report))
    row.update(status="ok", wall_s=round(time.perf_counter() - t0, 1), report=str(work / "run" / "report.json"))
    _write_json(path, row)
    return row


# ------------------------------------------------------------------------------------------------ summary


def accuracy_consistent(rel: float | None, eager_rel: float | None) -> bool | None:
    """tctune's error <= 2 x ``model.to(dt)`` eager's error + 1e-3 (None when either is missing)."""
    if rel is None or eager_rel is None:
        return None
    return bool(rel <= ACC_FACTOR * eager_rel + ACC_ABS)


def geomean(xs) -> float | None:
    """Geometric mean of the positive finite values (None when there are none)."""
    vals = [x for x in xs if isinstance(x, (int, float)) and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in vals) / len(vals)) if vals else None


def _ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 else None


def summarize(row: dict, opt: dict | None = None) -> dict:
    """One ``latest.json`` model entry from a measure row (and its optimize row)."""
    v = row.get("variants", {})
    get = lambda name, key: (v.get(name) or {}).get(key) if (v.get(name) or {}).get("ok") else None  # noqa: E731
    fallbacks = (row.get("tctune") or {}).get("fallbacks", [])
    options = (row.get("tctune") or {}).get("options") or {}
    rel = get("tctune", "rel_err")
    eager_rel = get("eager", "rel_err")
    s = {
        "suite": row.get("suite"), "batch_size": row.get("batch_size"), "dtype": row.get("dtype"),
        # the tctune variant's output contract (TCTUNE_OUTPUT_DTYPE); a row from before the option ran "fp32"
        "output_dtype": options.get("output_dtype", "fp32") if options else row.get("output_dtype"),
        "status": row.get("status"), "reason": row.get("reason"),
        "tctune_ok": bool(get("tctune", "compile_s") is not None and not fallbacks),
        "tctune_error": (v.get("tctune") or {}).get("error"),
        "fallbacks": fallbacks,
        "speedup_vs_inductor": _ratio(get("tctune", "items_per_s"), get("inductor", "items_per_s")),
        "speedup_vs_inductor_cg": _ratio(get("tctune_cg", "items_per_s"), get("inductor_cg", "items_per_s")),
        # both sides handed the same FP32 inputs, each casting them inside its compiled graph (inductor_fp32in)
        "speedup_vs_inductor_fp32in": _ratio(get("tctune", "items_per_s"), get("inductor_fp32in", "items_per_s")),
        # Inductor's freezing on the tctune side, against plain Inductor and against plain Inductor with freezing
        "speedup_freezing_vs_inductor": _ratio(get("tctune_freezing", "items_per_s"), get("inductor", "items_per_s")),
        "speedup_freezing_vs_inductor_freezing": _ratio(get("tctune_freezing", "items_per_s"),
                                                        get("inductor_freezing", "items_per_s")),
        "compile_s_freezing": get("tctune_freezing", "compile_s"),
        # a second compile of the inductor variant (the method's compile-to-compile spread), and the backend on
        # the dt model (Dynamo tracing the dt model, as for inductor)
        "inductor_again_vs_inductor": _ratio(get("inductor_again", "items_per_s"), get("inductor", "items_per_s")),
        "speedup_lowtrace_vs_inductor": _ratio(get("tctune_lowtrace", "items_per_s"), get("inductor", "items_per_s")),
        "accuracy_consistent": accuracy_consistent(rel, eager_rel),
        "rel_err": rel, "eager_rel_err": eager_rel, "inductor_rel_err": get("inductor", "rel_err"),
        "compile_s": get("tctune", "compile_s"), "inductor_compile_s": get("inductor", "compile_s"),
        "compile_ratio": _ratio(get("tctune", "compile_s"), get("inductor", "compile_s")),
        "items_per_s": {n: round(x["items_per_s"], 2) for n, x in v.items() if x.get("ok") and x.get("items_per_s")},
        "errors": {n: x["error"] for n, x in v.items() if x.get("error")},
        "optimize_speedup_vs_best_baseline": None,
        "timing_noisy": timing_noisy(row),
        **fp32_parity_fields(row),
    }
    if opt:
        s["optimize_speedup_vs_best_baseline"] = opt.get("speedup_vs_best_baseline")
        s["optimize"] = {k: opt.get(k) for k in ("status", "error", "reason", "best_params", "best_throughput",
                                                 "confirmed_throughput", "best_plain", "speedup_vs_fp32_eager",
                                                 "optimize_speedup_source", "compiled_baseline", "budget_s",
                                                 "wall_s")}
    return s


def fp32_parity_fields(row: dict) -> dict:
    """The ``tctune_fp32`` variant's summary: ``fp32_parity_rel_err`` (max relative error of every output against
    FP32 eager, :func:`parity_error`), ``fp32_parity_ok`` (within the limit, no output mismatch and no fallback;
    None when the variant did not run or failed: its error is in ``errors``), ``fp32_parity_limit``
    (:data:`FP32_PARITY_TOL`, or :func:`parity_limit` of ``fp32_rounding_err``, FP32 eager's distance from a
    float64 run, measured when the error is above the fixed limit),
    ``fp32_parity_fired`` (rewrites per structural pass) and ``fp32_parity_fallbacks``."""
    v = (row.get("variants") or {}).get("tctune_fp32") or {}
    info = row.get("tctune_fp32") or {}
    err = v.get("fp32_parity_rel_err") if v.get("ok") else None
    fallbacks = info.get("fallbacks") or []
    limit = v.get("fp32_parity_limit") or info.get("tol", FP32_PARITY_TOL)
    ok = None if err is None else bool(err <= limit and not v.get("fp32_parity_mismatch") and not fallbacks)
    return {"fp32_parity_rel_err": err, "fp32_parity_ok": ok, "fp32_parity_limit": limit if v else None,
            "fp32_rounding_err": v.get("fp32_rounding_err"), "fp32_parity_fired": info.get("fired"),
            "fp32_parity_fallbacks": fallbacks, "fp32_parity_mismatch": v.get("fp32_parity_mismatch")}


def timing_noisy(row: dict) -> list[str]:
    """The compared variants of ``row`` (:data:`COMPARED`) whose median repeat is more than :data:`NOISY_SPREAD`
    times their fastest (a CUDA-graph variant's repeats are taken per capture)."""
    noisy = []
    for name in COMPARED:
        v = (row.get("variants") or {}).get(name) or {}
        reps = [x for x in v.get("repeats_ms") or [] if isinstance(x, (int, float)) and x > 0]
        n_cap = len(v.get("captures_ms") or []) or 1
        size = len(reps) // n_cap if len(reps) % n_cap == 0 and len(reps) >= n_cap else len(reps)
        chunks = [reps[i:i + size] for i in range(0, len(reps), size)] if size else []
        if any(statistics.median(c) / min(c) > NOISY_SPREAD for c in chunks if c):
            noisy.append(name)
    return noisy


def _row_rank(row: dict) -> tuple:
    return (row.get("status") == "ok", row.get("status") not in ("skipped", None), row.get("finished") or
            row.get("started") or "")


def merge(dirs: list[str | Path]) -> dict:
    """Merge the rows under ``dirs`` (recursively) into the ``latest.json`` dictionary.

    For a model measured more than once the row with status ok wins, then the newest.

    Raises:
        ValueError: no row file under any of ``dirs``.
    """
    rows: dict[str, dict] = {}
    opts: dict[str, dict] = {}
    files = []
    for d in dirs:
        files += sorted(glob.glob(os.path.join(str(d), "**", "rows", "*.json"), recursive=True))
    if not files:
        raise ValueError(f"no rows found under {[str(d) for d in dirs]} (expected DIR/rows/*.json from "
                         f"`zoo.py --out DIR`)")
    for f in files:
        r = json.loads(Path(f).read_text())
        target = opts if f.endswith(".optimize.json") else rows
        old = target.get(r["name"])
        if old is None or _row_rank(r) >= _row_rank(old):
            target[r["name"]] = r
    env = next((r.get("env") for r in rows.values() if r.get("status") == "ok" and r.get("env")), None) or {}
    dtypes = sorted({r.get("dtype") for r in rows.values() if r.get("dtype")})
    models = {name: summarize(r, opts.get(name)) for name, r in rows.items()}
    for name, o in opts.items():
        if name not in models:
            models[name] = {"status": "optimize_only", "optimize_speedup_vs_best_baseline":
                            o.get("speedup_vs_best_baseline"), "optimize": o}
    return {"device": env.get("device"), "date": _dt.date.today().isoformat(), "torch": env.get("torch"),
            "transformers": env.get("transformers"), "timm": env.get("timm"), "torchvision": env.get("torchvision"),
            "dtype": dtypes[0] if len(dtypes) == 1 else dtypes, "summary": overall(models), "models": models}


def overall(models: dict[str, dict]) -> dict:
    """Suite-wide numbers: geomean speedups, fallback counts, compile-time ratios, accuracy counts."""
    ok = [m for m in models.values() if m.get("status") == "ok"]
    ratios = [m["compile_ratio"] for m in ok if m.get("compile_ratio")]
    return {
        "models": len(models), "measured": len(ok),
        "not_built": sorted(n for n, m in models.items() if m.get("status") == "not_built"),
        "geomean_speedup_vs_inductor": geomean(m.get("speedup_vs_inductor") for m in ok),
        "n_speedup": sum(m.get("speedup_vs_inductor") is not None for m in ok),
        "geomean_speedup_vs_inductor_cg": geomean(m.get("speedup_vs_inductor_cg") for m in ok),
        "n_speedup_cg": sum(m.get("speedup_vs_inductor_cg") is not None for m in ok),
        "geomean_speedup_vs_inductor_fp32in": geomean(m.get("speedup_vs_inductor_fp32in") for m in ok),
        "n_speedup_fp32in": sum(m.get("speedup_vs_inductor_fp32in") is not None for m in ok),
        "min_speedup_vs_inductor": min((m["speedup_vs_inductor"] for m in ok if m.get("speedup_vs_inductor")),
                                       default=None),
        "models_with_fallbacks": sum(bool(m.get("fallbacks")) for m in ok),
        "fallback_subgraphs": sum(len(m.get("fallbacks") or []) for m in ok),
        "accuracy_consistent": sum(m.get("accuracy_consistent") is True for m in ok),
        "accuracy_inconsistent": sorted(n for n, m in models.items() if m.get("accuracy_consistent") is False),
        "geomean_compile_ratio": geomean(ratios),
        "median_compile_ratio": statistics.median(ratios) if ratios else None,
        "geomean_optimize_speedup_vs_best_baseline": geomean(m.get("optimize_speedup_vs_best_baseline")
                                                             for m in models.values()),
        "timing_noisy": sorted(n for n, m in models.items() if m.get("timing_noisy")),
        # the same two numbers over the rows whose compared timings were not disturbed (timing_noisy empty)
        "geomean_speedup_vs_inductor_clean": geomean(m.get("speedup_vs_inductor") for m in ok
                                                     if not m.get("timing_noisy")),
        "n_speedup_clean": sum(m.get("speedup_vs_inductor") is not None and not m.get("timing_noisy") for m in ok),
        "min_speedup_vs_inductor_clean": min((m["speedup_vs_inductor"] for m in ok if m.get("speedup_vs_inductor")
                                              and not m.get("timing_noisy")), default=None),
        "fp32_parity_checked": sum(m.get("fp32_parity_ok") is not None for m in ok),
        "fp32_parity_over_tol": sorted(n for n, m in models.items() if m.get("fp32_parity_ok") is False),
        "fp32_parity_max_rel_err": max((m["fp32_parity_rel_err"] for m in ok if m.get("fp32_parity_rel_err")
                                        is not None), default=None),
    }


def _f(x, spec=".2f") -> str:
    return "–" if x is None else format(x, spec)


def markdown(latest: dict) -> str:
    """The suite table for benchmarks/RESULTS.md: one row per model, then the suite-wide numbers."""
    lines = [f"Device {latest.get('device')}, torch {latest.get('torch')}, transformers {latest.get('transformers')}, "
             f"timm {latest.get('timm')}, dtype {latest.get('dtype')}, merged {latest.get('date')}.", "",
             "| model | suite | batch | tctune / Inductor | with CUDA graphs | rel. err tctune (eager dt) | consistent "
             "| fallbacks | compile s tctune / Inductor | optimize vs best baseline | FP32 parity |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in sorted(latest["models"].items(), key=lambda kv: (kv[1].get("suite") or "", kv[0])):
        if m.get("status") != "ok":
            why = m.get("reason") or m.get("status")
            lines.append(f"| {name} | {m.get('suite')} | {m.get('batch_size')} | {m.get('status')}: {why} "
                         "| | | | | | | |")
            continue
        acc = {True: "yes", False: "**no**", None: "–"}[m.get("accuracy_consistent")]
        rel = f"{_f(m.get('rel_err'), '.1e')} ({_f(m.get('eager_rel_err'), '.1e')})"
        speed = _f(m.get("speedup_vs_inductor")) if m.get("speedup_vs_inductor") else (
            "error" if m.get("tctune_error") else "–")
        if m.get("timing_noisy"):
            speed += " †"
        lines.append(f"| {name} | {m.get('suite')} | {m.get('batch_size')} | {speed} "
                     f"| {_f(m.get('speedup_vs_inductor_cg'))} | {rel} | {acc} | {len(m.get('fallbacks') or [])} "
                     f"| {_f(m.get('compile_s'), '.1f')} / {_f(m.get('inductor_compile_s'), '.1f')} "
                     f"| {_optimize_cell(m)} | {_parity_cell(m)} |")
    s = latest.get("summary") or overall(latest["models"])
    lines += ["", f"- Geomean tctune / Inductor: **{_f(s['geomean_speedup_vs_inductor'])}×** over {s['n_speedup']} "
              f"models (lowest {_f(s['min_speedup_vs_inductor'])}×); with CUDA graphs on both sides "
              f"**{_f(s['geomean_speedup_vs_inductor_cg'])}×** over {s['n_speedup_cg']}.",
              f"- Fallbacks: {s['models_with_fallbacks']} of {s['measured']} measured models "
              f"({s['fallback_subgraphs']} subgraphs).",
              f"- Accuracy consistent (tctune error ≤ 2 × eager {latest.get('dtype')} error + 1e-3): "
              f"{s['accuracy_consistent']} of {s['measured']}"
              + (f"; not: {', '.join(s['accuracy_inconsistent'])}" if s["accuracy_inconsistent"] else "") + ".",
              f"- Compile time tctune / Inductor: geomean {_f(s['geomean_compile_ratio'])}×, median "
              f"{_f(s['median_compile_ratio'])}×.",
              f"- Not built: {len(s['not_built'])}" + (f" ({', '.join(s['not_built'])})" if s["not_built"] else "")
              + "."]
    if s.get("timing_noisy"):
        lines.append(f"- † timing disturbed (a compared variant's median repeat is more than {NOISY_SPREAD}× its "
                     f"fastest, within one CUDA-graph capture): "
                     f"{', '.join(s['timing_noisy'])}. Over the {s.get('n_speedup_clean')} rows without it: "
                     f"geomean tctune / Inductor {_f(s.get('geomean_speedup_vs_inductor_clean'))}× (lowest "
                     f"{_f(s.get('min_speedup_vs_inductor_clean'))}×).")
    if s.get("n_speedup_fp32in"):
        lines.append(f"- Same FP32 inputs on both sides (`inductor_fp32in`: Inductor casts them inside its compiled "
                     f"callable, as tctune does): geomean tctune / Inductor "
                     f"**{_f(s['geomean_speedup_vs_inductor_fp32in'])}×** over {s['n_speedup_fp32in']} models.")
    if s.get("fp32_parity_checked"):
        over = s.get("fp32_parity_over_tol") or []
        lines.append(f"- FP32 parity (`tctune_fp32`: the backend's structural passes, nothing cast, against FP32 "
                     f"eager; max relative error of every output ≤ {FP32_PARITY_TOL:g}, or ≤ "
                     f"{FP32_ROUNDING_FACTOR:g} × FP32 eager's own distance from float64 where that is larger): "
                     f"{s['fp32_parity_checked'] - len(over)} of {s['fp32_parity_checked']} checked models within, "
                     f"worst {_f(s.get('fp32_parity_max_rel_err'), '.1e')}"
                     + (f"; **over**: {', '.join(over)}" if over else "") + ".")
    if s.get("geomean_optimize_speedup_vs_best_baseline"):
        lines.append(f"- `tctune optimize` vs the best plain baseline of its own search: geomean "
                     f"{_f(s['geomean_optimize_speedup_vs_best_baseline'])}×.")
    if any((m.get("optimize") or {}).get("compiled_baseline") is False for m in latest["models"].values()):
        lines.append("- ‡ `tctune optimize`'s search ended (its `--optimize-budget-s`) before a plain `torch.compile` "
                     "baseline ran: that speedup is against the eager baselines only.")
    return "\n".join(lines)


def _optimize_cell(m: dict) -> str:
    """The optimize column: the speedup, ‡ when no plain torch.compile baseline was measured, or the status of
    a run that gave no number."""
    opt = m.get("optimize") or {}
    if m.get("optimize_speedup_vs_best_baseline") is None:
        return opt.get("status") if opt.get("status") not in (None, "ok") else "–"
    return _f(m["optimize_speedup_vs_best_baseline"]) + (" ‡" if opt.get("compiled_baseline") is False else "")


def _parity_cell(m: dict) -> str:
    """The FP32 parity column: the error, bold when over the limit or with a mismatch / fallback; – not run."""
    err, ok = m.get("fp32_parity_rel_err"), m.get("fp32_parity_ok")
    if ok is None:
        return "–"
    text = _f(err, ".1e") + ("" if not m.get("fp32_parity_fallbacks") else " (fallback)")
    return text if ok else f"**{text}**"


def short_table(rows: list[dict]) -> str:
    """A compact plain-text table of this call's rows (status, speedups, errors, compile seconds)."""
    head = (f"{'model':<40} {'status':<10} {'tct/ind':>7} {'cg':>6} {'rel tct':>8} {'rel eag':>8} {'fb':>3} "
            f"{'comp s':>11} {'fp32 par':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        s = summarize(r)
        lines.append(f"{r['name'][:40]:<40} {str(r.get('status'))[:10]:<10} {_f(s['speedup_vs_inductor']):>7} "
                     f"{_f(s['speedup_vs_inductor_cg']):>6} {_f(s['rel_err'], '.1e'):>8} "
                     f"{_f(s['eager_rel_err'], '.1e'):>8} {len(s['fallbacks']):>3} "
                     f"{_f(s['compile_s'], '.0f'):>5}/{_f(s['inductor_compile_s'], '.0f'):<5} "
                     f"{_f(s['fp32_parity_rel_err'], '.1e'):>8}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ runner


def _child_args(args: argparse.Namespace) -> list[str]:
    out = ["--out", str(args.out), "--dtype", args.dtype, "--scale", repr(args.scale), "--seq", str(args.seq),
           "--device", args.device, "--repeats", str(args.repeats), "--repeat-s", repr(args.repeat_s),
           "--variants", ",".join(args.variants), "--max-memory-frac", repr(args.max_memory_frac),
           "--optimize-trials", str(args.optimize_trials), "--optimize-budget-s", repr(args.optimize_budget_s),
           "--cg-captures", str(args.cg_captures)]
    return (out + (["--tiny"] if args.tiny else []) + (["--warm-cache"] if args.warm_cache else [])
            + (["--lock-compiles"] if getattr(args, "lock_compiles", False) else []))


@dataclass
class _Job:
    """One child process: a model's variants (``kind`` "model") or its ``tctune optimize`` ("optimize")."""

    entry: Entry
    kind: str
    proc: Any = None
    err: Any = None
    t0: float = 0.0
    timeout: float = 0.0
    cache: str | None = None


def _start(job: _Job, args: argparse.Namespace, timeout: float, gpu: str | None, slots: list[str | None],
           need: int | None = None) -> None:
    """Start ``job``'s process in its own process group (so a kill reaches its compile workers) on ``gpu``:
    ``CUDA_VISIBLE_DEVICES``, the GPU's timing lock file and its process count, compile threads split over
    ``slots``."""
    flag = "--worker" if job.kind == "model" else "--worker-optimize"
    cmd = [sys.executable, str(Path(__file__).resolve()), flag, job.entry.name, *_child_args(args)]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    env.pop("ZOO_MEM_ESTIMATE", None)
    if need is not None:
        env["ZOO_MEM_ESTIMATE"] = str(need)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
        env["ZOO_GPU_LOCK"] = str(Path(args.out).resolve() / f".gpu-{gpu}.lock")
        env["ZOO_PROCS_PER_GPU"] = str(slots.count(gpu))
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, (os.cpu_count() or 1) // len(slots))))
    if not args.warm_cache:
        job.cache = tempfile.mkdtemp(prefix="zoo_cache_")
        env.update(TORCHINDUCTOR_CACHE_DIR=os.path.join(job.cache, "inductor"),
                   TRITON_CACHE_DIR=os.path.join(job.cache, "triton"))
    job.err = tempfile.TemporaryFile()
    job.t0, job.timeout = time.perf_counter(), timeout
    job.proc = subprocess.Popen(cmd, stdout=None, stderr=job.err, env=env, start_new_session=True)
    where = f" on GPU {gpu}" if gpu is not None else ""
    est = f", estimate {need / 2**30:.1f} GiB" if need is not None else ""
    print(f"[zoo] {job.entry.name}: {job.kind} started{where} (batch "
          f"{scaled_batch(job.entry.batch_size, args.scale)}, limit {timeout:.0f} s{est})", flush=True)


def _poll(job: _Job) -> tuple[bool, int | None]:
    """(finished, exit code or None when it was killed for its time limit)."""
    rc = job.proc.poll()
    if rc is not None:
        return True, rc
    if time.perf_counter() - job.t0 <= job.timeout:
        return False, None
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.proc.pid, signal.SIGKILL)  # this job's own process group only
    job.proc.wait()
    return True, None


def _finish(job: _Job, args: argparse.Namespace, rc: int | None) -> dict:
    """Complete the job's row from its exit (timeout or crash recorded with the reason); clean its cache."""
    wall = time.perf_counter() - job.t0
    job.err.seek(0)
    tail = job.err.read().decode(errors="replace")[-2000:]
    job.err.close()
    if job.cache:
        shutil.rmtree(job.cache, ignore_errors=True)
    entry = job.entry
    path = row_path(Path(args.out), entry.name, "" if job.kind == "model" else "optimize")
    row = json.loads(path.read_text()) if path.exists() else {
        "name": entry.name, "suite": entry.suite, "batch_size": scaled_batch(entry.batch_size, args.scale),
        "dtype": args.dtype, "variants": {}}
    if rc is None:
        row.update(status="timeout", reason=f"{job.kind} process killed after {job.timeout:.0f} s (running: "
                   f"{row.get('current') or 'start-up'})")
    elif rc != 0 or row.get("status") in (None, "running"):
        last = [ln for ln in tail.strip().splitlines() if ln.strip()]
        row.update(status="error", reason=f"{job.kind} process exited {rc}: {last[-1][:300] if last else 'no stderr'}")
    row["wall_s"] = round(wall, 1)
    _write_json(path, row)
    if job.kind == "model":
        print(f"[zoo] {entry.name}: {row.get('status')} in {wall:.0f} s"
              + (f" ({row.get('reason')})" if row.get("reason") else ""), flush=True)
    else:
        print(f"[zoo] {entry.name}: optimize {row.get('status')}, speedup vs best baseline "
              f"{_f(row.get('speedup_vs_best_baseline'))}"
              + (f" ({row.get('reason') or row.get('error')})" if row.get("status") != "ok" else ""), flush=True)
    return row


def _skip_row(args: argparse.Namespace, e: Entry, reason: str, params: int | None = None) -> dict:
    row = {"name": e.name, "suite": e.suite, "dtype": args.dtype, "variants": {},
           "batch_size": scaled_batch(e.batch_size, args.scale), "status": "skipped", "reason": reason}
    if params is not None:
        row["params"] = params
    _write_json(row_path(Path(args.out), e.name), row)
    return row


def run_all(entries: list[Entry], args: argparse.Namespace, plans: dict[str, Plan] | None = None,
            totals: dict[str, int | None] | None = None) -> list[dict]:
    """Run every entry's model job (and optimize job where asked) in fresh processes under the time limits.

    Slots come from :func:`gpu_slots` (``args.slots``). A free slot takes the first queued job that
    :func:`fits` its GPU's memory (``plans`` estimates against ``totals``, GPU -> bytes; not checked on the
    CPU), so a large model waits while smaller ones behind it start. No job starts with less than
    ``--min-model-s`` of ``--budget-s`` left; each gets ``min(its limit, what is left - 10 s)``. Models not
    started get ``skipped`` rows.

    Returns:
        The model rows of this call, in list order.
    """
    plans = plans or {}
    totals = totals or {}
    jobs = [_Job(e, "model") for e in entries if not args.no_variants]
    optimize = set(args.optimize or ())
    jobs += [_Job(e, "optimize") for e in entries if e.name in optimize]
    slots: list[str | None] = list(getattr(args, "slots", None) or [None])
    guard = args.device.startswith("cuda")
    active: dict[int, _Job] = {}
    rows: dict[str, dict] = {}
    skipped: list[str] = []
    need = lambda job: plans[job.entry.name].need if job.entry.name in plans else None  # noqa: E731
    while jobs or active:
        for i in [i for i in range(len(slots)) if i not in active]:
            if not jobs:
                break
            left = args.budget_s - (time.perf_counter() - _T0) if args.budget_s else math.inf
            if left < args.min_model_s:
                for job in jobs:
                    if job.kind == "model":
                        skipped.append(job.entry.name)
                        rows[job.entry.name] = _skip_row(args, job.entry, f"--budget-s: {left:.0f} s left")
                    else:
                        print(f"[zoo] {job.entry.name}: optimize not started (--budget-s: {left:.0f} s left)")
                jobs.clear()
                break
            gpu = slots[i]
            running = [need(j) for k, j in active.items() if slots[k] == gpu]
            pick = next((job for job in jobs if not guard or fits(need(job), running, totals.get(gpu),
                                                                  args.max_memory_frac)), None)
            if pick is None:
                continue  # this GPU is full for every queued job; wait for a process to end
            jobs.remove(pick)
            limit = args.model_timeout if pick.kind == "model" else args.optimize_budget_s + 120
            _start(pick, args, min(limit, left - 10), gpu, slots, need(pick))
            active[i] = pick
        for i, job in list(active.items()):
            done, rc = _poll(job)
            if done:
                row = _finish(job, args, rc)
                if job.kind == "model":
                    rows[job.entry.name] = row
                del active[i]
        if active:
            time.sleep(0.2)
    if skipped:
        print(f"[zoo] not started (budget): {len(skipped)}; run them with --models {','.join(skipped)}", flush=True)
    return [rows[e.name] for e in entries if e.name in rows]


# ------------------------------------------------------------------------------------------------ CLI


def add_model_args(p) -> None:
    """The options that say how zoo models are built (``--dtype``, ``--scale``, ``--seq``, ``--tiny``,
    ``--device``), shared by ``zoo.py``, ``zoo_ablate.py`` and ``zoo_profile.py``."""
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="low precision for every variant (default bf16)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every default batch size (rounded, >= 1)")
    p.add_argument("--seq", type=int, default=512, help="sequence-length cap for text models (default 512)")
    p.add_argument("--tiny", action="store_true", help="tiny Hugging Face configs (hidden 64, 2 layers, seq 32)")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu (a dry run)")

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="zoo.py", description="The tctune backend against Inductor on the Hugging Face / TIMM / torchvision "
        "models (random weights), one process per model. See the file's docstring for the method.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Examples:\n  zoo.py --slice 1/8 --out $OUT/zoo --budget-s 560\n"
               "  zoo.py --models BertForMaskedLM,resnet50 --optimize default --no-variants --out DIR\n"
               "  zoo.py --merge DIR1 DIR2 --merge-out benchmarks/results/zoo/latest.json")
    sel = p.add_argument_group("what to run")
    sel.add_argument("--models", help="comma-separated model names (see --list); default: the whole list")
    sel.add_argument("--suites", help="only these suites of the whole list: huggingface,timm,torchvision")
    sel.add_argument("--slice", help="i/n: run every n-th model of the selection starting at the i-th (1-based)")
    sel.add_argument("--list", action="store_true", help="print the selected models with batch sizes and exit")
    sel.add_argument("--variants", default=",".join(VARIANTS),
                     help=f"comma-separated variants to measure (default: {','.join(VARIANTS)}); fp32_eager, the "
                          "reference of every error, is always added. Optional, not in the default (one more "
                          "compile per model): tctune_fp32, the FP32 parity check of tctune's structural passes "
                          "(fp32_parity_rel_err in each row, a column and a count of models over "
                          f"{FP32_PARITY_TOL:g} in the summary). A leading + adds to the default: "
                          "--variants +tctune_fp32"),
    sel.add_argument("--no-variants", action="store_true", help="skip the variant measurement (with --optimize)")
    sel.add_argument("--optimize", help="comma-separated models (or 'default': "
                     f"{','.join(OPTIMIZE_DEFAULT)}) to also run `tctune optimize` on, when selected")
    how = p.add_argument_group("how")
    how.add_argument("--out", type=Path, help="output folder: rows/NAME.json per model (required unless --merge/--list)")
    add_model_args(how)
    how.add_argument("--repeats", type=int, default=5, help="timed repeats per variant; the median is kept (5)")
    how.add_argument("--repeat-s", type=float, default=0.05, help="target seconds per timed repeat (0.05)")
    how.add_argument("--cg-captures", type=int, default=3,
                     help="captures of each CUDA-graph variant, each timed; the median of their medians is kept (3)")
    how.add_argument("--max-memory-frac", type=float, default=0.8,
                     help="a model whose 8 bytes per parameter exceed this fraction of GPU memory is not built, and "
                          "models sharing a GPU start only while their memory estimates stay within it (0.8)")
    how.add_argument("--warm-cache", action="store_true",
                     help="keep the user's Inductor/Triton caches (default: a fresh cache folder per model)")
    how.add_argument("--lock-compiles", action="store_true",
                     help="each variant's compile (and first call) also holds its GPU's timing lock, so no "
                          "process compiles - Inductor benchmarks kernels on the GPU while compiling - while "
                          "another times, and compile seconds are not shared with other compiles on the GPU; "
                          "slower wall time (see zoo.timing_noisy)")
    how.add_argument("--optimize-trials", type=int, default=12, help="trials of each `tctune optimize` (12)")
    how.add_argument("--optimize-budget-s", type=float, default=150.0,
                     help="TuneConfig.timeout_s of each `tctune optimize`, seconds (150)")
    lim = p.add_argument_group("time limits")
    lim.add_argument("--model-timeout", type=float, default=300.0,
                     help="seconds before a model's process is killed (300); its row keeps what finished")
    lim.add_argument("--budget-s", type=float, default=None,
                     help="seconds for this whole call: no model starts with less than --min-model-s left")
    lim.add_argument("--min-model-s", type=float, default=60.0, help="see --budget-s (60)")
    lim.add_argument("--gpus", help="comma-separated GPU indices, one model process slot each; a GPU may repeat "
                     "(0,0,0,0: four processes share GPU 0; builds and compiles overlap, timed sections take turns "
                     "under a per-GPU lock file in --out). Inductor compile threads are split among all slots. "
                     "Default: one process at a time")
    lim.add_argument("--jobs-per-gpu", type=int, default=1,
                     help="repeat every --gpus entry this many times (on CUDA without --gpus: GPU 0) (1)")
    lim.add_argument("--order", choices=("size", "list"), default=None,
                     help="size: smallest parameter count first (default without --models); list: as selected "
                          "(default with --models)")
    lim.add_argument("--max-params", type=float, default=None,
                     help="write models above this many parameters (e.g. 2e9) as skipped rows (default: no limit)")
    mrg = p.add_argument_group("summary")
    mrg.add_argument("--merge", nargs="+", metavar="DIR", help="merge the rows under these folders and print the table")
    mrg.add_argument("--merge-out", type=Path, default=DEFAULT_MERGE_OUT,
                     help="where --merge writes (default benchmarks/results/zoo/latest.json)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-optimize", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.merge:
        try:
            latest = merge(args.merge)
        except ValueError as exc:
            p.error(str(exc))
        _write_json(Path(args.merge_out), latest)
        print(markdown(latest))
        print(f"\nwrote {args.merge_out} ({len(latest['models'])} models)")
        return 0
    extra = args.variants.startswith("+")
    args.variants = tuple(v.strip() for v in args.variants.lstrip("+").split(",") if v.strip())
    if extra:
        args.variants = VARIANTS + tuple(v for v in args.variants if v not in VARIANTS)
    bad = [v for v in args.variants if v not in ALL_VARIANTS]
    if bad:
        p.error(f"--variants: unknown {bad}; choose from {','.join(ALL_VARIANTS)}")
    if "fp32_eager" not in args.variants:
        args.variants = ("fp32_eager", *args.variants)  # the reference of every error
    if args.scale <= 0:
        p.error(f"--scale must be positive, got {args.scale}")
    if args.optimize == "default":
        args.optimize = OPTIMIZE_DEFAULT
    elif args.optimize:
        args.optimize = tuple(m.strip() for m in args.optimize.split(",") if m.strip())
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
        if args.device == "cpu" and not (args.worker or args.worker_optimize or args.list):
            print("[zoo] no CUDA device: measuring on the CPU (a dry run; CUDA-graph variants are skipped)", flush=True)
    try:
        args.slots = gpu_slots(args.gpus, args.jobs_per_gpu, args.device.startswith("cuda"))
    except ValueError as exc:
        p.error(str(exc))
    if args.worker or args.worker_optimize:
        entry = all_entries(include_test=True)[args.worker or args.worker_optimize]
        if args.worker:
            measure_model(entry, args)
        else:
            run_optimize(entry, args)
        return 0
    try:
        entries = select(args.models, args.slice, args.suites)
        if args.optimize:
            select(",".join(args.optimize))  # names checked here, one clear error
    except ValueError as exc:
        p.error(str(exc))
    if args.list:
        for e in entries:
            print(f"{e.name:<45} {e.suite:<12} {scaled_batch(e.batch_size, args.scale)}")
        return 0
    if args.out is None:
        p.error("--out DIR is required to measure (rows go to DIR/rows/)")
    order = args.order or ("list" if args.models else "size")
    plans: dict[str, Plan] = {}
    if order == "size" or args.max_params is not None or len(args.slots) > 1:
        t = time.perf_counter()
        plans = {e.name: plan_entry(e, args.tiny, args.seq, args.scale) for e in entries}
        print(f"[zoo] size estimates of {len(plans)} models in {time.perf_counter() - t:.0f} s", flush=True)
    entries, skip = order_and_limit(entries, plans, order, args.max_params)
    for e, reason in skip:
        _skip_row(args, e, reason, plans[e.name].params)
        print(f"[zoo] {e.name}: skipped ({reason})", flush=True)
    totals = {g: gpu_total_memory(g) for g in set(args.slots) if g is not None} if args.device.startswith(
        "cuda") else {}
    if any(t is None for t in totals.values()):
        print("[zoo] GPU memory size unknown (no NVML, no nvidia-smi): one model at a time per GPU", flush=True)
    rows = run_all(entries, args, plans, totals)
    if rows:
        print(short_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
