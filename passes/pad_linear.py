"""Pad linear layers' N (out-features) and K (in-features) to the Tensor Core alignment.

Why: cuBLAS only uses its fast Tensor Core kernels when the GEMM's N and K are multiples of the alignment (8
elements for fp16/bf16, 4 for tf32; NVIDIA "Matrix Multiplication Background User's Guide"). Measured on the
H200 (benchmarks/NOTES.md, reference measurements): fp16 GEMM with K=8191 runs at 140 TFLOP/s against 646 at
K=8192, and GPT-2's LM head with V=50257 takes 13.2 ms against 2.09 ms at V=50264. The rows/batch/tokens
dimension M is never padded.

How: zero rows are appended to the weight (and zeros to the bias) for N, and the output is sliced back to N,
so every caller sees the original shape; zero columns are appended to the weight for K and the input's last
dimension is padded with zeros. Zeros contribute exactly nothing, so the result is bit-for-bit the same
mathematical sum. Weights are replaced on the module under the *same* attribute names (``state_dict`` keys
unchanged; only shapes grow). A weight shared with other nodes keeps its K; a tied embedding table / LM
head gets its vocabulary rows padded (the extra rows are never indexed by the embedding).

This pass answers *can* a linear be padded; whether padding *pays* is asked of ``passes.should_pad`` per
dimension (a table of measurements per architecture, ``benchmarks/should_pad_h200.json``): it picks the
multiple (the alignment; 64 for a vocabulary-sized N where measured as fast) or says "can pad but should
not" (a tiny dimension the padding would grow by more than 1.5x), and each decision is recorded in
``notes["should_pad"]``. The search still measures candidates with and without this pass.

Graph outputs. With ``spec.pad_graph_outputs`` False (``tctune.backend``: Inductor compiles the graph and
nothing measures the choice), a linear whose output the graph returns, directly or through views and dtype
casts only (an LM head's logits), keeps its N: the slice back to N would make the returned tensor a copy of
the whole padded output, which under Inductor cost more than the aligned GEMM saved (H200, bf16, backend
pipeline with and without this pass, throughput as a fraction of ``torch.compile(model.to(bf16))``'s:
PegasusForCausalLM 0.95 -> 0.99, AllenaiLongformerBase 0.83 -> 0.88, TrOCRForCausalLM 0.92 -> 0.93;
benchmarks/results/zoo/2026-12-01-h200-ablate/). Its K is still padded (the input pad is interior), and so is
the N of every linear whose output is consumed inside the graph.
"""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx

from passes._graph import finish, get_attr_value, keep_outputs_contiguous, node_arg, round_up
from passes.base import PassResult, PassSpec, Skip
from passes.padding import PADDED_FLAG, pad_input_k, replace_tensor, slice_back, weight_users
from passes.should_pad import PadDecision, should_pad

NAME = "pad_linear_dims"

_LINEAR = torch.ops.aten.linear.default
_EMBEDDING = torch.ops.aten.embedding.default

#: Skip reason for a linear whose output the graph returns, under ``PassSpec.pad_graph_outputs=False``.
GRAPH_OUTPUT_REASON = (
    "output is a graph output: the slice copy costs more than the aligned GEMM saves under Inductor "
    "(measured, H200 bf16, throughput vs Inductor padded -> unpadded: PegasusForCausalLM 0.95x -> 0.99x, "
    "AllenaiLongformerBase 0.83x -> 0.88x); N not padded"
)
#: Ops through which a linear's output still reaches a graph output as the same values: views, layout copies and
#: dtype casts (ATen overload packet names). Anything else computes a new tensor, which Inductor writes anyway.
_PASS_THROUGH = frozenset({
    "view", "_unsafe_view", "reshape", "view_as", "flatten", "unflatten", "squeeze", "unsqueeze", "permute",
    "transpose", "t", "expand", "slice", "select", "split", "split_with_sizes", "chunk", "unbind", "alias",
    "detach", "contiguous", "clone", "_to_copy", "to", "type_as", "lift_fresh_copy",
})


def pad_linear_dims(gm: fx.GraphModule, spec: PassSpec) -> PassResult:
    """Pad every ``aten.linear`` weight's N and K up to ``spec.align()`` elements, in place.

    For ``y = linear(x, W, b)`` with ``x: (..., K)``, ``W: (N, K)``, ``b: (N,)``, ``y: (..., N)``:
    ``W`` becomes ``(N', K')`` with zero padding, ``b`` becomes ``(N',)``, ``x`` is padded to ``(..., K')``
    by ``aten.constant_pad_nd`` and the output sliced back to ``(..., N)`` by ``aten.slice.Tensor``, where
    ``N' = round_up(N, align)`` and ``K' = round_up(K, align)``. Dtypes are unchanged. Leading (batch)
    dimensions are never touched.

    Args:
        gm: an ATen-level graph module from ``torch.export`` (mutated in place).
        spec: target facts; ``spec.align()`` is the alignment in elements for ``spec.precision``; with
            ``spec.pad_graph_outputs`` False the N of a linear the graph returns is left alone (skip reason
            :data:`GRAPH_OUTPUT_REASON`; module docstring).

    Returns:
        A ``PassResult`` named ``"pad_linear_dims"``; ``count`` is the number of linears (and tied
        embeddings) padded, ``notes["padded"]`` maps node name to ``{"N": [old, new], "K": [old, new]}``
        (embeddings: ``{"V": [old, new]}``).
    """
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    result = PassResult(name=NAME, graph_module=gm)
    align = spec.align()
    linears = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == _LINEAR]
    embeddings = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == _EMBEDDING]

    if align <= 1:
        reason = f"alignment 1 (no Tensor Core requirement for {spec.precision} on {spec.arch})"
        result.skipped.extend(Skip(n.name, reason) for n in linears)
        return result

    padded: dict[str, dict] = {}
    padded_tables: dict[int, tuple[int, int]] = {}  # id(weight tensor) -> (old rows, new rows)
    pad_cache: dict[tuple[fx.Node, int], fx.Node] = {}
    decisions: dict[str, dict] = {}  # node name -> {"N": PadDecision dict, "K": ...}

    # Group the linears by weight tensor: a tied weight's N is padded once, for all of its users.
    for node in linears:
        w_node = node.args[1]
        # The weight must be a module attribute we can replace.
        if not isinstance(w_node, fx.Node) or w_node.op != "get_attr":
            result.skipped.append(Skip(node.name, "weight is not a parameter"))
            continue
        weight = get_attr_value(gm, w_node.target)
        # Only 2-D floating weights are GEMM operands we know how to pad.
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
            result.skipped.append(Skip(node.name, "weight is not a 2-D floating tensor"))
            continue
        n_old, k_old = weight.shape
        if id(weight) in padded_tables:
            # A tied weight already padded for another linear in this run: slice this output back too.
            n_orig = padded_tables[id(weight)][0]
            slice_back(gm, node, n_orig)
            node.meta[PADDED_FLAG] = True
            padded[node.name] = {"N": [n_orig, n_old], "K": [k_old, k_old]}
            result.changed.append(node.name)
            result.count += 1
            continue
        users = weight_users(gm, weight)
        shared = len(users) > 1
        n_dec = should_pad("linear", {"N": n_old}, spec.precision, spec.arch, align)
        if n_dec.pad and not spec.pad_graph_outputs and any(
            u.op == "call_function" and u.target == _LINEAR and returned_by_graph(u) for u, _ in users
        ):
            # This linear (or another user of the same weight, padded with it) is returned: keep N.
            n_dec = PadDecision(False, n_dec.multiple, GRAPH_OUTPUT_REASON)
        k_dec = should_pad("linear", {"K": k_old}, spec.precision, spec.arch, align)
        decisions[node.name] = {"N": n_dec._asdict(), "K": k_dec._asdict()}
        n_new = round_up(n_old, n_dec.multiple) if n_dec.pad else n_old
        k_new = round_up(k_old, k_dec.multiple) if k_dec.pad and not shared else k_old
        should_not = [d.reason for d in (n_dec, k_dec) if _should_not(d)]
        if n_new == n_old and k_new == k_old:
            # Covers a linear padded by an earlier run: its weight is aligned and its slice is in place.
            reasons = should_not + (["shared weight: K not padded"] if shared and k_dec.pad else [])
            result.skipped.append(Skip(node.name, "; ".join(reasons) or "already aligned"))
            continue
        result.skipped.extend(Skip(node.name, r) for r in should_not)
        # Padding N changes every user's view of the weight: each must be a linear or an embedding table.
        # (A tied weight is padded once, for all of its users, so it stays one tensor; a user that cannot take
        # the extra rows keeps every user unpadded and is named.)
        blockers = [u for u, w in users if not _rows_paddable(u, w)]
        if n_new != n_old and blockers:
            other = blockers[0]
            use = other.target if other.op == "call_function" else other.op
            reason = f"weight tied to {other.name} ({use}), which cannot take padded rows: N not padded"
            result.skipped.append(Skip(node.name, reason))
            n_new = n_old
        bias_node = node_arg(node, 2, "bias")
        bias = None
        if n_new != n_old and bias_node is not None:
            # The bias must be a module attribute used by this linear alone.
            if not isinstance(bias_node, fx.Node) or bias_node.op != "get_attr":
                result.skipped.append(Skip(node.name, "bias is not a parameter: N not padded"))
                n_new = n_old
            else:
                bias = get_attr_value(gm, bias_node.target)
                if len(weight_users(gm, bias)) > 1:
                    result.skipped.append(Skip(node.name, "shared bias: N not padded"))
                    n_new, bias = n_old, None
        x_node = node.args[0]
        x_val = x_node.meta.get("val") if isinstance(x_node, fx.Node) else None
        # Sizes in meta values may be SymInts: compare only plain ints (a SymInt comparison guards, or raises
        # on a data-dependent size), and never pad an input whose padded shape fake tensors cannot describe.
        if k_new != k_old and (x_val is None or not isinstance(x_val.shape[-1], int) or x_val.shape[-1] != k_old):
            # The input's last dimension must be known to be K to pad it.
            result.skipped.append(Skip(node.name, "input's last dimension is not a static K: K not padded"))
            k_new = k_old
        elif k_new != k_old and free_unbacked_symbols(x_val):
            reason = "input has a data-dependent size: its padded shape cannot be computed; K not padded"
            result.skipped.append(Skip(node.name, reason))
            k_new = k_old
        if shared and k_dec.pad:
            result.skipped.append(Skip(node.name, "shared weight: K not padded"))
        if n_new == n_old and k_new == k_old:
            continue

        # Rewrite: new weight (and bias) tensors under the same names, then the graph around the linear.
        new_weight = F.pad(weight.detach(), (0, k_new - k_old, 0, n_new - n_old))
        new_weight = replace_tensor(gm, weight, w_node.target, new_weight)
        if bias is not None:
            new_bias = F.pad(bias.detach(), (0, n_new - n_old))
            replace_tensor(gm, bias, bias_node.target, new_bias)
        if k_new != k_old:
            pad_input_k(gm, node, x_node, k_old, k_new, pad_cache)
        if n_new != n_old:
            padded_tables[id(new_weight)] = (n_old, n_new)
            slice_back(gm, node, n_old)
        node.meta[PADDED_FLAG] = True
        padded[node.name] = {"N": [n_old, n_new], "K": [k_old, k_new]}
        result.changed.append(node.name)
        result.count += 1

    for node in embeddings:
        table_node = node.args[0]
        table = get_attr_value(gm, table_node.target) if table_node.op == "get_attr" else None
        if table is not None and id(table) in padded_tables:
            v_old, v_new = padded_tables[id(table)]
            padded[node.name] = {"V": [v_old, v_new]}
            result.changed.append(node.name)
            result.count += 1
        elif table is not None and table.dim() == 2 and should_pad(
            "linear", {"N": table.shape[0]}, spec.precision, spec.arch, align
        ).reason == "already aligned":
            result.skipped.append(Skip(node.name, "already aligned"))
        else:
            reason = "embedding: vocabulary rows are padded only when tied to a padded LM head"
            result.skipped.append(Skip(node.name, reason))

    if decisions:
        result.notes["should_pad"] = decisions
    if result.count:
        result.notes["padded"] = padded
        keep_outputs_contiguous(gm)
        finish(gm)
    return result


def _should_not(decision: PadDecision) -> bool:
    return decision.reason.startswith("can pad but should not") or decision.reason == GRAPH_OUTPUT_REASON


def returned_by_graph(node: fx.Node) -> bool:
    """Whether the graph returns ``node``'s value: ``node`` is an output, or reaches the output node through
    views, layout copies and dtype casts only (``_PASS_THROUGH``, ``operator.getitem``), as an LM head's logits
    do. ``node``'s other users do not matter: one such path makes the output a copy of the whole tensor."""
    seen: set[fx.Node] = set()
    todo = [node]
    while todo:
        cur = todo.pop()
        for user in cur.users:
            if user.op == "output":
                return True
            if user in seen or user.op != "call_function" or not user.args or user.args[0] is not cur:
                continue
            packet = getattr(user.target, "overloadpacket", None)
            name = getattr(packet, "__name__", None)
            if user.target is operator.getitem or name in _PASS_THROUGH:
                seen.add(user)
                todo.append(user)
    return False


def _rows_paddable(user: fx.Node, w_node: fx.Node) -> bool:
    """Whether ``user`` still computes the same thing when the weight gains zero rows.

    True for a linear using it as the weight (its output is sliced back) and for an embedding using it as
    the table (the extra rows are never indexed).
    """
    if user.op != "call_function":
        return False
    if user.target == _LINEAR:
        return user.args[1] is w_node and w_node not in (user.args[0], *user.args[2:])
    if user.target == _EMBEDDING:
        return user.args[0] is w_node and w_node not in user.args[1:]
    return False


__all__ = ["GRAPH_OUTPUT_REASON", "pad_linear_dims", "returned_by_graph"]
