"""Device groups as named meshes, and how values lie on them.

Note [device groups as named meshes]
A device group is a mesh: device indices (into the step's devices) laid out row-major
over named axes, e.g. devices (0, 2) as ``dp=2``. Every region placed on the group runs
one SPMD program over that mesh: the ``dp`` axis holds data-parallel replicas, each
running the region on its slice of the batch; a group of one device is ``dp=1``. Groups
of different sizes may follow one another in a pipeline: a transfer between them moves
each receiving replica exactly the rows of the batch it needs.

How a value lies on its group's mesh is its `Layout`:

  replicated   every device holds the whole value (parameters without ZeRO-3)
  batch(dp)    split along the batch over dp: activations, cotangents, the batch
  partial(dp)  every replica holds a partial sum (gradients before their all-reduce)
  flat(dp)     flattened, padded to a multiple of dp and cut into equal shards, one per
               replica (ZeRO: see Note [ZeRO in piper-jax] in mpmd_runtime/zero.py)

Inside a replica of a ``dp x ep`` group, tokens lie split by batch row over ``ep``,
except in the expert regions, where tokens dispatched as (batch, experts, ...) lie split
by expert (Note [experts over ep] in mpmd_runtime/programs.py).

Communication nodes of the DAG are the layout changes: partial -> replicated is an
ALL_REDUCE, partial -> flat a REDUCE_SCATTER, flat -> replicated an ALL_GATHER,
batch(dp) on one group -> batch(dp) on another a SEND/RECV pair, and tokens by row <->
by expert an ALL_TO_ALL (dispatch, combine).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math

from piper_jax.ir.errors import DirectiveError

DP = "dp"
TP = "tp"
EP = "ep"
# the axes a replica's program leaves to XLA to partition (Note [replicas as a leading axis])
INNER_AXES = (TP, EP)


def group_str(devices: tuple[int, ...] | list[int]) -> str:
    """A device group as written in plans: d0, d0,2."""
    return _group_str(tuple(devices))


@functools.lru_cache(maxsize=65536)
def _group_str(devices: tuple[int, ...]) -> str:
    return "d" + ",".join(map(str, devices))


@dataclasses.dataclass(frozen=True)
class DeviceMesh:
    """A device group: device indices laid out row-major over named axes.

    Attributes:
      devices: indices into the step's devices; the group's identity in plans.
      axes: (name, size) pairs; their sizes multiply to len(devices). Empty while a
        region is placed but not yet told how it is split (`replicate`).
    """

    devices: tuple[int, ...]
    axes: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.axes and math.prod(size for _, size in self.axes) != len(self.devices):
            raise DirectiveError(
                f"mesh axes {dict(self.axes)} do not fit the {len(self.devices)} devices "
                f"{list(self.devices)}"
            )

    @classmethod
    def data_parallel(cls, devices: tuple[int, ...]) -> DeviceMesh:
        """All of `devices` as replicas on one `dp` axis (one device: dp=1)."""
        return cls(tuple(devices), ((DP, len(devices)),))

    @property
    def size(self) -> int:
        return len(self.devices)

    def axis_size(self, name: str) -> int:
        return dict(self.axes).get(name, 1)

    def axes_str(self) -> str:
        return " x ".join(f"{name}={size}" for name, size in self.axes) or "unsplit"

    def __str__(self) -> str:
        return f"{group_str(self.devices)}[{self.axes_str()}]"


class Placement(enum.StrEnum):
    REPLICATED = "replicated"
    BATCH = "batch"
    PARTIAL = "partial"
    FLAT = "flat"


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one value lies on its group's mesh (see Note [device groups as named meshes])."""

    placement: Placement
    axis: str | None = None

    def __str__(self) -> str:
        return self.placement.value + (f"({self.axis})" if self.axis else "")


REPLICATED = Layout(Placement.REPLICATED)
BATCH = Layout(Placement.BATCH, DP)
PARTIAL = Layout(Placement.PARTIAL, DP)
FLAT = Layout(Placement.FLAT, DP)


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """How a device group holds its parameters, gradients and optimizer state.

    Attributes:
      zero_level: 0 (everything replicated, gradients all-reduced once per step),
        2 (`shard_grads`: each backward reduce-scatters its gradients, the optimizer
        state is flat-sharded) or 3 (`shard_params`: parameters flat-sharded too and
        all-gathered around every use).
      bucket_mb: gradient collectives are cut into buckets of at most this many MB.
      tensor: (parameter, partition) pairs: the parameters split over the group's `tp`
        axis (`shard_tensor`) or `ep` axis (`shard`: experts first), each with an axis
        name or None per dimension.
    """

    zero_level: int = 0
    bucket_mb: float | None = None
    tensor: tuple[tuple[int, tuple[str | None, ...]], ...] = ()

    @property
    def holds_experts(self) -> bool:
        """The parameters are a mixture's experts, split over `ep` (`shard`)."""
        return any(spec[:1] == (EP,) for _, spec in self.tensor)

    @property
    def params(self) -> Layout:
        return FLAT if self.zero_level >= 3 else REPLICATED

    @property
    def grads(self) -> Layout:
        return FLAT if self.zero_level >= 2 else PARTIAL

    @property
    def state(self) -> Layout:
        return FLAT if self.zero_level >= 1 else REPLICATED

    def __str__(self) -> str:
        text = f"params {self.params}, grads {self.grads}, optimizer state {self.state}"
        if self.tensor:
            axes = sorted({a for _, spec in self.tensor for a in spec if a})
            text += f", {len(self.tensor)} params split over {'/'.join(axes)}"
        return text + (f", buckets of {self.bucket_mb:g} MB" if self.bucket_mb else "")
