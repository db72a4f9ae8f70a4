"""The search space of a study: which values each trial parameter takes, and the candidates enqueued first."""
from __future__ import annotations

from dataclasses import dataclass

from passes.policy import POLICIES

from ..trial import MEMORY_FORMATS

#: Architectures (``HardwareSpec.arch``) where ``--fp8-fast-accum auto`` tries ``torch._scaled_mm``'s fast
#: accumulation: FP8 Tensor Cores with the reduced-precision accumulator it skips promoting from (sm_89, sm_90).
#: Blackwell is left out of ``auto`` (not measured there); ``on`` still applies it.
FAST_ACCUM_ARCHS = ("Ada", "Hopper")


def fp8_fast_accum_choices(precisions, arch: str, mode: str = "auto") -> tuple[bool, ...]:
    """The values of ``use_fast_accum`` a study's FP8 candidates may take (``SearchSpace.fp8_fast_accum``).

    Args:
        precisions: the precisions searched (``HardwareSpec.search_precisions``).
        arch: the target's architecture name (``"Hopper"``, ``"Ampere"``, ``"cpu"``...).
        mode: ``TuneConfig.fp8_fast_accum`` (``"auto"``, ``"on"``, ``"off"``).

    Returns:
        ``(False,)`` when fp8 is not searched or ``mode`` is ``"off"``; ``(True,)`` for ``"on"``; for ``"auto"``
        ``(False, True)`` on :data:`FAST_ACCUM_ARCHS` (the FP8 plan decides, :func:`tctune.fp8_plan.choose_fast_accum`),
        else ``(False,)``.

    Raises:
        ValueError: an unknown ``mode``.
    """
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"mode must be auto, on or off, got {mode!r}")
    if "fp8" not in precisions or mode == "off":
        return (False,)
    if mode == "on":
        return (True,)
    return (False, True) if arch in FAST_ACCUM_ARCHS else (False,)


@dataclass(frozen=True)
class SearchSpace:
    """The dimensions a study searches.

    Attributes:
        batch_sizes: items per call.
        precisions: compute precisions (``HardwareSpec.search_precisions``).
        runtimes: execution backends (``tctune.runtime``).
        graph: tctune's graph is a choice (the model was captured); else only the model as written.
        policy: the cast policy is searched (``passes.policy.POLICIES``): on a GPU, for the fp16/bf16 graph.
        memory_format: channels-last is searched (conv nets on a GPU).
        mode: ``infer`` or ``train``.
        fp8_fast_accum: the ``torch._scaled_mm`` fast-accumulation values FP8 candidates may take
            (:func:`fp8_fast_accum_choices`). Not an Optuna parameter (not in :meth:`space`, so study names are
            unchanged): with two choices the FP8 plan checks and times the chosen keep-list with fast accumulation
            once and every FP8 candidate of the study uses its answer, as it uses the planned keep-list.
    """

    batch_sizes: tuple[int, ...]
    precisions: tuple[str, ...]
    runtimes: tuple[str, ...]
    graph: bool
    policy: bool = False
    memory_format: bool = False
    mode: str = "infer"
    fp8_fast_accum: tuple[bool, ...] = (False,)

    @property
    def pass_choices(self) -> list[bool]:
        return [True, False] if self.graph else [False]

    def space(self) -> dict:
        """Parameter name -> the values Optuna chooses from (the study's name hashes this)."""
        space = {"batch_size": list(self.batch_sizes), "precision": list(self.precisions),
                 "graph_passes": self.pass_choices, "runtime": list(self.runtimes)}
        if self.policy:
            space["policy"] = list(POLICIES)
        if self.memory_format:
            space["memory_format"] = list(MEMORY_FORMATS)
        return space

    def size(self) -> int:
        """The number of combinations."""
        n = 1
        for choices in self.space().values():
            n *= len(choices)
        return n

    def candidate(self, **params) -> dict:
        """Trial parameters with the defaults of the dimensions this study searches."""
        if self.policy:
            params.setdefault("policy", "autocast")
        if self.memory_format:
            params.setdefault("memory_format", "contiguous")
        return params

    @property
    def fastest_compiled_runtime(self) -> str | None:
        """``inductor-cudagraphs`` when searched, else ``inductor``, else None (the H200's fastest first)."""
        return next((r for r in ("inductor-cudagraphs", "inductor") if r in self.runtimes), None)

    def compiled_first(self) -> list[dict]:
        """The candidates measured right after the FP32 baselines: tctune's graph through the fastest compiled
        runtime searched (``inductor-cudagraphs``, else ``inductor``) at each low precision of the search
        (fp16, bf16, fp8), largest batch, policy ``pure`` where the policy is searched, and for conv nets once
        more channels-last after fp16.

        Why first: on the H200 that runtime won on all five suite models (benchmarks/RESULTS.md: BERT-base,
        BERT-large, GPT-2, ResNet-50, seed CNN), while TPE's first random draws are unlikely to combine graph +
        compiled runtime + pure policy; a run cut short by ``--timeout`` or few ``--trials`` then still has
        measured the likely winner. They are measured like any trial (and can lose). Empty for training, for a
        model that did not capture, or when no compiled runtime is searched.
        """
        fast = self.fastest_compiled_runtime
        if fast is None or not self.graph or self.mode != "infer":
            return []
        bs = max(self.batch_sizes)
        out = []
        for p in ("fp16", "bf16", "fp8"):
            extra = {"policy": "pure"} if self.policy else {}
            if p in self.precisions:
                out.append(self.candidate(batch_size=bs, precision=p, graph_passes=True, runtime=fast, **extra))
                if p == "fp16" and self.memory_format:
                    out.append(self.candidate(batch_size=bs, precision=p, graph_passes=True, runtime=fast,
                                              memory_format="channels_last", **extra))
        return out


__all__ = ["FAST_ACCUM_ARCHS", "SearchSpace", "fp8_fast_accum_choices"]
