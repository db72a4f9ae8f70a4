"""``torch.compile(model, backend="tctune")``: tctune's graph passes in front of Inductor.

Route (torch 2.11-2.13). Dynamo hands a backend a graph of *torch-level* calls (``torch._C._nn.linear``,
``F.batch_norm``) whose parameters and buffers are lifted to graph inputs (``inline_inbuilt_nn_modules``, the
default since torch 2.5), plus one ``SymInt`` input per dynamic size. tctune's passes match the ATen ops that
``torch.export`` keeps whole (``aten.linear``, ``aten.conv2d``, ``aten.batch_norm``) and read weights from
``get_attr`` nodes. ``aot_autograd``'s forward graph is no use to them: ``aten.linear`` is already decomposed
into ``aten.t`` + ``aten.addmm`` there. So each Dynamo subgraph is **re-exported** with
``torch.export.export(strict=False)``, which gives exactly the IR the passes are written and tested for:

1. Every Dynamo input is classified: *runtime* tensors (the user's inputs), *weights* (tensors whose Dynamo
   source is a module parameter or buffer) and *sizes* (``SymInt`` inputs, recomputed from a runtime tensor's
   shape). Sizes that are symbolic in Dynamo's fake tensors are exported as ``Dim.DYNAMIC`` so the exported
   graph is as general as Dynamo's guards (``dynamic=True`` or automatic dynamic after a second batch size).
2. Inference (grad disabled, or no input requires grad): weights are **frozen** into the exported module as
   buffers (detached, sharing storage with the model), so they become ``get_attr`` nodes. The passes then
   fold BN, pad and cast them *once*, at compile time; each call passes the stored tensors to the compiled
   code, which Inductor is told are static inputs, as Dynamo's own parameters are (:func:`_weights_static`).
   Training: weights stay graph inputs (gradients reach the user's parameters), BN folding is skipped
   (``PassSpec.training``) and the precision pass casts them per call, FP32 master weights kept.
3. The rewritten ``GraphModule`` goes to Inductor's ``compile_fx``, which runs AOT autograd (backward
   included in training) and code generation. Its AOTAutograd cache key must be picklable and the same in
   every process (:func:`_strip_export_checks`, :func:`_stable_cache_key`), or each warm-cache compile redoes
   AOT tracing that plain ``torch.compile`` loads from its cache (issue #7). Per call, the compiled callable
   runs what plain Inductor's runs plus one Python function picking the runtime tensors (and Dynamo's size inputs
   of a dynamic graph, :func:`_bind_sizes`)
   (:func:`_runtime_caller`): frozen weights no node reads are deleted first (:func:`_drop_unused_weights`),
   and the graph gets a plain FX codegen (:func:`_plain_codegen`), so Inductor wraps no pytree code around it.

Writes in place. A graph that writes a tensor in place (``x.add_``, ``out.copy_``, ``cache[:, pos] = v``,
``index_copy_``, a BatchNorm left in train mode) goes through tctune's passes like any other: a buffer it writes
is not frozen (:func:`_written_weights`: it is exported again as a runtime input, named in the report's notes),
``passes.cast_precision`` never puts a cast copy between a write and the tensor written, and the fp16
calibration run writes copies. The writes land in the user's tensors as in eager.

A structural pass that raises on a graph (any pass but the casts) is left out of that subgraph: it is exported
again and compiled with the other passes, with a warning and a note naming the pass and its error
(:func:`_compile_without_failing_passes`). Any other exception in tctune's part (export, a cast pass) is logged
as a warning on the ``tctune`` logger with its reason (once per distinct reason), recorded in the
:class:`SubgraphReport`, and that subgraph is compiled by plain Inductor instead: tctune never breaks the user's
compile. The fallback keeps the requested precision: at
fp16 / bf16 Inductor compiles Dynamo's graph cast the way ``model.to(dt)`` would run it (floating inputs,
parameters and buffers cast to ``dt`` on entry, floating outputs cast back to their dtype), never the FP32 graph,
except a graph that writes a tensor from outside it in place (an input, a buffer: :func:`_writes_in_place`):
cast, its writes would land in copies, so it is compiled as written, with a note; and a graph that returns an
input or a view of one (:func:`_returns_inputs`) skips the ``model.to(dt)`` cast (the caller would get a new
tensor where eager returns a view it may write into) and goes under ``torch.autocast(dt)``. Under a ``passes=``
list with no cast pass (tctune's graph stays in the model's dtypes) the fallback is not cast either. A cast graph that
does not run on the first call's inputs (:func:`_check_runs`: Dynamo traced the FP32 model, so a dtype the model read
off a tensor is baked in as float32 and meets a cast tensor) is tried under ``torch.autocast(dt)`` instead
(:func:`_under_autocast`), and only when that does not run either is the model's own dtypes compiled, with
the reasons in the notes. Fill values beyond ``dt``'s range saturate in both cast graphs. Dynamo's restart
signals (:func:`_is_dynamo_restart`) are not failures: they go back to Dynamo, which traces the frame again, as
it does for plain Inductor.

fp16 overflow. fp16 holds at most 65504, and the backend has no calibration data of its own: at fp16 it runs
the overflow analysis (``passes.calibrate``) on the first call's inputs, which Dynamo hands the backend as real
tensors, before the casting passes, so ops whose activations come near 65504 stay FP32. When the inputs are
not real tensors (nothing to calibrate on), that subgraph is compiled at bf16 instead where the device has
bf16, with a warning; never silently at an uncalibrated fp16.

Measured rules (Inductor is the runtime, and nothing measures each graph as the search does). The default
pipeline is :data:`BACKEND_PIPELINE`: :data:`passes.PIPELINE` without the passes in :data:`INDUCTOR_SKIPS`
(``fuse_attention``: Inductor matches attention itself), each noted in the :class:`SubgraphReport` with its
reason; a pass named in ``passes=`` runs. And ``PassSpec.pad_graph_outputs`` is False: ``pad_linear_dims``
leaves the N of a linear the graph returns (an LM head's logits) unpadded, with its skip reason.

Frozen weights are a snapshot, taken again when they change under it: a subgraph whose frozen weights an
``optimizer.step()`` changed, or whose parameter was replaced (``m.fc.weight = nn.Parameter(w)``), compiles again
on its next call (the train / evaluate loop), and Dynamo, which does not guard which parameter objects it lifts,
may call one of its graphs with other modules' weights (a graph break inside a repeated layer, another instance
of the class): each set of weight objects gets its own tctune graph (:func:`_rebuilt_after_steps`). After
changing weights in place any other way (``load_state_dict``, ``p.data.copy_(...)``), call
``torch._dynamo.reset()`` (or compile again) so the padded / cast copies are rebuilt.

Options. ``torch.compile(m, backend="tctune", options={"precision": "bf16"})`` works: for a backend given by
name, torch 2.11-2.13 call it as ``backend(gm, example_inputs, options=options)``, or ``mode=mode`` when
``torch.compile(..., mode=...)`` is given. torch.compile refuses ``mode`` and ``options`` together ("Either mode
or options can be specified"), so with options write the mode among them: ``options={"precision": "bf16",
"mode": "max-autotune"}``. The callable form ``backend(precision="bf16", mode="max-autotune")`` does the same
without strings (a ``mode=`` given to ``torch.compile`` then overrides the callable's). The options are all
checked before anything is compiled: an unknown key or value raises one ``ValueError`` naming the option, its
valid values and the closest one (``precision must be fp32, tf32, fp16, bf16, fp8 or None, got 'bf17' (did you
mean 'bf16'?)``). ``backend(...)`` raises it at once. ``torch.compile(m, backend="tctune", options=...)`` cannot:
torch.compile hands a backend named by a string its options only when it compiles the first call, so that call
raises ``torch._dynamo.exc.BackendCompilerFailed`` ("backend='tctune' raised:" and the ``ValueError`` line;
the ``ValueError`` is its ``inner_exception``). The options:

- ``precision``: ``"fp32"``, ``"tf32"``, ``"fp16"``, ``"bf16"``, ``"fp8"`` or None (the hardware default).
  ``"fp8"`` casts linears to FP8 E4M3 GEMMs (``passes.cast_fp8``) on a GPU with FP8 Tensor Cores (sm_89 or
  newer, the inputs on it); elsewhere (the CPU, an older GPU, a training graph) it warns once and compiles at
  bf16, with the reason in ``SubgraphReport.notes``.
- ``fp8_keep``: at ``"fp8"``, ``fnmatch`` patterns of module paths whose linears stay bf16 (e.g.
  ``("*.output.dense", "classifier")``); ignored at other precisions.
- ``fp8_fast_accum``: at ``"fp8"``, True runs every FP8 GEMM with ``torch._scaled_mm``'s fast accumulation
  (``PassSpec.fp8_fast_accum``: Hopper's faster, less precise accumulation); False (default): full precision.
  The backend does not measure, so it never turns it on by itself (``tctune optimize`` decides it by
  measurement); ignored at other precisions.
- ``pad``: False turns off all three padding passes (``pad_linear_dims``, ``pad_matmul_dims``,
  ``pad_conv_channels``).
- ``output_dtype``: ``"fp32"`` (default: a ``torch.compile`` backend keeps the module's contract, so floating
  outputs come back in the FP32 model's dtypes, the up-cast compiled into the graph) or ``"compute"`` (floating
  outputs stay in the dtype they are computed in, as ``torch.compile(model.to(dt))`` returns them: no up-cast
  copy at the graph's end, which on MT5's 250k-class logits was 6.8 ms of a 7.5 ms gap to Inductor at bf16 on
  the H200, benchmarks/NOTES.md). Under ``"compute"`` a graph break hands the Python code between subgraphs
  low-precision tensors, as ``model.to(dt)`` would; the plain-Inductor fallback follows the same contract.
  The next subgraph takes them as they come: a floating input narrower than the graph's weights is cast up
  on entry (exact) for the re-export, and read in its own dtype again where the passes compute low
  (:func:`_entry_casts`; the report's notes name those inputs).
- ``target``, ``passes``, ``policy``: see :func:`backend`.
- ``mode``: torch.compile's mode (``"default"``, ``"reduce-overhead"``, ``"max-autotune"``,
  ``"max-autotune-no-cudagraphs"``; any mode ``torch._inductor.list_mode_options()`` knows): the Inductor
  config patches torch.compile would apply for it (``max_autotune``, ``coordinate_descent_tuning``,
  ``triton.cudagraphs``) are passed to ``compile_fx``. CUDA graphs and autotuning act on CUDA only; Inductor
  ignores them on the CPU.
- ``inductor``: a dict of extra Inductor config patches (``{"epilogue_fusion": False}``, keys as in
  ``torch._inductor.config``), applied over the mode's; an unknown key raises. Other keys are not forwarded
  to Inductor (a typo would be silently ignored): name Inductor settings inside ``inductor``.

torch.compile's own ``dynamic=`` and ``fullgraph=`` act before the backend, as with any backend; the mode and
Inductor patches also reach the plain-Inductor fallback. :func:`inductor_compile` is the one place the backend
calls Inductor (a seam for tests and tools).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import operator
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx.traceback as fx_traceback
from torch import fx

from passes import CASTS, PIPELINE, PassFailure, PassResult, run_pipeline
from passes._graph import METADATA_ONLY_WRITES, deferred_recompile, recompile, storage_of
from passes.calibrate import calibrate_ranges, overflow_nodes
from passes.policy import pass_spec

logger = logging.getLogger("tctune.backend")

__all__ = ["backend", "tctune_backend", "BackendConfig", "SubgraphReport", "last_results", "reports", "reset",
           "BACKEND_PIPELINE", "INDUCTOR_SKIPS", "inductor_compile", "inductor_patches", "PAD_PASSES"]

#: The pass results of the most recent subgraph tctune compiled (``[]`` after a fallback).
last_results: list[PassResult] = []
#: One report per subgraph compiled since the last :func:`reset` (most recent last, at most 256 kept).
#: ``torch._dynamo.reset()`` empties it too, through Dynamo's reset of the backends of the ``torch.compile``
#: calls made since its previous reset (each tctune backend has ``.reset``); a module compiled before an
#: earlier ``torch._dynamo.reset()`` that compiles again is not among them, so call :func:`reset` to be sure.
reports: list["SubgraphReport"] = []
_MAX_REPORTS = 256
#: Fallback reasons already warned about (each distinct reason is logged as a warning once).
_warned: set[str] = set()
_LOW_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

_OPTION_KEYS = ("precision", "pad", "target", "passes", "policy", "mode", "inductor", "fp8_keep", "output_dtype",
                "fp8_fast_accum")
#: Output-dtype contracts (``tctune.trial.OUTPUT_DTYPES``; not imported: this module imports ``passes`` only).
_OUTPUT_DTYPES = ("compute", "fp32")
_PRECISIONS = ("fp32", "tf32", "fp16", "bf16", "fp8")
#: Other spellings of the precisions (lower-cased first): torch's dtype names and the usual short forms.
_PRECISION_ALIASES = {"float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16",
                      "float8_e4m3fn": "fp8", "e4m3": "fp8"}


def _precision_name(precision: Any) -> Any:
    """``precision`` as one of :data:`_PRECISIONS` when it is another spelling of one (``"BF16"``,
    ``"bfloat16"``, ``torch.bfloat16``, ``torch.float8_e4m3fn``); anything else unchanged (the caller's check
    names it)."""
    name = str(precision).removeprefix("torch.") if isinstance(precision, torch.dtype) else precision
    if not isinstance(name, str):
        return precision
    low = name.strip().lower()
    return _PRECISION_ALIASES.get(low, low if low in _PRECISIONS else precision)


#: The passes ``pad=False`` turns off.
PAD_PASSES = ("pad_linear_dims", "pad_matmul_dims", "pad_conv_channels")


def _modes() -> tuple[str, ...]:
    from torch._inductor import list_mode_options

    return tuple(list_mode_options(None))


def inductor_patches(mode: str | None = None, inductor: dict | None = None) -> dict[str, Any]:
    """The Inductor config patches for ``mode`` (what ``torch.compile(mode=...)`` applies, from
    ``torch._inductor.list_mode_options(mode)``) with ``inductor`` applied over them.

    Raises:
        ValueError: an unknown mode, or an ``inductor`` key that ``torch._inductor.config`` does not have.
    """
    from torch._inductor import list_mode_options

    patches: dict[str, Any] = {}
    if mode is not None:
        if mode not in _modes():
            raise ValueError(f"mode must be one of {list(_modes())}, got {mode!r}")
        patches.update(list_mode_options(mode))
    if inductor:
        if not isinstance(inductor, dict):
            raise ValueError(f"inductor must be a dict of Inductor config patches, got {type(inductor).__name__}")
        import torch._inductor.config as inductor_config

        known = inductor_config.get_config_copy()
        unknown = sorted(k for k in inductor if k not in known)
        if unknown:
            raise ValueError(f"unknown Inductor option(s) {unknown} in inductor=...; the keys are torch._inductor."
                             f"config's (e.g. 'max_autotune', 'epilogue_fusion', 'triton.cudagraphs')")
        patches.update(inductor)
    return patches


def inductor_compile(gm: fx.GraphModule, example_inputs: Sequence[Any], config_patches: dict[str, Any]) -> Callable:
    """Compile ``gm`` with Inductor's ``compile_fx`` under ``config_patches`` (:func:`inductor_patches`);
    ``{}`` compiles with Inductor's current config. Every Inductor compile of the backend goes through here."""
    from torch._inductor.compile_fx import compile_fx

    if config_patches:
        return compile_fx(gm, list(example_inputs), config_patches=dict(config_patches))
    return compile_fx(gm, list(example_inputs))

#: Passes the backend leaves out of its default pipeline, each with the measured reason, recorded in every
#: :class:`SubgraphReport`'s notes. ``fuse_attention``: it turns hand-written attention into SDPA, and with a
#: relative-position bias or short windows SDPA's kernels are slower than the ones Inductor generates for the
#: same graph (Inductor also has its own SDPA pattern matcher). H200, bf16, pure policy, throughput as a
#: fraction of ``torch.compile(model.to(bf16))``'s, full backend pipeline -> without ``fuse_attention``:
#: swin_t 0.90 -> 0.97 (its 7 cuDNN SDPA calls took 1.6 ms of a 6.0 ms forward), visformer_small 0.91 -> 0.99
#: (benchmarks/results/zoo/2026-12-01-h200-ablate/swin_t.json, visformer_small.json).
INDUCTOR_SKIPS: dict[str, str] = {
    "fuse_attention": "Inductor matches attention itself; measured slower on swin_t and visformer_small "
                      "(H200 bf16; name it in passes= to run it)",
}


def _has_sites(pass_name: str, gm: fx.GraphModule) -> bool:
    """Whether a pass left out of the default pipeline (:data:`INDUCTOR_SKIPS`) had anything to do in ``gm``,
    so its note is worth a report line: ``fuse_attention`` fuses hand-written attention, which needs a softmax
    (a ResNet's report does not mention attention). Other passes: True."""
    if pass_name != "fuse_attention":
        return True
    return any(n.op == "call_function" and "softmax" in str(n.target) for n in gm.graph.nodes)


#: The backend's default pass order: :data:`passes.PIPELINE` without :data:`INDUCTOR_SKIPS`.
BACKEND_PIPELINE: tuple[str, ...] = tuple(n for n in PIPELINE if n not in INDUCTOR_SKIPS)


@dataclass(frozen=True)
class BackendConfig:
    """What the backend does to each subgraph.

    Attributes:
        precision: ``"fp32"``, ``"tf32"``, ``"fp16"``, ``"bf16"``, ``"fp8"``, or None for the hardware default
            (CPU: ``"fp32"``; a GPU: ``"bf16"`` where its Tensor Cores take bf16, else ``"fp16"``).
        pad: run the padding passes (:data:`PAD_PASSES`: Tensor Core alignment of linear N and K, matmul
            dimensions and conv channels); False removes all three.
        target: ``--target``-style name (``"h100"``, ``"sm_90"``) to plan for; None: the inputs' device.
        passes: pass names in order (default :data:`BACKEND_PIPELINE`, :data:`passes.PIPELINE` without
            :data:`INDUCTOR_SKIPS`; a pass named here runs); ``pad=False`` removes the padding passes.
        policy: cast policy (``passes.policy.POLICIES``): ``"autocast"`` keeps the FP32 keep-list, residual
            adds and embeddings in FP32 (autocast's accuracy); ``"pure"`` casts everything but losses, like
            ``model.half()`` (less memory traffic, ``model.half()``'s error).
        mode: torch.compile's mode, as Inductor config patches (:func:`inductor_patches`); None: default.
        inductor: extra Inductor config patches, over the mode's.
        fp8_keep: at ``"fp8"``, module-path patterns whose linears stay bf16.
        output_dtype: ``"fp32"`` (floating outputs in the FP32 model's dtypes) or ``"compute"`` (left in the
            dtype they are computed in, as ``torch.compile(model.to(dt))`` returns them).
        fp8_fast_accum: at ``"fp8"``, ``torch._scaled_mm``'s fast accumulation (default False).
    """

    precision: str | None = None
    pad: bool = True
    target: str | None = None
    passes: tuple[str, ...] | None = None
    policy: str = "autocast"
    mode: str | None = None
    inductor: dict | None = None
    fp8_keep: tuple[str, ...] = ()
    output_dtype: str = "fp32"
    fp8_fast_accum: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", _precision_name(self.precision))
        if self.precision is not None and self.precision not in _PRECISIONS:
            from tctune.errors import did_you_mean

            raise ValueError(f"precision must be fp32, tf32, fp16, bf16, fp8 or None, got {self.precision!r}"
                             + did_you_mean(self.precision, _PRECISIONS))
        if self.output_dtype not in _OUTPUT_DTYPES:
            raise ValueError(f"output_dtype must be 'fp32' (the model's output dtypes) or 'compute' (outputs left "
                             f"in the compute precision), got {self.output_dtype!r}")
        if isinstance(self.fp8_keep, str):
            raise ValueError(f"fp8_keep must be a list of patterns, got the string {self.fp8_keep!r} "
                             f"(write fp8_keep=[{self.fp8_keep!r}])")
        if not all(isinstance(p, str) for p in (self.fp8_keep or ())):
            raise ValueError(f"fp8_keep must be a list of fnmatch patterns (str), got {self.fp8_keep!r}")
        object.__setattr__(self, "fp8_keep", tuple(self.fp8_keep or ()))
        if not isinstance(self.fp8_fast_accum, bool):
            raise ValueError(f"fp8_fast_accum must be True or False, got {self.fp8_fast_accum!r}")
        inductor_patches(self.mode, self.inductor)  # raises on an unknown mode or Inductor key
        if not isinstance(self.pad, bool):
            raise ValueError(f"pad must be True or False, got {self.pad!r}")
        if self.passes is not None:
            if isinstance(self.passes, str):
                raise ValueError(f"passes must be a list of pass names, got the string {self.passes!r} "
                                 f"(write passes=[{self.passes!r}])")
            object.__setattr__(self, "passes", tuple(self.passes))
        from passes.policy import POLICIES

        if self.policy not in POLICIES:
            from tctune.errors import did_you_mean

            raise ValueError(f"policy must be {' or '.join(POLICIES)}, got {self.policy!r}"
                             + did_you_mean(self.policy, POLICIES))

    def pass_names(self) -> tuple[str, ...]:
        """The passes run on each subgraph, in order."""
        names = self.passes if self.passes is not None else BACKEND_PIPELINE
        return tuple(n for n in names if self.pad or n not in PAD_PASSES)

    def config_patches(self) -> dict[str, Any]:
        """The Inductor config patches of this configuration (:func:`inductor_patches`)."""
        return inductor_patches(self.mode, self.inductor)

    def left_out(self) -> dict[str, str]:
        """Passes of :data:`passes.PIPELINE` the default pipeline leaves out, with why (none when ``passes`` is
        given: the user chose)."""
        return dict(INDUCTOR_SKIPS) if self.passes is None else {}


@dataclass
class SubgraphReport:
    """What happened to one Dynamo subgraph.

    Attributes:
        precision: the compute precision used.
        training: True when weights stayed graph inputs (autograd needed).
        results: the pass results (empty after a fallback).
        fallback: the reason plain Inductor compiled this subgraph, or ``""``.
        frozen: names of the weights stored in the compiled graph (inference only).
        seconds: wall time of each step, in seconds: ``export`` (re-export of Dynamo's graph, its
            ``ExportedProgram.module()``), ``passes`` (tctune's pipeline, the clean-up after it and the graph's
            one code generation) and ``inductor`` (``compile_fx``: AOT autograd + code generation up to the
            first call; Triton kernels may still compile lazily on that call).
        pass_seconds: wall time of each pass of ``passes``, in seconds, by pass name (the fp16 calibration
            run, the clean-up and the one recompile are in ``passes`` but in no pass); empty after a
            fallback.
        policy: the cast policy used (``"autocast"`` or ``"pure"``).
        notes: what the backend decided beyond the passes, one line each: the fp16 calibration
            (``"fp16 calibrated on the first call's inputs: 2 op(s) kept FP32 for overflow"``), a switch to
            bf16, how a fallback was compiled (``"fallback compiled at bf16, cast like model.to(dt)"``), the
            inputs cast up on entry (``"inputs narrower than the graph's float32 cast up on entry (...):
            l_hidden_states_ bfloat16"``, :func:`_entry_casts`), the buffers a graph writes and so passes at
            every call (``"written in place, passed at every call (not frozen): w3_l_s_buffers_k_"``), a graph
            compiled again (first note: ``"compiled again: frozen weights changed since the last compile (an
            optimizer step or a new parameter)"``, :func:`_rebuilt_after_steps`), and
            each pass the default pipeline left out with its reason (``"fuse_attention not run: Inductor
            matches attention itself; ..."``, :data:`INDUCTOR_SKIPS`).

    ``summary()`` (also its ``repr``) gives all of that in one line.
    """

    precision: str
    training: bool
    results: list[PassResult] = field(default_factory=list, repr=False)
    fallback: str = ""
    frozen: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    pass_seconds: dict[str, float] = field(default_factory=dict)
    policy: str = "autocast"
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line: precision, policy, what each pass rewrote, fallback reason and step seconds."""
        fired = ", ".join(f"{r.name} {r.count}" for r in self.results if r.count) or "no rewrites"
        mode = "training" if self.training else "inference"
        head = f"{self.precision} ({self.policy} policy, {mode}): "
        body = f"plain Inductor ({self.fallback})" if self.fallback else fired
        secs = ", ".join(f"{k} {v:.2f} s" for k, v in self.seconds.items())
        notes = "".join(f"; {n}" for n in self.notes)
        return head + body + notes + (f"; {secs}" if secs else "")

    def __repr__(self) -> str:
        return f"SubgraphReport({self.summary()})"

    def count(self, pass_name: str) -> int:
        """Rewrites made by ``pass_name`` in this subgraph (0 when it did not run)."""
        return sum(r.count for r in self.results if r.name == pass_name)


def reset() -> None:
    """Forget the recorded reports (``last_results`` and ``reports``) and which fallbacks were warned about."""
    last_results.clear()
    reports.clear()
    _warned.clear()


def backend(
    precision: str | None = None,
    pad: bool = True,
    target: str | None = None,
    passes: Sequence[str] | None = None,
    policy: str = "autocast",
    mode: str | None = None,
    inductor: dict | None = None,
    fp8_keep: Sequence[str] = (),
    output_dtype: str = "fp32",
    fp8_fast_accum: bool = False,
    **unknown: Any,
) -> Callable[[fx.GraphModule, list], Callable]:
    """A ``torch.compile`` backend with these settings: ``torch.compile(m, backend=backend(precision="bf16"))``.

    Args:
        precision: compute precision (``"fp32"``, ``"tf32"``, ``"fp16"``, ``"bf16"``, ``"fp8"``; any case, or
            a ``torch.dtype`` such as ``torch.bfloat16``, or ``"half"`` / ``"bfloat16"``); None: hardware default.
            ``"fp8"`` without FP8 Tensor Cores (or in training) warns and runs bf16.
        pad: pad to the Tensor Core alignment (elements per dtype from the hardware): linear N and K, matmul
            dimensions, conv channels (:data:`PAD_PASSES`); False: none of the three.
        target: plan for this GPU (``"h100"``, ``"sm_90"``); None: the GPU the inputs are on, or the CPU.
        passes: pass names in order (default :data:`BACKEND_PIPELINE`: :data:`passes.PIPELINE` without
            ``fuse_attention``, which runs only when named here).
        policy: ``"autocast"`` (FP32 keep-list, residual adds and embeddings in FP32) or ``"pure"`` (all low
            precision except losses, as ``model.half()``).
        mode: torch.compile's mode (``"max-autotune"``, ``"reduce-overhead"``, ``"max-autotune-no-cudagraphs"``,
            ``"default"``), applied as its Inductor config patches; ``torch.compile(..., mode=...)`` overrides it.
        inductor: extra Inductor config patches (``torch._inductor.config`` keys), over the mode's.
        fp8_keep: at ``"fp8"``, ``fnmatch`` patterns of module paths whose linears stay bf16.
        output_dtype: ``"fp32"`` (default: floating outputs in the FP32 model's dtypes) or ``"compute"``
            (outputs left in the compute precision, the contract of ``torch.compile(model.to(dt))``).
        fp8_fast_accum: at ``"fp8"``, ``torch._scaled_mm``'s fast accumulation (faster on Hopper, less precise).

    Returns:
        ``compiler(gm, example_inputs) -> callable``, the signature Dynamo expects of a backend.

    Raises:
        ValueError: an unknown keyword (the message names the closest option), unknown precision, policy, mode,
            Inductor option or pass name (raised here, before any compile).
    """
    from passes import PASSES

    _check_keys(unknown)
    cfg = BackendConfig(precision=precision, pad=pad, target=target, passes=passes, policy=policy, mode=mode,
                        inductor=dict(inductor) if isinstance(inductor, dict) else inductor,
                        fp8_keep=fp8_keep if isinstance(fp8_keep, str) else tuple(fp8_keep or ()),
                        output_dtype=output_dtype, fp8_fast_accum=fp8_fast_accum)
    unknown = [n for n in cfg.pass_names() if n not in PASSES]
    if unknown:
        from tctune.errors import did_you_mean

        raise ValueError(f"unknown pass(es) {unknown}; known passes: {sorted(PASSES)}"
                         + "".join(did_you_mean(n, PASSES) for n in unknown))
    if target is not None:
        from tctune.errors import HardwareError, UsageError

        try:
            _hardware(target, True)
        except (HardwareError, UsageError) as exc:  # a user error: raised here, not a silent Inductor fallback
            raise ValueError(f"target {target!r}: {str(exc).splitlines()[0]}") from None

    def tctune(gm: fx.GraphModule, example_inputs: list, **kwargs: Any) -> Callable:
        return _compile(gm, example_inputs, _with_call_options(cfg, kwargs))

    tctune.reset = reset  # called by torch._dynamo.reset() (Dynamo resets a backend that has .reset)
    return tctune


def _with_call_options(cfg: BackendConfig, kwargs: dict) -> BackendConfig:
    """``cfg`` updated with what ``torch.compile`` passes a callable backend: ``mode=`` or ``options={...}``."""
    opts = dict(kwargs.get("options") or {})
    if kwargs.get("mode") is not None:
        opts["mode"] = kwargs["mode"]
    if not opts:
        return cfg
    _check_keys(opts)
    return dataclasses.replace(cfg, **opts)


def _check_keys(opts: dict) -> None:
    unknown = sorted(set(opts) - set(_OPTION_KEYS))
    if unknown:
        from tctune.errors import did_you_mean

        hint = "".join(did_you_mean(k, _OPTION_KEYS) for k in unknown)
        raise ValueError(f"unknown tctune backend option(s) {unknown}; known: {list(_OPTION_KEYS)} (Inductor "
                         "settings go inside inductor={...}; torch.compile's mode as mode=...)" + hint)


def tctune_backend(gm: fx.GraphModule, example_inputs: list, **options: Any) -> Callable:
    """The registered backend (entry point ``torch_dynamo_backends: tctune``).

    Accepts the settings of :func:`backend` either inside ``options={...}`` (what ``torch.compile(...,
    options=...)`` passes to a named backend) or as keyword arguments; ``mode=`` (what ``torch.compile(...,
    mode=...)`` passes) is honoured, as is ``"mode"`` inside ``options``.

    Raises:
        ValueError: an unknown option key or value (a user error, so it is not swallowed).
    """
    opts = dict(options.pop("options", None) or {})
    mode = options.pop("mode", None)
    opts.update(options)
    if mode is not None:
        opts["mode"] = mode
    _check_keys(opts)
    return backend(**opts)(gm, example_inputs)


tctune_backend.reset = reset  # called by torch._dynamo.reset(), as for backend(...)'s compilers


# ------------------------------------------------------------------------------------------------ internals


@functools.lru_cache(maxsize=8)
def _hardware(target: str | None, on_gpu: bool):
    from tctune import hardware

    if target is None and not on_gpu:
        return hardware._cpu_spec()
    return hardware.resolve(target)


def _default_precision(hw) -> str:
    if not hw.is_gpu:
        return "fp32"
    return "bf16" if "bf16" in hw.tensor_core_precisions else "fp16"


def _compile(gm: fx.GraphModule, example_inputs: list, cfg: BackendConfig, rebuild: bool = True,
             compile_inputs: list | None = None) -> Callable:
    """Compile one Dynamo subgraph (tctune's passes, else :func:`_fallback`) and record its report.

    ``rebuild``: wrap a graph with frozen weights in :func:`_rebuilt_after_steps`. ``compile_inputs``: what
    Inductor is given in place of ``example_inputs`` (a rebuild passes Dynamo's fake tensors: its symbolic
    sizes)."""
    _compiling[0] += 1
    try:
        return _compile_counted(gm, example_inputs, cfg, rebuild, compile_inputs)
    finally:
        _compiling[0] -= 1


def _compile_counted(gm: fx.GraphModule, example_inputs: list, cfg: BackendConfig, rebuild: bool,
                     compile_inputs: list | None) -> Callable:
    """:func:`_compile`'s body."""
    _warm_compile_pool()
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    training = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    report = SubgraphReport(precision=cfg.precision or "?", training=training, policy=cfg.policy)
    try:
        on_gpu = any(t.is_cuda for t in tensors)
        hw = _hardware(cfg.target, on_gpu)
        report.precision = cfg.precision or _default_precision(hw)
        if report.precision == "fp8":
            _fp8_or_bf16(report, hw, on_gpu, training)
        if training:
            logger.info("training graph (grad enabled, inputs require grad): eval-only passes skipped, "
                        "weights stay graph inputs")
        spec = _spec_for(hw, training, cfg.policy, report.precision, cfg.fp8_keep, cfg.output_dtype,
                         cfg.fp8_fast_accum)
        _restart_for_floats(gm.graph)
        compiled = _compile_without_failing_passes(gm, example_inputs, spec, cfg, report, hw, compile_inputs)
        # taken off the callable: the variants below hold the weights only weakly (a replaced one can be freed)
        frozen = getattr(compiled, "__dict__", {}).pop("_tctune_frozen", ()) if rebuild else ()
        if frozen:
            compiled = _rebuilt_after_steps(compiled, frozen, gm, cfg)
    except Exception as exc:  # noqa: BLE001 - never break the user's compile
        if _is_dynamo_restart(exc):
            raise  # Dynamo's own control flow (retrace the frame): plain Inductor raises it too
        reason = f"{type(exc).__name__}: {exc}"
        report.fallback = reason
        report.results = []
        report.pass_seconds = {}
        compiled = _fallback(gm, example_inputs, report, cfg.config_patches(), cfg.output_dtype,
                             casts=any(n in CASTS for n in cfg.pass_names()))
    _record(report)
    return compiled


#: Events of this process that may change a frozen weight (:func:`_count_steps`): optimizer steps, parameters and
#: buffers (re)assigned on any module.
_optimizer_steps = [0]
_step_hook: list = []
#: How many of the backend's own compiles are under way: the parameters and buffers they register (``_Frozen``,
#: ``ExportedProgram.module()``) are not the user's weights changing. Counted as one, each compile of a graph
#: broken inside repeated layers made the next layer's variant say "frozen weights changed".
_compiling = [0]


def _count_steps() -> None:
    """Count in :data:`_optimizer_steps` every ``optimizer.step()`` of the process (``torch.optim``'s global step
    hook) and every parameter or buffer assigned to a module (``m.fc.weight = nn.Parameter(...)``: torch.nn's
    global registration hooks). Registered once."""
    if _step_hook:
        return
    from torch.nn.modules import module as nn_module
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def bump(*args: Any) -> None:
        if not _compiling[0]:  # export's and the backend's own modules register buffers while compiling
            _optimizer_steps[0] += 1

    _step_hook.append(register_optimizer_step_post_hook(bump))
    for name in ("register_module_parameter_registration_hook", "register_module_buffer_registration_hook"):
        hook = getattr(nn_module, name, None)
        if hook is not None:
            _step_hook.append(hook(bump))


def _rebuilt_after_steps(run: Callable, weights: Sequence[tuple[int, torch.Tensor]], gm: fx.GraphModule,
                         cfg: BackendConfig) -> Callable:
    """``run`` (a subgraph compiled with frozen weights) behind the checks that the weights it froze are still
    the ones a call hands it: compiled again for other weight objects, or when an optimizer step changed them.

    Frozen weights are read once, at compile time: the passes store cast, padded, folded or fused copies of
    them in the compiled graph. Two ways the live weights left that snapshot behind, both silently wrong:

    - The usual training loop (``model.train()``, steps through the compiled module, then ``model.eval()`` and
      an evaluation under ``torch.no_grad()``, every epoch) compiled its inference graph at the first evaluation
      and kept evaluating those first weights: at bf16 the second epoch's evaluation was off by a relative
      error of 0.39, the third by 0.72 (plain Inductor reads the live weights). A parameter replaced by another
      (``m.fc.weight = nn.Parameter(w)``) was ignored the same way, at every precision.
    - Dynamo does not guard the identity of the parameters it lifts to graph inputs
      (``inline_inbuilt_nn_modules``): one compiled graph serves every module that runs the same code. With a
      graph break inside a repeated layer, Dynamo calls layer 1's graph with layer 2's parameters; so does a
      second instance of a compiled model's class. Layer 1's frozen weights then computed every layer (Hugging
      Face's HiggsAudioV2, whose decoder layers break on a data-dependent branch: FP32 logits off by 0.8 of their
      scale).

    So each set of weight objects (``weights``: ``(position among Dynamo's inputs, tensor frozen)``) gets its own
    compiled variant, built on its first call and kept while its weights live (weak references: a variant whose
    weight was replaced and freed is dropped when the counter below moves). Per call: the identity of the first
    and last weight against the current variant's, and one counter (:func:`_count_steps`: optimizer steps,
    parameters and buffers assigned) against the one the variant last saw; only when one differs are all the
    weights' ids looked up and, after the counter moved, their version counters compared. A changed weight
    compiles the variant again from the live weights (an info log and a new :class:`SubgraphReport` whose first
    note says why). Weights changed in place outside an optimizer (``load_state_dict``, ``p.data.copy_``) are
    not seen: call ``torch._dynamo.reset()`` after them.
    """
    import weakref

    from torch._dynamo.eval_frame import innermost_fn

    _count_steps()
    ctx = torch._guards.TracingContext.try_get()
    fakes = [n.meta.get("example_value") for n in _placeholders(gm)]
    positions = [i for i, _ in weights]
    first, last = positions[0], positions[-1]

    def variant(fn: Callable, live: list, frozen: bool) -> list:
        # [callable, weak references to the weights, their versions, counter seen, frozen (False: a fallback,
        # which reads the weights live)]
        return [innermost_fn(fn), [weakref.ref(w) for w in live], [w._version for w in live], _optimizer_steps[0],
                frozen]

    def rebuild(args: tuple, why: str) -> list:
        logger.info("tctune backend: %s: compiling the subgraph again", why)
        with torch._guards.tracing(ctx), torch.no_grad():
            inputs = [f if isinstance(f, (torch.Tensor, torch.SymInt)) and not isinstance(a, torch.nn.Parameter)
                      else a for f, a in zip(fakes, args)]
            fresh = _compile(gm, list(args), cfg, rebuild=False, compile_inputs=inputs)
        reports[-1].notes.insert(0, f"compiled again: {why}")
        frozen = bool(getattr(fresh, "__dict__", {}).pop("_tctune_frozen", ()))
        return variant(fresh, [args[i] for i in positions], frozen)

    variants = {tuple(id(w) for _, w in weights): variant(run, [w for _, w in weights], True)}
    current = [next(iter(variants.values()))]
    changed = ("frozen weights changed since the last compile (an optimizer step or a new parameter)")
    other = "called with other weights (a repeated layer or another instance of the module)"

    def call(*args: Any):
        v = current[0]
        refs = v[1]
        if args[first] is not refs[0]() or args[last] is not refs[-1]() or v[3] != _optimizer_steps[0]:
            moved = v[3] != _optimizer_steps[0]
            if moved:  # forget the variants of weights no longer alive (a replaced parameter)
                for k in [k for k, w in variants.items() if any(r() is None for r in w[1])]:
                    del variants[k]
            key = tuple(id(args[i]) for i in positions)
            v = variants.get(key)
            if v is not None and any(r() is not args[i] for r, i in zip(v[1], positions)):
                v = None  # an id reused by a new object
            if v is None:
                v = variants[key] = rebuild(args, changed if moved else other)
            elif v[3] != _optimizer_steps[0]:
                v[3] = _optimizer_steps[0]
                if v[4] and any(r()._version != n for r, n in zip(v[1], v[2])):
                    v = variants[key] = rebuild(args, changed)
            current[0] = v
        return v[0](*args)

    out = torch._dynamo.disable(call)
    out._tctune_report = getattr(run, "_tctune_report", None)  # type: ignore[attr-defined]
    return out


def _is_dynamo_restart(exc: BaseException) -> bool:
    """Whether ``exc`` is one of Dynamo's restart signals (``torch._dynamo.exc.RestartAnalysis`` and its
    subclasses), which a backend must let through: Dynamo catches them and traces the frame again.

    AOT autograd's ``tensorify_python_scalars`` raises ``TensorifyScalarRestartAnalysis`` from inside
    ``compile_fx`` when a Python float of the graph cannot become a tensor (a float computed from an
    ``.item()`` after a graph break); Dynamo then retraces with that float specialized and compiles again.
    Caught as a tctune failure, it made that subgraph fall back to plain Inductor, with
    ``"TensorifyScalarRestartAnalysis: "`` as the reason, where plain Inductor compiled the retraced graph."""
    try:
        from torch._dynamo.exc import RestartAnalysis
    except ImportError:  # pragma: no cover - other torch versions
        return False
    return isinstance(exc, RestartAnalysis)


def _spec_for(hw, training: bool, policy: str, precision: str, fp8_keep: Sequence[str] = (),
              output_dtype: str = "fp32", fp8_fast_accum: bool = False):
    """The passes' ``PassSpec`` for one subgraph (the one place the backend asks the hardware for it).

    ``pad_graph_outputs=False``: Inductor runs the graph, where padding the N of a returned linear measured
    slower (``passes.pad_linear``'s module docstring). ``restore_output_dtypes`` follows ``output_dtype``."""
    return pass_spec(hw, precision, training=training, policy=policy, pad_graph_outputs=False,
                     fp8_keep=fp8_keep if precision == "fp8" else (),
                     restore_output_dtypes=output_dtype == "fp32", fp8_fast_accum=fp8_fast_accum)


def _fp8_or_bf16(report: SubgraphReport, hw, on_gpu: bool, training: bool) -> None:
    """Keep ``report.precision == "fp8"`` where FP8 GEMMs can run (a GPU with FP8 Tensor Cores holding the
    inputs, inference); else switch it to bf16 with a warning (once per reason) and the reason in the notes."""
    if training:
        why = "fp8 is inference-only in tctune (a training graph)"
    elif not on_gpu:
        why = "fp8 needs FP8 Tensor Cores (sm_89 or newer) and the inputs are on the CPU"
    elif "fp8" not in hw.tensor_core_precisions:
        why = f"fp8 needs FP8 Tensor Cores (sm_89 or newer); {hw.name} has none"
    else:
        return
    report.precision = "bf16"
    report.notes.append(f"{why}: bf16 instead")
    if why not in _warned:
        _warned.add(why)
        logger.warning("tctune backend: %s; compiling at bf16 instead", why)


def _fallback(gm: fx.GraphModule, example_inputs: list, report: SubgraphReport,
              patches: dict[str, Any] | None = None, output_dtype: str = "fp32", casts: bool = True) -> Callable:
    """Plain Inductor for a subgraph tctune could not rewrite, at the requested precision (module docstring),
    its outputs under ``output_dtype``'s contract."""
    patches = patches or {}
    compile_fx = functools.partial(inductor_compile, config_patches=patches)

    dtype = _LOW_DTYPES.get("bf16" if report.precision == "fp8" else report.precision)
    how = "plain Inductor"
    compiled = None
    if dtype is not None and not casts:
        # ``passes=`` named no cast pass: tctune's own graph would have stayed in the model's dtypes (an FP32
        # parity run of the structural passes), and so does the fallback.
        report.notes.append(f"fallback compiled in the model's own dtypes, not at {report.precision}: the passes "
                            "named include no cast pass")
        how = "plain Inductor in the model's own dtypes (no cast pass named)"
        dtype = None
    if dtype is not None and _writes_in_place(gm):
        # Casting the inputs would give the writes copies to land in (an input, a buffer left unchanged).
        report.notes.append(f"fallback compiled in the model's own dtypes, not at {report.precision}: the graph "
                            "writes tensors in place")
        how = "plain Inductor in the model's own dtypes (the graph writes tensors in place)"
        dtype = None
    if dtype is not None:
        restore = output_dtype == "fp32"
        failed: list[str] = []
        # model.to(dt) first (what plain Inductor of the cast model runs); then torch.autocast over the FP32 graph,
        # for a graph that model.to(dt) cannot run: Dynamo traced it in FP32, so a dtype the model read off a
        # tensor (``attn.to(value.dtype)``, ``torch.tensor(x, dtype=q.dtype)``) is baked in as float32 and meets
        # a cast tensor in a matmul ("mat1 and mat2 must have the same dtype"); autocast casts both operands.
        ways = [("cast like model.to(dt)", _cast_like_model_to), ("under torch.autocast(dt)", _under_autocast)]
        if _returns_inputs(gm):
            # Inputs cast on entry, a returned input or view of one would be a new tensor: autocast keeps them.
            report.notes.append("fallback not cast like model.to(dt): the graph returns an input or a view of one")
            del ways[0]
        for label, make in ways:
            try:
                cast = make(gm, example_inputs, dtype, restore_outputs=restore)
                with _autocast_state_kept():  # a graph that fails inside its autocast region never exits it
                    _check_runs(cast, example_inputs)
                    compiled = compile_fx(cast, example_inputs)
            except Exception as exc:  # noqa: BLE001 - the next way, then the FP32 graph below, still compiles
                if _is_dynamo_restart(exc):
                    raise
                failed.append(f"{label}: {type(exc).__name__}: {exc}")
                compiled = None
                continue
            how = f"plain Inductor at {report.precision} ({label})"
            if failed:
                report.notes.append(f"fallback at {report.precision} failed ({failed[0]})")
            report.notes.append(f"fallback compiled at {report.precision}, {label}")
            kept = cast.meta.get("tctune_fp32_ops") or {}
            if kept:  # ops model.to(dt) could not run: computed in the model's own dtype
                report.notes.append("fallback kept FP32 (no low-precision kernel): "
                                    + "; ".join(f"{n}: {why}" for n, why in kept.items()))
            break
        if compiled is None:
            report.notes.append(f"fallback at {report.precision} failed ({'; '.join(failed)}); "
                                "compiled in the model's own dtypes")
            how = f"plain Inductor in the model's own dtypes ({report.precision} cast failed: {failed[-1]})"
    if compiled is None:
        compiled = compile_fx(gm, example_inputs)
    key = report.fallback.splitlines()[0] if report.fallback else ""
    if key not in _warned:
        _warned.add(key)
        logger.warning("tctune backend: falling back to %s for this subgraph (%s)", how, report.fallback)
    else:
        logger.debug("tctune backend: falling back to %s for this subgraph (%s)", how, report.fallback)
    return compiled


@contextlib.contextmanager
def _autocast_state_kept():
    """Restores every device's autocast state (enabled, dtype, nesting) on exit: a graph of
    :func:`_under_autocast` that raises between its ``_enter_autocast`` and ``_exit_autocast`` leaves autocast on,
    and the next compile (the model's own dtypes) would be traced under it."""
    devices = [d for d in ("cpu", "cuda", "xpu", "mps", "hpu") if _has_autocast(d)]
    saved = {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices}
    cache = torch.is_autocast_cache_enabled()
    nesting = _autocast_nesting()
    try:
        yield
    finally:
        for d, (enabled, dt) in saved.items():
            torch.set_autocast_enabled(d, enabled)
            torch.set_autocast_dtype(d, dt)
        torch.set_autocast_cache_enabled(cache)
        for _ in range(_autocast_nesting() - nesting):  # regions entered and never exited
            torch.autocast_decrement_nesting()
        if nesting == 0:
            torch.clear_autocast_cache()


def _autocast_nesting() -> int:
    """How many autocast regions are open (torch has no getter: one up and down again)."""
    depth = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return depth


def _has_autocast(device: str) -> bool:
    try:
        torch.is_autocast_enabled(device)
    except RuntimeError:  # a device type this build does not know
        return False
    return True


def _check_runs(cast: fx.GraphModule, example_inputs: list) -> None:
    """Run ``cast`` (the fallback's graph cast like ``model.to(dt)``) once, eagerly, on the first call's inputs,
    so that a cast graph that cannot run is never what the user gets: a model that converts a value to FP32
    itself before a linear (``self.b(h.float())``) runs under ``model.to(bf16)`` into "mat1 and mat2 must have
    the same dtype, but got Float and BFloat16", and the compiled fallback raised it at every call where plain
    Inductor ran the FP32 graph. Raises what the graph raises (the caller then compiles the model's own
    dtypes); nothing when an input is a fake tensor (nothing to run on). The random-number state is restored
    (a dropout in the graph draws its mask from it)."""
    from torch._subclasses.fake_tensor import is_fake

    tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    if any(is_fake(t) for t in tensors):
        return
    devices = sorted({t.device.index or 0 for t in tensors if t.is_cuda})
    with torch.random.fork_rng(devices=devices), torch.no_grad(), torch._guards.tracing(None):
        cast(*example_inputs)


#: Python's augmented assignments as Dynamo records them (``x &= m`` is ``operator.iand``), which write a tensor in
#: place; the other ``operator`` functions (``operator.and_`` is ``x & m``) do not, whatever their name ends with.
_INPLACE_OPERATORS = frozenset({"iadd", "iand", "iconcat", "ifloordiv", "ilshift", "imatmul", "imod", "imul", "ior",
                                "ipow", "irshift", "isub", "itruediv", "ixor"})


#: Dynamo-graph calls (functions, methods, ``operator.getitem``, ``getattr``: ``x.T``, ``x.mT``, ``x.data``) whose
#: result may be a view of their first argument: a write into it is a write into that argument
#: (:func:`_writes_in_place` walks back through them). Where Dynamo's example values are there, a result sharing
#: the storage of an input is an alias whatever the call (:func:`_from_outside`: ``x.float()`` of an FP32 ``x``).
_VIEW_CALLS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "getitem", "narrow", "select", "squeeze",
    "unsqueeze", "expand", "expand_as", "flatten", "unflatten", "t", "contiguous", "as_strided", "diagonal",
    "chunk", "split", "split_with_sizes", "tensor_split", "unbind", "detach", "movedim", "swapaxes", "swapdims",
    "unfold", "real", "imag", "view_as_real", "view_as_complex", "__getitem__", "alias", "getattr",
    "_get_data_attr", "moveaxis", "ravel", "adjoint", "hsplit", "vsplit", "dsplit", "atleast_1d", "atleast_2d",
    "atleast_3d", "broadcast_to",
})


def _writes_in_place(gm: fx.GraphModule) -> bool:
    """Whether Dynamo's graph ``gm`` may write in place a tensor from outside the graph (an input, a parameter or
    buffer, or a view of one): an in-place method or function (``x.add_``, ``torch.relu_``, ``index_copy_``,
    ``F.relu(x, inplace=True)`` or ``F.relu(x, True)``, ``x += y``), an item assignment (``x[i] = v``), an ``out=``
    argument, or a batch norm in training mode (its running statistics). A write into a tensor the graph made
    itself (an in-place ReLU after a convolution) is invisible outside and does not count: the fallback compiled
    every torchvision network with in-place activations in FP32. It only decides that the fallback compiles the
    graph uncast (:func:`_fallback`); a write through a call it does not know for a view, on a graph without
    example values, is taken for a fresh tensor's."""
    outside = _outside_storages(gm)
    return any(_from_outside(t, outside) for t in _write_targets(gm))


def _written_inputs(gm: fx.GraphModule) -> set[int]:
    """The positions of Dynamo's graph ``gm``'s placeholders it writes in place, themselves or through a view
    (:func:`_writes_in_place`'s reading of a write)."""
    places = [n for n in gm.graph.nodes if n.op == "placeholder"]
    by_storage = {}
    for i, n in enumerate(places):
        if (st := _storage(n)) is not None:
            by_storage.setdefault(st, set()).add(i)
    out: set[int] = set()
    for target in _write_targets(gm):
        for start in target if isinstance(target, (list, tuple)) else (target,):
            for arg in _view_chain(start):
                if (st := _storage(arg)) is not None:
                    out |= by_storage.get(st, set())
                if arg.op == "placeholder":
                    out.add(places.index(arg))
    return out


def _call_name(node: fx.Node) -> str:
    """The method name of a ``call_method`` node of Dynamo's graph, else its target's ``__name__`` (or ``""``)."""
    return str(node.target) if node.op == "call_method" else getattr(node.target, "__name__", "")


def _view_chain(arg: Any):
    """``arg`` (a node of Dynamo's graph) and each tensor it is a view of, back through :data:`_VIEW_CALLS`'
    first arguments, to the first node that is not such a call (an input, a fresh tensor)."""
    seen = 0
    while isinstance(arg, fx.Node) and seen < 10_000:
        yield arg
        if arg.op not in ("call_function", "call_method") or _call_name(arg) not in _VIEW_CALLS or not arg.args:
            return
        arg, seen = arg.args[0], seen + 1


def _write_targets(gm: fx.GraphModule):
    """The tensors (nodes, or tuples of them) that the calls of Dynamo's graph ``gm`` write in place
    (:func:`_writes_in_place`), wherever they come from."""
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        name = _call_name(node)
        targets: list = []
        if node.target is operator.setitem:
            targets = [node.args[0]]
        elif getattr(node.target, "__module__", None) == "_operator":  # operator.and_ is `&`; operator.iand `&=`
            targets = [node.args[0]] if name in _INPLACE_OPERATORS else []
        elif name.endswith("_") and not name.endswith("__") and name not in METADATA_ONLY_WRITES:
            targets = [node.args[0]] if node.args else list(node.kwargs.values())[:1]
        elif _inplace_flag(node):
            targets = [node.args[0] if node.args else node.kwargs.get("input")]
        elif name == "batch_norm" and (node.kwargs.get("training")
                                       or (len(node.args) > 5 and node.args[5] is True)):
            targets = [node.args[i] if len(node.args) > i else node.kwargs.get(k)
                       for i, k in ((1, "running_mean"), (2, "running_var"))]
        if "out" in node.kwargs:
            targets.append(node.kwargs["out"])
        yield from targets


def _inplace_flag(node: fx.Node) -> bool:
    """Whether the call ``node`` passes ``inplace=True``, by keyword or by position (``F.relu(x, True)``,
    ``F.leaky_relu(x, 0.2, True)``: bound to the function's signature)."""
    if node.kwargs.get("inplace") is True:
        return True
    if node.op != "call_function" or not callable(node.target):
        return False
    try:
        signature = inspect.signature(node.target)
    except (TypeError, ValueError):  # a builtin without a signature (torch.relu): no inplace argument
        return False
    if "inplace" not in signature.parameters:
        return False
    try:
        bound = signature.bind(*node.args, **node.kwargs)
    except TypeError:
        return False
    return bound.arguments.get("inplace") is True


def _storage(node: Any) -> Any:
    """A weak reference to the storage of Dynamo's example value of ``node`` (a fake tensor: a view shares its
    base's), or None (``passes._graph.storage_of``)."""
    return storage_of(node, "example_value") if isinstance(node, fx.Node) else None


def _outside_storages(gm: fx.GraphModule) -> set:
    """The storages of the example values of ``gm``'s inputs and attributes (:func:`_storage`)."""
    nodes = (n for n in gm.graph.nodes if n.op in ("placeholder", "get_attr"))
    return {s for s in map(_storage, nodes) if s is not None}


def _from_outside(arg: Any, outside: set = frozenset()) -> bool:
    """Whether ``arg`` (a node of Dynamo's graph, or a tuple of them) is an input of the graph, or a view of one:
    through :data:`_VIEW_CALLS`, or its example value sharing a storage of ``outside``
    (:func:`_outside_storages`)."""
    if isinstance(arg, (list, tuple)):
        return any(_from_outside(a, outside) for a in arg)
    return any(a.op in ("placeholder", "get_attr") or (outside and (s := _storage(a)) is not None and s in outside)
               for a in _view_chain(arg))


def _returns_inputs(gm: fx.GraphModule) -> bool:
    """Whether an output of Dynamo's graph ``gm`` is an input, a parameter or a buffer, or a view of one
    (:func:`_from_outside`): the caller holds an alias of its own tensor (code after a graph break writes into
    ``x[:, :2]``); cast like ``model.to(dt)``, it got a new tensor."""
    output = next((n for n in reversed(gm.graph.nodes) if n.op == "output"), None)
    outside = _outside_storages(gm)
    return output is not None and any(_from_outside(a, outside) for a in output.all_input_nodes)


def _op_name(node: fx.Node) -> str:
    """The op name of a call node as :func:`passes.cast_precision.no_low_precision_kernel` takes it: the ATen
    overload packet (``fft_fftn``) for an ATen op, the builtin's name for Dynamo's ``torch.fft.fftn``
    (``torch._C._fft.fft_fftn``), the method name for a ``call_method``; ``""`` for other nodes."""
    if node.op == "call_method":
        return str(node.target)
    if node.op != "call_function":
        return ""
    target = getattr(node.target, "_overloadpacket", None) or node.target
    return getattr(target, "__name__", "") or ""


def _under_autocast(gm: fx.GraphModule, example_inputs: list, dtype: torch.dtype,
                    restore_outputs: bool = True) -> fx.GraphModule:
    """A copy of Dynamo's graph ``gm`` run under ``torch.autocast(device, dtype)``, as Dynamo records an autocast
    region (``_enter_autocast`` after the inputs, ``_exit_autocast`` before the output); the device is the first
    tensor input's. Inputs, weights and constants keep their dtypes; autocast casts the operands of its
    low-precision ops (linear, matmul, convolution, SDPA) per call and runs its FP32 list (softmax, norms,
    losses) in FP32. Floating outputs not in their original dtype are cast back to it (``restore_outputs``).
    Fill values beyond ``dtype``'s range saturate to it (``passes.cast_precision.saturate_value_scalars``: an
    ``finfo(float32).min`` mask meets the bf16 scores of an autocast matmul). The fallback's second way
    (:func:`_fallback`)."""
    from torch.amp.autocast_mode import _enter_autocast, _exit_autocast

    from passes.cast_precision import saturate_value_scalars

    device = next((t.device.type for t in example_inputs if isinstance(t, torch.Tensor)), "cpu")
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    ctx = None
    for node in gm.graph.nodes:
        if node.op != "placeholder" and ctx is None:
            ctx = graph.call_function(_enter_autocast, (device, dtype, True, None))
        if node.op == "output":
            graph.call_function(_exit_autocast, (ctx,))

            def back(arg: fx.Node) -> fx.Node:
                val = arg.meta.get("example_value")
                if restore_outputs and isinstance(val, torch.Tensor) and val.is_floating_point():
                    return graph.call_method("to", (env[arg], val.dtype))  # a no-op where it already is
                return env[arg]

            graph.output(fx.node.map_arg(node.args[0], back))
            continue
        env[node] = graph.node_copy(node, lambda a: env[a])
        if node.op in ("call_function", "call_method"):
            saturate_value_scalars(env[node], _op_name(node), dtype)
    out = fx.GraphModule(gm, graph)
    out.meta.update(gm.meta)
    return out


def _cast_like_model_to(gm: fx.GraphModule, example_inputs: list, dtype: torch.dtype,
                        restore_outputs: bool = True) -> fx.GraphModule:
    """A copy of Dynamo's graph ``gm`` computing as ``model.to(dtype)`` would: every floating tensor input
    (user inputs, lifted parameters and buffers) cast to ``dtype`` on entry, every floating tensor output cast
    back to its original dtype (``restore_outputs``; False returns them as computed, as ``model.to(dtype)``
    does). Constants the model creates with an explicit dtype keep it, as they would.

    Ops with no fp16 / bf16 kernel (:func:`passes.cast_precision.no_low_precision_kernel`: the FFT family,
    LAPACK-style solvers), where ``model.to(dtype)`` itself would fail, compute in the model's own dtype: their
    real floating inputs are cast back to it (FP32), and what they return stays in it (a complex FFT result
    stays complex) until an op reads a real floating value of it, which gets it cast to ``dtype`` again. The
    kept ops are listed in the returned graph's ``meta["tctune_fp32_ops"]`` (``{node name: reason}``). Fill values
    beyond ``dtype``'s range (a ``torch.finfo(torch.float32).min`` mask, Dynamo having traced the FP32 model)
    saturate to it, as ``torch.finfo(dtype).min`` would have been under ``model.to(dtype)``."""
    from passes.cast_precision import no_low_precision_kernel, saturate_value_scalars

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = dict(zip(placeholders, example_inputs))
    full: set[fx.Node] = set()  # nodes whose value here is in the model's own dtype (a kept op and what follows)
    down: dict[fx.Node, fx.Node] = {}
    kept: dict[str, str] = {}

    def value(n: fx.Node) -> Any:
        return values[n] if n in values else n.meta.get("example_value")

    def real_float(v: Any) -> bool:
        return isinstance(v, torch.Tensor) and v.is_floating_point()

    for node in gm.graph.nodes:
        if node.op == "output":
            def back(arg: fx.Node) -> fx.Node:
                val = arg.meta.get("example_value")
                new = env[arg]
                if (restore_outputs and isinstance(val, torch.Tensor) and val.is_floating_point()
                        and val.dtype != dtype):
                    return graph.call_method("to", (new, val.dtype))
                return new

            graph.output(fx.node.map_arg(node.args[0], back))
            continue
        why = no_low_precision_kernel(_op_name(node)) if node.op in ("call_function", "call_method") else None
        if why:
            def own(arg: fx.Node) -> fx.Node:  # the kept op reads its real floating inputs in their own dtype
                val = value(arg)
                if arg in full or not real_float(val) or val.dtype == dtype:
                    return env[arg]
                return graph.call_method("to", (env[arg], val.dtype))

            new = graph.node_copy(node, own)
            full.add(node)
            kept[node.name] = why
        else:
            def low(arg: fx.Node) -> fx.Node:  # a real floating value of a kept op: back to dtype
                val = value(arg)
                if arg not in full or not real_float(val) or val.dtype == dtype:
                    return env[arg]
                if arg not in down:
                    down[arg] = graph.call_method("to", (env[arg], dtype))
                return down[arg]

            new = graph.node_copy(node, low)
            if node.op in ("call_function", "call_method"):  # finfo(float32).min fills: dtype's range
                saturate_value_scalars(new, _op_name(node), dtype)
            if any(a in full and not real_float(value(a)) for a in node.all_input_nodes):
                full.add(node)  # e.g. .real of a complex FFT result: in the model's dtype until read
        val = values.get(node)
        if isinstance(val, torch.Tensor) and val.is_floating_point() and val.dtype != dtype:
            new = graph.call_method("to", (new, dtype))
        env[node] = new
    out = fx.GraphModule(gm, graph)
    out.meta.update(gm.meta)
    out.meta["tctune_fp32_ops"] = kept
    return out


def _warm_compile_pool() -> None:
    """Start Inductor's Triton compile worker pool now, as torch's own ``inductor`` backend does before
    ``compile_fx``: until the pool is ready, kernels compile one at a time in this process."""
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError:  # pragma: no cover - other torch versions
        return
    try:
        maybe_warm_pool()
    except Exception as exc:  # noqa: BLE001 - a pool that cannot start only costs compile time
        logger.debug("could not warm Inductor's compile pool: %s", exc)


def _record(report: SubgraphReport) -> None:
    last_results[:] = report.results
    reports.append(report)
    del reports[:-_MAX_REPORTS]


@dataclass
class _Inputs:
    """Dynamo's inputs, sorted: runtime inputs (tensors, and ``int`` arguments tied to no tensor's size),
    frozen weights, and sizes recomputed from runtime shapes."""

    runtime: list[int]
    weights: dict[int, str]
    sizes: dict[int, tuple[int, int]]  # input index -> (runtime input index, dim)


def _placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _is_weight(node: fx.Node, value: Any) -> bool:
    """Whether Dynamo lifted this input from a module parameter or buffer."""
    if isinstance(value, torch.nn.Parameter):
        return True
    source = getattr(node.meta.get("grapharg"), "source", None)
    if source is None:
        return False
    try:
        from torch._dynamo.source import is_from_unspecialized_param_buffer_source

        if is_from_unspecialized_param_buffer_source(source):
            return True
    except ImportError:  # pragma: no cover - older torch
        pass
    name = source.name() if callable(getattr(source, "name", None)) else str(getattr(source, "name", ""))
    return "_parameters" in name or "_buffers" in name


def _classify(gm: fx.GraphModule, example_inputs: list, freeze: bool) -> _Inputs:
    nodes = _placeholders(gm)
    if len(nodes) != len(example_inputs):
        raise RuntimeError(f"{len(nodes)} placeholders but {len(example_inputs)} example inputs")
    out = _Inputs(runtime=[], weights={}, sizes={})
    symbolic: list[tuple[int, torch.SymInt]] = []
    for i, (node, value) in enumerate(zip(nodes, example_inputs)):
        if isinstance(value, torch.Tensor):
            if freeze and _is_weight(node, value):
                out.weights[i] = f"w{i}_{node.name}"
            else:
                out.runtime.append(i)
        elif isinstance(value, (int, torch.SymInt)):
            symbolic.append((i, node.meta.get("example_value", value)))
        else:
            raise RuntimeError(f"unsupported graph input {node.name}: {type(value).__name__}")
    tensors = list(out.runtime)
    for i, sym in symbolic:
        where = _find_size(sym, nodes, tensors)
        if where is None:  # an int argument of the user's (a step, a length): passed at every call
            out.runtime.append(i)
        else:
            out.sizes[i] = where
    out.runtime.sort()
    return out


def _find_size(sym: Any, nodes: list[fx.Node], runtime: list[int]) -> tuple[int, int] | None:
    """Which runtime tensor dimension carries the size ``sym`` (a SymInt graph input); None when none does.

    None is a Python ``int`` the model takes as an argument (``forward(x, n)``): Dynamo specializes it on the
    first call and, once a second value arrives, makes it a ``SymInt`` input of its own, tied to no tensor.
    :func:`_classify` makes it a runtime input, exported as a dynamic int (``Dim.DYNAMIC``); it used to be an
    error ("size input s86 is not a dimension of any runtime tensor input") and a fallback to plain Inductor."""
    expr = getattr(getattr(sym, "node", None), "expr", None)
    for j in runtime:
        fake = nodes[j].meta.get("example_value")
        for d, size in enumerate(getattr(fake, "shape", ())):
            if isinstance(size, torch.SymInt) and expr is not None and size.node.expr == expr:
                return j, d
    return None


def _restart_for_floats(graph: fx.Graph) -> None:
    """Raise Dynamo's ``TensorifyScalarRestartAnalysis`` after marking the unspecialized float inputs of Dynamo's
    ``graph`` that an op needs as Python numbers (:func:`_floats_passed_to_ops`) to be specialized; returns when
    there are none.

    Under ``dynamic=True`` (and automatic dynamic) Dynamo hands a Python float such as ``nn.LayerNorm``'s ``eps``
    to the backend as a 0-dim float64 input read by ``.item()``. Plain Inductor's ``tensorify_python_scalars``
    specializes a float that an op needs as a number and has Dynamo trace the frame again. tctune's re-export met
    it first: ``GuardOnDataDependentSymNode`` ("Could not guard on data-dependent expression zuf1"), the subgraph
    went to the fallback, whose own compile then raised Dynamo's restart (an export, a cast attempt and FX's
    printed tracebacks wasted per graph). Here, before the export, they are specialized the way Inductor does it
    (``TensorifyState``), all at once (one restart for a model's dozen LayerNorm ``eps``): the retraced graph has
    them as constants, with Dynamo's guards on their values; floats only used in tensor arithmetic stay inputs."""
    try:
        from torch._dynamo.exc import TensorifyScalarRestartAnalysis
        from torch._dynamo.symbolic_convert import TensorifyState
    except ImportError:  # pragma: no cover - other torch versions
        return
    names = [name for node in _floats_passed_to_ops(graph)
             if (name := _float_symbol(node)) is not None and not TensorifyState.should_specialize(name)]
    if not names:
        return
    for name in names:
        TensorifyState.specialize(name)
    logger.debug("tctune backend: float inputs %s specialized (ops need them as numbers); Dynamo traces again",
                 names)
    raise TensorifyScalarRestartAnalysis


def _input_name(node: fx.Node) -> str:
    """A graph input of Dynamo's as the model names it, for report notes: ``bn.running_mean`` for
    ``L['self']._modules['bn']._buffers['running_mean']``, ``x`` for ``L['x']`` and for ``L['kwargs']['x']`` (a
    keyword argument of ``module(**kwargs)``); Dynamo's node name when it
    recorded no source."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = getattr(source, "name", None)
    name = name() if callable(name) else name  # a property since torch 2.12, a method before
    if not isinstance(name, str):
        return node.name
    # the module the frame was called on (its first local) is implied: drop it before its own attributes
    name = re.sub(r"^L\['[^']*'\](?=\._(?:modules|parameters|buffers)\[)\.", "", name)
    name = re.sub(r"_(?:modules|parameters|buffers)\['([^']*)'\]", r"\1", name)
    name = re.sub(r"^L\['kwargs'\]\['([^']*)'\]", r"\1", name)  # a keyword argument of ``module(**kwargs)``
    return re.sub(r"^L\['([^']*)'\]", r"\1", name)


def _float_symbol(node: fx.Node) -> str | None:
    """Dynamo's symbol name of an unspecialized float input (``"zf3"``), else ``None``."""
    memo = getattr(node.meta.get("example_value"), "item_memo", None)
    return getattr(getattr(getattr(memo, "node", None), "_expr", None), "name", None)


#: Ops that take a Python float as a tensor operand (``x * scale``): Inductor keeps such a float an input.
_FLOAT_ARITHMETIC = frozenset({operator.add, operator.sub, operator.mul, operator.truediv, operator.neg,
                               operator.pow, torch.add, torch.sub, torch.mul, torch.div, "add", "sub", "mul", "div",
                               "__add__", "__sub__", "__mul__", "__truediv__", "__radd__", "__rsub__", "__rmul__",
                               "__rtruediv__"})


def _floats_passed_to_ops(graph: fx.Graph) -> list[fx.Node]:
    """The unspecialized float inputs of Dynamo's ``graph`` whose value (``.item()``, then any arithmetic on
    Python numbers) reaches an op other than tensor arithmetic (``layer_norm(..., eps)``, ``clamp(min=...)``):
    those an op needs as a number, as Inductor's ``tensorify_python_scalars`` finds them."""
    def reaches_an_op(ph: fx.Node) -> bool:
        todo, seen = [u for u in ph.users if u.target in ("item", torch.ops.aten.item.default)], set()
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            for u in n.users:
                if u.target not in _FLOAT_ARITHMETIC:
                    return True
                if not isinstance(u.meta.get("example_value"), torch.Tensor):  # still a number: follow it
                    todo.append(u)
        return False

    return [ph for ph in graph.find_nodes(op="placeholder") if _float_symbol(ph) is not None and reaches_an_op(ph)]


class _Frozen(torch.nn.Module):
    """Dynamo's graph called with weights stored as buffers and sizes read from the runtime tensors.

    One weight handed in as several inputs (a tied embedding / LM head, where Dynamo does not merge them) is
    one buffer object under each name: ``torch.export`` then reads it through one ``get_attr`` and the passes
    pad and cast it once (``passes.cast_precision``: tied weights stay one tensor).

    ``up`` (runtime position -> dtype): runtime tensors cast up to a wider floating dtype on entry
    (:func:`_entry_casts`); the exported graph still takes them in the dtype they arrive in. Those the graph
    writes in place (:func:`_written_inputs`) get the copy's final values written back (``copy_``), and an
    output that is the copy is returned as the caller's tensor: the writes reach the caller, as in eager."""

    def __init__(self, gm: fx.GraphModule, example_inputs: list, inputs: _Inputs,
                 up: dict[int, torch.dtype] | None = None) -> None:
        super().__init__()
        self.gm = gm
        self.n = len(example_inputs)
        self.inputs = inputs
        self.up = up or {}  # runtime position -> the wider dtype it is cast to on entry (:func:`_entry_casts`)
        written = _written_inputs(gm) if self.up else set()
        self.write_back = sorted(pos for pos in self.up if inputs.runtime[pos] in written)
        frozen: dict[int, torch.Tensor] = {}
        for i, name in inputs.weights.items():
            self.register_buffer(name, frozen.setdefault(id(example_inputs[i]), example_inputs[i].detach()))
        self.ties = _tied_sizes(gm, inputs.runtime)

    def forward(self, *runtime: torch.Tensor):
        # Sizes Dynamo gave one symbol (a square image's height and width, duck-sized) stay one symbol in the
        # export: each runtime dimension is its own ``Dim.DYNAMIC`` there (:func:`_dynamic_shapes`), and Swin's
        # window reshapes then made two-variable guards whose simplification took most of a 305 s export (129 s
        # tied; tiny Swin, CPU, benchmarks/NOTES.md). Dynamo's guards already hold them equal on every call.
        for (p1, d1), (p2, d2) in self.ties:
            torch._check(runtime[p1].shape[d1] == runtime[p2].shape[d2])
        args: list[Any] = [None] * self.n
        for pos, i in enumerate(self.inputs.runtime):
            args[i] = runtime[pos].to(self.up[pos]) if pos in self.up else runtime[pos]
        for i, name in self.inputs.weights.items():
            args[i] = getattr(self, name)
        for i, (j, d) in self.inputs.sizes.items():
            args[i] = args[j].shape[d]
        # Node by node, each Dynamo node's metadata current while its ops are traced: the exported nodes inherit
        # its ``nn_module_stack`` (the model's module paths, which ``fp8_keep`` patterns and the calibration's
        # reasons name) and its ``stack_trace`` (the model's source lines). Called as code, export would record
        # only this wrapper as every node's module.
        with fx_traceback.preserve_node_meta():
            out = fx.Interpreter(self.gm).run(*args)
        if not self.write_back:
            return out
        # An input cast up on entry and written in place: the writes went to the FP32 copy; they go back to the
        # caller's tensor (rounded once to its dtype), and an output that is the copy, or a view of it, is the
        # caller's tensor or the same view of it (the copy has its strides: ``to`` preserves them).
        copies: dict[int, torch.Tensor] = {}
        for pos in self.write_back:
            copy = args[self.inputs.runtime[pos]]
            runtime[pos].copy_(copy)
            if copy.stride() == runtime[pos].stride():
                copies[id(copy)] = runtime[pos]

        def caller(o: Any) -> Any:
            if not isinstance(o, torch.Tensor):
                return o
            if id(o) in copies:
                return copies[id(o)]
            base = copies.get(id(o._base)) if o._base is not None else None
            return o if base is None else base.as_strided(o.size(), o.stride(), o.storage_offset())

        return type(out)(caller(o) for o in out) if isinstance(out, (list, tuple)) else caller(out)


def _concrete(value: Any) -> Any:
    """``value`` as ``torch.export`` takes an example input: a ``SymInt`` (Dynamo's example of an ``int``
    argument made dynamic) as its hint, the value of this call; anything else as it is."""
    if isinstance(value, torch.SymInt):
        hint = getattr(value.node, "hint", None)
        if hint is None:
            raise RuntimeError(f"int input {value} has no example value to export with")
        return int(hint)
    return value


def _still_symbolic(size: Any) -> bool:
    """Whether a size in Dynamo's fake tensors is still symbolic after its guards (``dynamic=True`` marks
    every dimension, then guards specialize e.g. the channels a conv weight fixes)."""
    return isinstance(size, torch.SymInt) and not getattr(_size_expr(size), "is_number", False)


def _size_expr(size: torch.SymInt) -> Any:
    """The sympy expression of a Dynamo size after its guards' replacements."""
    node = size.node
    return node.shape_env.replace(node.expr) if getattr(node, "shape_env", None) is not None else node.expr


def _tied_sizes(gm: fx.GraphModule, runtime: list[int]) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Pairs ``((pos, dim), (pos, dim))`` of runtime-input dimensions whose Dynamo size is the same symbolic
    expression (after its guards' replacements), each tied to the first dimension that carries it."""
    nodes = _placeholders(gm)
    first: dict[Any, tuple[int, int]] = {}
    ties = []
    for pos, i in enumerate(runtime):
        fake = nodes[i].meta.get("example_value")
        for d, size in enumerate(getattr(fake, "shape", ())):
            if not _still_symbolic(size):
                continue
            expr = _size_expr(size)
            if expr in first:
                ties.append((first[expr], (pos, d)))
            else:
                first[expr] = (pos, d)
    return ties


def _dynamic_shapes(nodes: list[fx.Node], runtime: list[int]) -> tuple | None:
    """``Dim.DYNAMIC`` for every dimension Dynamo made symbolic; None when everything is static."""
    specs: list[Any] = []
    for i in runtime:
        fake = nodes[i].meta.get("example_value")
        if isinstance(fake, (int, torch.SymInt)):  # an int argument (:func:`_find_size`)
            specs.append(torch.export.Dim.DYNAMIC if _still_symbolic(fake) else None)
            continue
        dims = {d: torch.export.Dim.DYNAMIC for d, s in enumerate(getattr(fake, "shape", ())) if _still_symbolic(s)}
        specs.append(dims or None)
    return tuple(specs) if any(specs) else None


#: Bits of the real floating dtypes :func:`_entry_casts` compares (fp16 and bf16 are equally narrow: neither
#: holds the other exactly, so neither is cast to the other).
_FLOAT_BITS = {torch.float16: 16, torch.bfloat16: 16, torch.float32: 32, torch.float64: 64}


def _entry_casts(example_inputs: list, runtime: list[int]) -> dict[int, torch.dtype]:
    """Runtime inputs to cast up on entry: ``{position in runtime: dtype}``.

    A subgraph's inputs need not be in the dtype Dynamo's graph can run in. Under ``output_dtype="compute"`` a
    subgraph returns its activations in the compute dtype (bf16), and after a graph break the next subgraph
    receives them beside the model's FP32 parameters: Dynamo traces that frame anyway (its fake-tensor
    ``linear(bf16, fp32)`` returns FP32 without a dtype check, torch 2.13), but the graph is not runnable as it
    stands (eager raises "mat1 and mat2 must have the same dtype"), and its re-export fails in the first
    batched matmul ("expected scalar type torch.bfloat16 but found torch.float32": Longformer's encoder).
    The backend cannot return FP32 for such outputs instead: a subgraph's outputs are the same whether they go
    on to the next subgraph or to the user, and the user's are the large ones (logits) ``"compute"`` exists
    to leave low. So the receiving subgraph takes them as they come: each floating runtime tensor narrower
    than the widest floating input of the graph (parameters, buffers and runtime tensors: the model's own
    dtype, FP32) is cast up to it on entry, which is exact (every fp16 / bf16 value is an FP32 value). The
    graph is then exported as the FP32 model runs it, and the precision passes cast it as they cast any FP32
    graph; :func:`_drop_round_trips` removes the cast back to the arriving dtype they put after the up-cast,
    so a bf16 activation read by a bf16 op is read as it came, with no FP32 copy.

    The target is FP32, never float64, and only fp16 / bf16 inputs are cast: a float64 input is no evidence of
    the model's dtype. Dynamo hands a Python ``float`` argument over as a 0-dim float64 tensor, and a model may
    keep one submodule in float64 (``nn.Linear(...).double()`` on a ``.double()``'d activation); taking the
    widest dtype as the target cast the FP32 activations up to float64 in front of FP32 linears ("mat1 and mat2
    must have the same dtype, but got Double and Float"), a fallback at fp16 / bf16 and an error at fp32.

    Args:
        example_inputs: Dynamo's example inputs (tensors, ints, SymInts).
        runtime: the indices of ``example_inputs`` passed at every call (:class:`_Inputs` ``runtime``).

    Returns:
        ``{k: torch.float32}`` for the ``k``-th runtime input when it is fp16 / bf16 and the graph has an FP32
        input; empty otherwise (the usual case: one subgraph, or ``output_dtype="fp32"``).
    """
    floats = {t.dtype for t in example_inputs if isinstance(t, torch.Tensor) and t.dtype in _FLOAT_BITS}
    if torch.float32 not in floats:
        return {}
    wide = torch.float32  # never float64: see the docstring
    out = {}
    for pos, i in enumerate(runtime):
        t = example_inputs[i]
        if isinstance(t, torch.Tensor) and _FLOAT_BITS.get(t.dtype, 99) < _FLOAT_BITS[wide]:
            out[pos] = wide
    return out


def _mark_entry_casts(exported: fx.GraphModule, up: dict[int, torch.dtype]) -> dict[fx.Node, fx.Node]:
    """Flag the exported graph's entry up-casts (:func:`_entry_casts`) as casts tctune inserted, so that
    ``passes.cast_precision`` treats their output as an FP32 graph input, not as an up-cast the model wrote
    (an explicit FP32 value keeps the ops that read only it in FP32). Returns ``{cast node: placeholder}``."""
    from passes.cast_precision import INSERTED_CAST

    places = _placeholders(exported)
    marked: dict[fx.Node, fx.Node] = {}
    for pos in up:
        if pos >= len(places):
            raise RuntimeError(f"exported graph has {len(places)} inputs; entry cast of input {pos} not found")
        for user in places[pos].users:
            if user.op == "call_function" and _is_cast_to(user, up[pos]):
                user.meta[INSERTED_CAST] = True
                marked[user] = places[pos]
    return marked


def _is_cast_to(node: fx.Node, dtype: torch.dtype) -> bool:
    """Whether ``node`` is a plain dtype conversion (``aten._to_copy`` / ``aten.to``, no other argument) to
    ``dtype``."""
    packet = getattr(node.target, "_overloadpacket", None)
    if packet not in (torch.ops.aten._to_copy, torch.ops.aten.to):
        return False
    kwargs = dict(node.kwargs)
    given = kwargs.pop("dtype", None)
    if given is None and len(node.args) >= 2 and isinstance(node.args[1], torch.dtype):
        given = node.args[1]
    return given == dtype and len(node.args) <= 2 and not {k for k, v in kwargs.items() if v not in (None, False)}


def _drop_round_trips(exported: fx.GraphModule, marked: dict[fx.Node, fx.Node]) -> int:
    """Read an input as it arrived where the passes cast its entry up-cast straight back to its own dtype
    (``x.to(float32).to(bfloat16)`` is ``x``, exactly); drop the up-casts left unread. A cast back that is a
    graph output or is written in place stays (the input itself must not be returned or mutated). Returns how
    many readers now take the input itself."""
    dropped = 0
    for cast, place in marked.items():
        val = place.meta.get("val")
        dtype = getattr(val, "dtype", None)
        for user in list(cast.users):
            if (user.op == "call_function" and user.args and user.args[0] is cast and _is_cast_to(user, dtype)
                    and not any(_returns_or_writes(reader) for reader in user.users)):
                user.replace_all_uses_with(place)
                exported.graph.erase_node(user)
                dropped += 1
        if not cast.users:
            exported.graph.erase_node(cast)
    if dropped or marked:
        exported.graph.lint()
        recompile(exported)
    return dropped


def _returns_or_writes(node: fx.Node) -> bool:
    """Whether ``node`` is the graph's output or an op that writes one of its inputs (an ``add_``, a ``copy_``)."""
    if node.op == "output":
        return True
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


@contextlib.contextmanager
def _no_stack_traces():
    """Within the block, FX tracers record no ``node.meta["stack_trace"]`` (``torch.fx.config.
    do_not_emit_stack_traces``, where this torch has it; else nothing changes).

    The re-export traces Dynamo's generated graph code through :class:`_Frozen`, so the stack each exported node
    would record is the backend's frames and Dynamo's ``<eval_with_key>`` code, not the user's model source
    (Dynamo's own graph keeps those). Recording it costs a Python traceback capture and symbolization per node:
    on the CPU, tiny T5 (345 Dynamo nodes), the re-export took 0.58 / 0.58 -> 0.43 / 0.41 s of process CPU
    time (two runs, median of 5 compiles each; benchmarks/NOTES.md, "the backend's compile time beyond
    Inductor, CPU measurement"). Passes and Inductor never read the key; the graph is the same."""
    config = getattr(torch.fx, "config", None)
    if config is None or not hasattr(config, "do_not_emit_stack_traces"):
        yield
        return
    old = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = old


def _compile_without_failing_passes(gm, example_inputs, spec, cfg: BackendConfig, report: SubgraphReport,
                                   hw: Any = None, compile_inputs: list | None = None) -> Callable:
    """:func:`_compile_with_passes`; when a structural pass (any but the casts) raises, export again and run the
    others without it, with a warning and a note naming the pass and its error, rather than losing every pass
    to the fallback (a pass that cannot handle a graph must not cost the rest of the pipeline). A cast pass that
    raises, or any other error, propagates (the caller falls back)."""
    failed: dict[str, str] = {}
    notes = list(report.notes)
    while True:
        try:
            compiled = _compile_with_passes(gm, example_inputs, spec, cfg, report, hw, compile_inputs,
                                            without=tuple(failed))
            break
        except PassFailure as exc:
            name = getattr(exc, "pass_name", None)
            if name is None or name in CASTS or name in failed:
                raise
            failed[name] = str(exc)
            logger.warning("tctune backend: %s; compiling this subgraph without %s", exc, name)
            report.notes[:] = notes
            report.results = []
    for name, why in failed.items():
        report.notes.append(f"{name} left out: it failed on this graph ({why})")
    return compiled


def _compile_with_passes(gm, example_inputs, spec, cfg: BackendConfig, report: SubgraphReport,
                         hw: Any = None, compile_inputs: list | None = None, without: tuple = ()) -> Callable:
    """Export ``gm`` again, run ``cfg``'s passes on it (but those named in ``without``) and compile it with
    Inductor; returns the runtime caller. Raises what export, a pass (``PassFailure``) or Inductor raise."""
    inputs = _classify(gm, example_inputs, freeze=not spec.training)
    nodes = _placeholders(gm)
    # Export and passes run outside Dynamo's tracing context: its guards and symbols must not leak into Dynamo's,
    # and the passes' fake tensors are export's (Dynamo's fake mode cannot mix with them).
    # One code generation for all of tctune's rewrites (export's checks removed, the passes, the round-trip
    # casts, the plain codegen): each step marks the module, the block's end recompiles it once.
    t0 = time.perf_counter()
    with deferred_recompile(), torch._guards.tracing(None):
        exported, runtime_args, up = _export(gm, example_inputs, inputs, nodes, data_as_detach=not spec.training)
        written = _written_weights(exported, inputs)
        if written:
            # A buffer the graph writes (running statistics, a KV cache): frozen, the passes would fold, pad or
            # cast a snapshot of it and the writes would land in a copy. It becomes a runtime input; export again.
            report.notes.append("written in place, passed at every call (not frozen): "
                                + ", ".join(_input_name(nodes[i]) for i in sorted(written)))
            for i in written:
                del inputs.weights[i]
            inputs.runtime = sorted(inputs.runtime + sorted(written))
            exported, runtime_args, up = _export(gm, example_inputs, inputs, nodes, data_as_detach=not spec.training)
        marked = _mark_entry_casts(exported, up)
        if up:
            report.notes.append(
                "inputs narrower than the graph's " + str(next(iter(up.values()))).replace("torch.", "")
                + " cast up on entry (a previous subgraph's compute-dtype outputs): "
                + ", ".join(_input_name(nodes[inputs.runtime[k]]) + " "
                            + str(runtime_args[k].dtype).replace("torch.", "") for k in up))
        report.frozen = sorted(inputs.weights.values())
        t1 = time.perf_counter()
        report.seconds["export"] = round(t1 - t0, 3)
        names = tuple(n for n in cfg.pass_names() if n not in without)
        pass_s: dict[str, float] = {}
        if spec.precision == "fp16":
            # Overflow analysis on the first call's inputs, before the casting passes (module docstring).
            cut = next((i for i, n in enumerate(names) if n in CASTS), len(names))
            report.results = run_pipeline(exported, spec, names[:cut], seconds=pass_s)
            spec = _calibrate_fp16(exported, runtime_args, spec, report, hw, cfg.policy)
            report.results += run_pipeline(exported, spec, names[cut:], seconds=pass_s)
        else:
            report.results = run_pipeline(exported, spec, names, seconds=pass_s)
        _drop_round_trips(exported, marked)
        _drop_unused_weights(exported)
        # Dynamo's size inputs, handed on to Inductor as unused inputs of a plain graph (:func:`_bind_sizes`)
        sizes = _bind_sizes(exported, inputs) if _plain_codegen(exported) else []
    t2 = time.perf_counter()
    report.seconds["passes"] = round(t2 - t1, 3)
    report.pass_seconds = {n: round(v, 4) for n, v in pass_s.items()}
    for r in report.results:
        logger.debug("tctune pass %s: %d rewrites, %d skipped", r.name, r.count, len(r.skipped))
    _stable_cache_key(exported)
    _weights_static(exported, gm)
    given = example_inputs if compile_inputs is None else compile_inputs
    compiled = inductor_compile(exported, [*(given[i] for i in inputs.runtime), *(given[i] for i in sizes)],
                                cfg.config_patches())
    report.seconds["inductor"] = round(time.perf_counter() - t2, 3)
    run = _runtime_caller(compiled, inputs.runtime + sizes)
    # Only once tctune's graph compiled: a fallback runs no pass, so it has none to explain.
    report.notes.extend(f"{n} not run: {why}" for n, why in cfg.left_out().items() if _has_sites(n, exported))
    run._tctune_report = report  # type: ignore[attr-defined]
    run._tctune_frozen = [(i, example_inputs[i]) for i in inputs.weights]  # type: ignore[attr-defined]
    return run


def _weights_static(exported: fx.GraphModule, gm: fx.GraphModule) -> None:
    """Let Inductor treat the frozen weights of ``exported`` as static inputs, as it treats the parameters of
    Dynamo's own graph. AOT autograd lifts ``exported``'s parameters and buffers to graph inputs and marks them
    static only for a module it knows came from Dynamo (``meta["dynamo_compile_id"]``; without Dynamo's
    ``_param_name_to_source`` it takes the lifted parameters and buffers); ``ep.module()`` drops that meta, so
    every weight reached Inductor as an ordinary input: checked for alignment at every call and, under
    ``mode="reduce-overhead"``, copied into the CUDA graph's own input buffers at every replay (a second copy of
    the weights in its memory pool). Runtime inputs (written buffers included) stay non-static."""
    if "dynamo_compile_id" in gm.meta:
        exported.meta["dynamo_compile_id"] = gm.meta["dynamo_compile_id"]


def _export(gm: fx.GraphModule, example_inputs: list, inputs: _Inputs, nodes: list[fx.Node],
            data_as_detach: bool = False):
    """Dynamo's graph re-exported with ``inputs``' weights frozen: ``(ep.module() without export's checks,
    the runtime example arguments, the entry casts)`` (:func:`_entry_casts`). ``data_as_detach``: ``x.data``
    exported as ``x.detach()`` (:func:`_data_attr_as_detach`; inference only)."""
    up = _entry_casts(example_inputs, inputs.runtime)
    wrapper = _Frozen(gm, example_inputs, inputs, up)
    runtime_args = tuple(_concrete(example_inputs[i]) for i in inputs.runtime)
    dims = _dynamic_shapes(nodes, inputs.runtime)
    data = _data_attr_as_detach(gm) if data_as_detach else contextlib.nullcontext()
    with _no_stack_traces(), _checkpoint_context_fns(gm) as added, data:
        # forward(*runtime): export sees one varargs tuple, so the specs are nested one level.
        ep = torch.export.export(wrapper, runtime_args, dynamic_shapes=None if dims is None else (dims,),
                                 strict=False)
        exported = ep.module()
        for module in exported.modules():  # the copies export made of the bodies: vanilla again
            if any(getattr(module, "meta", {}).get(_CONTEXT_FN) is fn for fn in added):
                del module.meta[_CONTEXT_FN]
    _strip_export_checks(exported)
    # export names the varargs ``runtime``, ``runtime_1``, ...: the passes' skip reasons ("mask depends on graph
    # input ...") and notes name them as the model does.
    for placeholder, i in zip(_placeholders(exported), inputs.runtime):
        placeholder._rename(re.sub(r"\W+", "_", _input_name(nodes[i])).strip("_") or placeholder.name)
    return exported, runtime_args, up


@contextlib.contextmanager
def _data_attr_as_detach(gm: fx.GraphModule):
    """Within the block, Dynamo's graph ``gm`` reads ``x.data`` (``torch._C._autograd._get_data_attr``) as
    ``x.detach()``; restored on exit. ``torch.export`` cannot trace ``.data`` ("We found a fake tensor in the
    exported program constant's list"): every graph with a ``.data`` in it, read or written, went to the
    fallback. Both share ``x``'s storage; they differ only in autograd's version counter, which an inference
    graph never reads (a write through it is a write into ``x``: ``passes._graph.written_nodes``)."""
    getter = torch._C._autograd._get_data_attr
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is getter]
    if not nodes:
        yield
        return
    for n in nodes:
        n.target = torch.Tensor.detach
    gm.recompile()
    try:
        yield
    finally:
        for n in nodes:
            n.target = getter
        gm.recompile()


#: ``GraphModule.meta`` key of a checkpointed body's ``context_fn`` (selective activation checkpointing).
_CONTEXT_FN = "_checkpoint_context_fn"


@contextlib.contextmanager
def _checkpoint_context_fns(gm: fx.GraphModule):
    """Within the block, every body of a ``tag_activation_checkpoint`` node of ``gm`` (Dynamo's graph of
    ``torch.utils.checkpoint.checkpoint``) has a ``context_fn`` in its meta; yields those added.

    Dynamo stores one only for selective checkpointing (a ``context_fn=`` argument); vanilla checkpointing
    has none, and the HOP's pre-dispatch tracing that ``torch.export`` runs copies the key unconditionally
    (``torch._higher_order_ops.wrap.proxy_mode_key``, torch 2.13): ``KeyError: '_checkpoint_context_fn'``, and
    every graph using ``checkpoint`` in training fell back to plain Inductor. The one added is what the HOP
    runs without a key (``create_selective_checkpoint_contexts`` recomputing every op), so nothing changes;
    :func:`_export` removes it from export's copies of the bodies and the block restores Dynamo's."""
    from passes._graph import checkpoint_body

    added: list = []
    bodies = [b for b in map(functools.partial(checkpoint_body, gm), gm.graph.nodes)
              if b is not None and _CONTEXT_FN not in b.meta]
    if bodies:
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        try:
            from torch._higher_order_ops.wrap import _always_prefer_recompute as policy
        except ImportError:  # pragma: no cover - other torch versions
            from torch.utils.checkpoint import CheckpointPolicy

            def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
                return CheckpointPolicy.PREFER_RECOMPUTE
        for module in bodies:
            fn = functools.partial(create_selective_checkpoint_contexts, policy)
            module.meta[_CONTEXT_FN] = fn
            added.append(fn)
    try:
        yield added
    finally:
        for module in bodies:
            module.meta.pop(_CONTEXT_FN, None)


def _written_weights(exported: fx.GraphModule, inputs: _Inputs) -> list[int]:
    """Positions (among Dynamo's inputs) of the frozen weights ``exported`` writes in place
    (``passes._graph.written_nodes``: ``add_``, ``copy_``, ``index_copy_``, slice assignment, BatchNorm's running
    statistics in training mode)."""
    from passes._graph import written_nodes

    targets = {str(n.target) for n in written_nodes(exported) if n.op == "get_attr"}
    return sorted(i for i, name in inputs.weights.items() if name in targets)


def _calibrate_fp16(exported: fx.GraphModule, runtime_args: tuple, spec, report: SubgraphReport, hw: Any,
                    policy: str):
    """``spec`` with ``fp32_nodes`` from a calibration run on ``runtime_args``; bf16's spec (with a warning and a
    note) when the inputs are not real tensors and the device has bf16; fp16 uncalibrated with a warning else."""
    from torch._subclasses.fake_tensor import is_fake

    real = all(not (isinstance(t, torch.Tensor) and is_fake(t)) for t in runtime_args)
    if real:
        from passes._graph import written_nodes

        # The run must not write the user's tensors (an input updated in place, a KV cache): the call that
        # follows does, once. Those it writes are calibrated on copies.
        written = written_nodes(exported)
        args = tuple(a.clone() if isinstance(a, torch.Tensor) and p in written else a
                     for p, a in zip(_placeholders(exported), runtime_args))
        with torch.no_grad():
            ranges = calibrate_ranges(exported, [args])
        fp32 = overflow_nodes(ranges, "fp16", spec.overflow_margin)
        report.notes.append(f"fp16 calibrated on the first call's inputs: {len(fp32)} op(s) kept FP32 for overflow")
        return dataclasses.replace(spec, fp32_nodes=fp32)
    if hw is not None and (not hw.is_gpu or "bf16" in hw.tensor_core_precisions):
        logger.warning("tctune backend: no real inputs to calibrate fp16 overflow on; this subgraph runs bf16 "
                       "(fp16's range is 65504, bf16's that of fp32)")
        report.precision = "bf16"
        report.notes.append("fp16 refused (no real inputs to calibrate overflow on): bf16 instead")
        return _spec_for(hw, spec.training, policy, "bf16",
                         output_dtype="fp32" if spec.restore_output_dtypes else "compute")
    logger.warning("tctune backend: fp16 without overflow calibration (no real inputs) and no bf16 on this "
                   "device: activations beyond 65504 become inf")
    report.notes.append("fp16 uncalibrated: no real inputs, no bf16 on this device")
    return spec


def _runtime_caller(compiled: Callable, runtime: list[int]) -> Callable:
    """The callable handed back to Dynamo: called with all of Dynamo's graph inputs (runtime tensors, the
    lifted weights, sizes), it calls ``compiled`` with the inputs at the positions ``runtime`` only (the runtime
    tensors, then the size inputs :func:`_bind_sizes` kept; the weights are stored in the compiled graph): an
    index or one ``operator.itemgetter`` per call, no list built.

    Inductor's compiled function comes wrapped in ``torch._dynamo.disable`` (its frames must not be traced).
    Dynamo wraps what a backend returns in ``disable`` too, unwrapping a callable that already is one; a closure
    around the disabled function would be entered through two such wrappers per call. So the closure calls the
    unwrapped function and is itself wrapped once: one wrapper per call, as for plain Inductor, and no frame of
    it traced when it is called on its own."""
    inner = compiled
    if getattr(compiled, "_torchdynamo_disable", False):
        from torch._dynamo.eval_frame import innermost_fn

        inner = innermost_fn(compiled)
    if len(runtime) == 1:
        (only,) = runtime

        def run(*args: Any):
            return inner(args[only])
    elif not runtime:
        def run(*args: Any):
            return inner()
    else:
        pick = operator.itemgetter(*runtime)

        def run(*args: Any):
            return inner(*pick(args))
    return torch._dynamo.disable(run) if inner is not compiled else run


def _spec_children(spec: Any) -> list:
    """A pytree ``TreeSpec``'s child specs (``child(i)`` where it exists: ``children_specs`` is deprecated in
    torch 2.13)."""
    if callable(getattr(spec, "child", None)):
        return [spec.child(i) for i in range(spec.num_children)]
    return list(spec.children_specs)


def _plain_codegen(gm: fx.GraphModule) -> bool:
    """Give ``gm`` (``ep.module()``) a plain FX ``CodeGen`` where its pytree input/output specs are flat.

    ``ep.module()`` generates its ``forward`` with ``_PyTreeCodeGen``: inputs flattened and outputs unflattened
    with ``torch.utils._pytree`` at every call. Inductor's ``compile_fx`` cannot compile that code, so for such
    a graph it compiles a plain copy and wraps the result in a function that runs the pytree flatten /
    unflatten around every call (``torch._inductor.compile_fx.handle_dynamo_export_graph``, torch 2.11-2.13).
    A Dynamo subgraph takes flat tensors and returns a flat tuple, so both are identities here: with a plain
    ``CodeGen`` and a tuple output, Inductor returns its compiled function itself. Measured on the CPU (two
    shared cores, median of 9 blocks of 3000 calls of a two-linear graph): the wrapper cost 3.6 us per call
    (benchmarks/NOTES.md).

    Returns:
        True when the codegen was replaced; False (graph unchanged) when there is no pytree codegen or a spec
        is nested (e.g. keyword inputs), which the pytree code must still handle.
    """
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is None:
        return False

    def flat(spec: Any, kinds: tuple) -> bool:
        return spec is None or (spec.type in kinds and all(c.is_leaf() for c in _spec_children(spec)))

    in_spec, out_spec = info.in_spec, info.out_spec
    if in_spec is not None:  # ((args...), {kwargs}) from ep.module(): flat args, no kwargs
        if in_spec.type is not tuple or in_spec.num_children != 2:
            return False
        args_spec, kwargs_spec = _spec_children(in_spec)
        if not flat(args_spec, (tuple,)) or kwargs_spec.num_children:
            return False
    if not flat(out_spec, (tuple,)):
        return False
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    returned = output.args[0]
    output.args = (tuple(returned) if isinstance(returned, (tuple, list)) else (returned,),)
    gm.graph._codegen = fx.graph.CodeGen()
    recompile(gm)
    return True


def _bind_sizes(gm: fx.GraphModule, inputs: _Inputs) -> list[int]:
    """Append to ``gm`` (a plain-codegen graph of the runtime tensors) one unused placeholder per size input of
    Dynamo's graph (``inputs.sizes``), and return their positions among Dynamo's inputs, in order.

    Inductor traces ``gm`` with Dynamo's fake tensors, whose symbolic sizes are Dynamo's symbols. A scalar
    computed from a size (a float such as BatchNorm's ``n / (n - 1)`` in training) is turned into a tensor by
    AOT autograd's ``tensorify_python_scalars``, which needs each symbol bound by a graph input; in Dynamo's own
    graph the size inputs bind them, in the re-exported graph nothing did (``KeyError: s53``: the subgraph fell
    back to plain Inductor). With these placeholders, fed Dynamo's size values at compile time and the sizes at
    every call, tctune's graph binds the same symbols Dynamo's does."""
    positions = sorted(inputs.sizes)
    if not positions:
        return []
    prev = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    for i in positions:
        with gm.graph.inserting_after(prev):
            prev = gm.graph.placeholder(f"size_input_{i}")
    recompile(gm)
    return positions


def _drop_unused_weights(gm: fx.GraphModule) -> list[str]:
    """Delete the parameters and buffers of ``gm`` that no ``get_attr`` node reads, directly or through its
    module (frozen weights a pass replaced, such as the separate Q/K/V weights ``fuse_qkv`` concatenated).

    Inductor's ``compile_fx`` lifts *every* parameter and buffer of the module to a graph input
    (``aot_module_simplified``), so an unread one is still gathered and passed on every call. Returns the
    names deleted."""
    # A get_attr of a submodule (a higher-order op's branch) or a call_module reads every weight under it.
    read = {str(n.target) for n in gm.graph.nodes if n.op in ("get_attr", "call_module")}
    names = [n for n, _ in gm.named_parameters(remove_duplicate=False)]
    names += [n for n, _ in gm.named_buffers(remove_duplicate=False)]
    dropped = []
    for name in names:
        parts = name.split(".")
        if any(".".join(parts[:k]) in read for k in range(1, len(parts) + 1)):
            continue
        owner_name, _, attr = name.rpartition(".")
        owner = gm.get_submodule(owner_name) if owner_name else gm
        owner._parameters.pop(attr, None)
        owner._buffers.pop(attr, None)
        owner._non_persistent_buffers_set.discard(attr)
        dropped.append(name)
    return dropped


def _stable_cache_key(gm: fx.GraphModule) -> None:
    """Make AOTAutograd's cache key of ``gm`` the same in every process (issue #7).

    The key pickles ``gm.__dict__`` and its submodules'; ``_non_persistent_buffers_set`` (the padded / cast /
    fused weights the passes store with ``persistent=False``) is a ``set`` of names, pickled in string-hash
    order, which ``PYTHONHASHSEED`` randomizes per process: with two or more such buffers the key changed from
    one process to the next and AOTAutogradCache never hit. Emptying it only makes those buffers persistent
    in this private module's ``state_dict``, which nothing reads; they stay buffers, lifted to graph inputs.
    """
    for module in gm.modules():
        module._non_persistent_buffers_set.clear()


def _strip_export_checks(gm: fx.GraphModule) -> None:
    """Drop ``ep.module()``'s input checks (forward hooks and the ``_guards_fn`` call) and its instance
    ``train``/``eval`` overrides.

    Dynamo's own guards already decide which calls reach this graph, and these checks are closures that
    Inductor's FX graph cache cannot pickle (it would log a warning and skip the cache on every compile).

    The ``aten._assert_tensor_metadata`` nodes export puts before each ``.to()`` / ``.float()`` go too: they
    check a value's dtype against export's own metadata, which is wrong after a ``torch.autocast`` region
    (torch 2.13 records the ``wrap_with_autocast`` outputs as FP32 where they run bf16), so the exported graph
    of ``with torch.autocast(...): h = linear(x)`` then ``h.float()`` raised "Tensor dtype mismatch! Expected:
    torch.float32, Got: torch.bfloat16" on its first run, at every precision, and fell back to plain Inductor.
    Dynamo's graph has no such checks.

    ``ep.module()`` also sets ``gm.train`` / ``gm.eval`` to methods *bound to gm* (they raise
    NotImplementedError). AOTAutograd's cache key pickles ``gm.__dict__``; the bound method's ``__self__`` is
    ``gm`` again, so the key recurses until ``RecursionError`` and AOTAutogradCache is bypassed on *every*
    compile ("Bypassing autograd cache due to: maximum recursion depth exceeded"): a warm-cache compile
    re-ran AOT tracing and the joint-graph passes that plain ``torch.compile`` loads from its cache (issue #7;
    with :func:`_stable_cache_key`, CPU, second process on a warm cache, compile_fx / first call: GPT-2 4
    layers fp32 3.09 s / 5.59 s -> 0.10 s / 2.66 s, plain torch.compile 0.06 s / 2.13 s; BERT 4 layers with
    the fp16 h200 passes 3.01 s / 4.78 s -> 0.07 s / 1.73 s. Cold caches showed no gap: 8.9 s vs plain
    10.8 s). The module never leaves the backend, so nothing calls these overrides.
    """
    for name in ("train", "eval"):  # instance attributes shadowing nn.Module's methods
        gm.__dict__.pop(name, None)
    gm._forward_pre_hooks.clear()
    gm._forward_hooks.clear()
    gm._forward_hooks_always_called.clear()
    removed = False
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards_fn") and not node.users:
            gm.graph.erase_node(node)
            removed = True
        elif node.target is torch.ops.aten._assert_tensor_metadata.default and not node.users:
            gm.graph.erase_node(node)
            removed = True
    if removed:
        for name in [n for n, _ in gm.named_children() if n.startswith("_guards_fn")]:
            delattr(gm, name)
        recompile(gm)
