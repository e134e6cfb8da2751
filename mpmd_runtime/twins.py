"""Regions whose passes can run one compiled program on a device group.

Note [twin regions share programs]
The middle blocks of a transformer cut into pipeline stages compute the same function of
inputs of the same shapes; when one device group holds several of them (interleaved
1F1B, DualPipeV's V, every stage of a pipeline-annotated model trained data-parallel),
each of their passes used to compile a program of its own: the same XLA program once per
stage. Two regions are twins when everything their passes' programs depend on is equal:

  * what they compute: the fingerprint of their equations (ir/fingerprint.py), their
    input and output shapes and dtypes, which batch leaves they read;
  * how their inputs and outputs are wired: which outputs of which producer (in order of
    first use) each activation input is, which consumer's cotangent (by rank) and which
    of its inputs each output's cotangent sums, the loss position;
  * how they run: what their forward keeps (`recompute`), how the group holds their
    parameters (split over `tp` or `ep`), whether they hold experts.

A fused step of such passes (with the ZeRO gather and reduce-scatter that serve them)
is then compiled for the first twin that runs it and called for the others
(`executor._signature` names passes by their region's first twin, and buffers by where
the step's pieces read and write them, not by name). A program's inputs are the twin's
own parameters and activations, passed in the same positions; JAX compiles again
wherever their layouts differ. Updates are not twins: an optimizer may treat parameters
differently by name (masks and labels by path); they share a program where their
lowered modules prove it (Note [updates of identical stages] in same_programs.py). On 2
virtual CPU devices the example
GPT reached its first step in 0.78x the time under DualPipeV (4 stages; 18 programs
instead of 23) and 0.64x under interleaved 1F1B (8 stages; 16 instead of 24), medians of
3 rounds of benchmarks/twin_programs.py, with the same losses to the last bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from piper_jax.ir.lift import LiftedLoss, Region
from piper_jax.mpmd_runtime.programs import cotangent_sources


def _cotangent_pattern(lifted: LiftedLoss, region: Region) -> tuple:
    """Per output: (rank of the consumer among the region's cotangent consumers, position
    among that consumer's float inputs) of each cotangent that sums into it."""
    sources = cotangent_sources(lifted, region)
    consumers = sorted({c for pairs in sources for c, _ in pairs})
    return tuple(tuple((consumers.index(c), j) for c, j in pairs) for pairs in sources)


def _wiring(lifted: LiftedLoss, region: Region) -> tuple:
    producers = list(dict.fromkeys(a.region for a in region.act_inputs))
    acts = tuple((producers.index(a.region), a.position) for a in region.act_inputs)
    return (acts, _cotangent_pattern(lifted, region), region.loss_position)


def twin_regions(
    lifted: LiftedLoss,
    regions: Sequence[int],
    keep: Mapping[int, str],
    param_specs: Mapping[int, Any],
    holds_experts: Callable[[Region], bool],
) -> dict[int, int]:
    """Each of `regions` mapped to its first twin among them (itself when it has none):
    Note [twin regions share programs].

    Args:
      keep: what each recomputed region's forward keeps.
      param_specs: how the group splits a parameter (by parameter index), if it does.
      holds_experts: whether the group holds a region's parameters split by expert.
    """

    def signature(region: Region) -> tuple:
        return (
            region.in_shapes,
            region.out_shapes,
            region.batch_ids,
            _wiring(lifted, region),
            keep.get(region.index, ""),
            tuple(param_specs.get(p) for p in region.param_ids),
            holds_experts(region),
        )

    alike: dict[tuple, list[int]] = {}
    for r in sorted(regions):
        alike.setdefault(signature(lifted.regions[r]), []).append(r)
    out = {r: r for r in regions}
    for members in alike.values():
        if len(members) < 2:  # no fingerprint to take (it walks every equation)
            continue
        first: dict[str, int] = {}
        for r in members:
            fingerprint = lifted.regions[r].fingerprint
            if fingerprint:  # "": a value the fingerprint cannot read, nobody's twin
                out[r] = first.setdefault(fingerprint, r)
    return out
