"""Instructions -> what the executor runs: one table of binders keyed by op.

An instruction that runs on one device group only (a pass, an update, a collective
inside the group) binds to a `Piece`: a function from the buffers it reads to the
buffers it writes (as `buffers.access` lists them), traceable, so that the pieces of a
fused step compose into one XLA program. An instruction that spans groups (SEND, RECV,
FREE, a collective over several groups) binds to an `Exchange` closure instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from piper_jax.ir.layout import EP, Placement
from piper_jax.mpmd_runtime import buffers as bf
from piper_jax.mpmd_runtime import collectives, zero
from piper_jax.mpmd_runtime.instructions import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    FREE,
    GNORM,
    RECV,
    REDUCE_SCATTER,
    RUN,
    SEND,
    UPD,
    Instruction,
    Label,
    parse_all_to_all,
)
from piper_jax.mpmd_runtime.programs import (
    AXIS,
    cotangent_sources,
    is_tokens,
    replicas,
    replicated,
    spmd,
    stacked,
)
from piper_jax.mpmd_runtime.transport import (
    TransferSpec,
    make_exchange,
    make_transfer,
    shard_assembler,
    shards_by_device,
)

if TYPE_CHECKING:
    from piper_jax.mpmd_runtime.executor import Runtime

Group = tuple[int, ...]
Env = dict[bf.Buffer, Any]


@dataclasses.dataclass(frozen=True)
class Piece:
    """One instruction as a traceable function of its group's buffers; `picks`: the
    positions it reads of list-valued buffers it reads only part of (an update's
    gradients in a bucket of several regions', Note [updates of identical stages])."""

    access: bf.Access
    fn: Callable[[Env], Env]
    picks: Mapping[bf.Buffer, tuple[int, ...]] = dataclasses.field(default_factory=dict)


Exchange = Callable[[], Any]


# ---- pieces ------------------------------------------------------------------------


class PassIO:
    """Where a pass of one region and microbatch on group g finds its inputs in the
    store and puts its outputs: shared by every pass's piece."""

    def __init__(self, rt: Runtime, g: Group, label: Label):
        # a twin region's programs may be another region's (Note [twin regions share
        # programs]): the wiring below is this region's own
        self.programs = rt.programs(label.region, g)
        self.region = region = rt.lifts[g].regions[label.region]
        mb = label.microbatch
        self.param_reads = rt.ctx.param_inputs(g, label)
        self.gathered = len(self.param_reads) == 1 and self.param_reads[0].kind is bf.Kind.VALUE
        self.res, self.cross = bf.residuals(label.region, mb), bf.cross(label.region, mb)
        self.batch_buf = bf.batch(mb)
        self.acts = [(bf.value(f"F{a.region}.{mb}"), a.position) for a in region.act_inputs]
        self.cots = [
            bf.value(f"{rt.ctx.cotangent_pass(c, mb)}{c}.{mb}")
            for c in rt.ctx.cotangent_consumers(label.region)
        ]
        self.accs = [bf.acc(n) for n in rt.ctx.names(region.param_ids)]
        self.sharded = rt.ctx.zero_level[g] >= 2  # gradients go to a reduce-scatter
        self.grads_out = bf.value(f"grad[{label}]")

    def params(self, env: Env) -> list:
        if self.gathered:
            return list(env[self.param_reads[0]])
        return [env[b] for b in self.param_reads]

    def forward_inputs(self, env: Env) -> tuple[list, list, list]:
        region = self.region
        batch = [env[self.batch_buf][i] for i in region.batch_ids] if region.batch_ids else []
        return self.params(env), batch, [env[b][k] for b, k in self.acts]

    def cotangents(self, env: Env) -> list:
        return [env[c] for c in self.cots]

    def accumulators(self, env: Env) -> tuple:
        """The accumulators a backward adds its gradients to (none under ZeRO-2/3)."""
        return () if self.sharded else ([env[a] for a in self.accs],)

    def gradients(self, out: Env, grads: list) -> Env:
        if self.sharded:
            out[self.grads_out] = grads
        else:
            out.update(zip(self.accs, grads))
        return out


def run_piece(rt: Runtime, g: Group, ins: Instruction) -> Piece:
    label = ins.label
    access = bf.access(ins, g, rt.ctx)
    io = PassIO(rt, g, label)
    programs = io.programs

    if label.pass_ == "F":
        writes = access.writes

        def forward(env: Env) -> Env:
            inputs = io.forward_inputs(env)
            if rt.ctx.forward_only:
                out = {writes[0]: programs.evaluate(*inputs)}
            else:
                outs, kept = programs.forward(*inputs)
                out = {writes[0]: outs, writes[1]: kept}
            if writes[-1].kind is bf.Kind.LOSS:  # this microbatch's loss, stacked over replicas
                out[writes[-1]] = out[writes[0]][io.region.loss_position]
            return out

        return Piece(access, forward)
    if label.pass_ == "B":

        def backward(env: Env) -> Env:
            g_acts, grads = programs.backward[not io.sharded](
                io.params(env), env[io.res], io.cotangents(env), *io.accumulators(env)
            )
            return io.gradients({bf.value(label): g_acts}, grads)

        return Piece(access, backward)
    if label.pass_ == "BI":

        def backward_input(env: Env) -> Env:
            g_acts, cross = programs.backward_input(io.params(env), env[io.res], io.cotangents(env))
            return {bf.value(label): g_acts, io.cross: cross}

        return Piece(access, backward_input)

    def backward_weight(env: Env) -> Env:
        grads = programs.backward_weight[not io.sharded](
            io.params(env), env[io.res], env[io.cross], *io.accumulators(env)
        )
        return io.gradients({}, grads)

    return Piece(access, backward_weight)


def forward_backward_piece(rt: Runtime, g: Group, f: Instruction, b: Instruction) -> Piece:
    """F and B of one region and microbatch as one pass, whose residuals stay inside it
    (Note [a forward and its backward in one program] in scheduler.py)."""
    f_access, b_access = bf.access(f, g, rt.ctx), bf.access(b, g, rt.ctx)
    f_io, io = PassIO(rt, g, f.label), PassIO(rt, g, b.label)
    internal = {io.res}
    access = bf.Access(
        reads=tuple(
            dict.fromkeys([*f_access.reads, *(x for x in b_access.reads if x not in internal)])
        ),
        consumes=b_access.consumes - internal,
        writes=tuple(x for x in (*f_access.writes, *b_access.writes) if x not in internal),
    )
    f_out, loss = f_access.writes[0], f_access.writes[-1]

    def forward_backward(env: Env) -> Env:
        outs, g_acts, grads = io.programs.forward_backward[not io.sharded](
            *f_io.forward_inputs(env), io.cotangents(env), *io.accumulators(env)
        )
        out = {f_out: outs, bf.value(b.label): g_acts}
        if loss.kind is bf.Kind.LOSS:
            out[loss] = outs[io.region.loss_position]
        return io.gradients(out, grads)

    return Piece(access, forward_backward)


def step_pieces(rt: Runtime, g: Group, instructions: Sequence[Instruction]) -> list[Piece]:
    """The pieces of a step's instructions, a region's F followed by its B of the same
    microbatch as one piece."""
    pieces: list[Piece] = []
    i = 0
    while i < len(instructions):
        ins = instructions[i]
        after = instructions[i + 1] if i + 1 < len(instructions) else None
        if (
            after is not None
            and ins.op == RUN == after.op
            and (ins.label.pass_, after.label.pass_) == ("F", "B")
            and (ins.label.region, ins.label.microbatch)
            == (after.label.region, after.label.microbatch)
        ):
            pieces.append(forward_backward_piece(rt, g, ins, after))
            i += 2
        else:
            pieces.append(PIECES[ins.op](rt, g, ins))
            i += 1
    return pieces


def gather_piece(rt: Runtime, g: Group, ins: Instruction) -> Piece:
    """ZeRO: parameter shards -> whole replicated parameters, one all-gather per
    parameter or per dtype (Note [one collective for many parameters])."""
    access = bf.access(ins, g, rt.ctx)
    mesh = rt.meshes[g]
    if ins.value.startswith("param[UPD"):
        names = [b.name for b in access.writes]
    else:
        names = [b.name for b in access.reads]
    shapes = [rt.param_shape(n) for n in names]
    own = zero.own_collectives(shapes, list(mesh.devices.flat))
    program = spmd(lambda rows: zero.gather_all(rows, shapes, own), mesh, (P(AXIS),), P())

    if ins.value.startswith("param[UPD"):  # ZeRO-2: the updated shards become parameters

        def gather_updated(env: Env) -> Env:
            whole = program(env[access.reads[0]])
            return {  # held as the group holds them: split over tp or ep where so told
                b: jax.lax.with_sharding_constraint(v, rt.param_sharding(g, b.name))
                for b, v in zip(access.writes, whole)
            }

        return Piece(access, gather_updated)

    def gather(env: Env) -> Env:
        return {access.writes[0]: program([env[b] for b in access.reads])}

    return Piece(access, gather)


def scatter_piece(rt: Runtime, g: Group, ins: Instruction) -> Piece:
    """ZeRO: a backward's per-replica gradients -> the replica's shard of their sum, added
    to its accumulators."""
    access = bf.access(ins, g, rt.ctx)
    grads_buf, accs = access.reads[0], access.reads[1:]
    region = rt.ctx.lifted.regions[ins.region]
    position = {n: i for i, n in enumerate(rt.ctx.names(region.param_ids))}
    take = [position[a.name] for a in accs]
    width = replicas(rt.meshes[g])
    shapes = [rt.param_shape(a.name) for a in accs]
    own = zero.own_collectives(shapes, list(rt.meshes[g].devices.flat))

    def reduce_scatter(grads: list, acc: list) -> list:
        mine = [grads[i][0].astype(a.dtype) for i, a in zip(take, acc)]
        return [a + s for a, s in zip(acc, zero.scatter_all(mine, width, own))]

    program = spmd(reduce_scatter, rt.meshes[g], (P(AXIS), P(AXIS)), P(AXIS))

    def scatter(env: Env) -> Env:
        return dict(zip(accs, program(env[grads_buf], [env[a] for a in accs])))

    return Piece(access, scatter)


def reduce_piece(rt: Runtime, g: Group, ins: Instruction) -> Piece:
    """An ALL_REDUCE inside one group: per-replica partial sums -> replicated totals, or
    (gnorm) the group's squared gradient norm."""
    access = bf.access(ins, g, rt.ctx)
    mesh = rt.meshes[g]
    if ins.value == GNORM:
        partial = norm_partials(rt, g)

        def norm(env: Env) -> Env:
            total = jax.lax.with_sharding_constraint(partial(env).sum(), replicated(mesh))
            return {access.writes[0]: total}

        return Piece(access, norm)

    def all_reduce(env: Env) -> Env:
        return {access.writes[0]: collectives.sum_replicas([env[b] for b in access.reads], mesh)}

    return Piece(access, all_reduce)


def update_piece(rt: Runtime, g: Group, ins: Instruction) -> Piece:
    region = int(ins.value)
    access = bf.access(ins, g, rt.ctx)
    program = rt.update_program(region, g)
    names = program.names
    sources = grad_sources(rt, g, rt.ctx.param_sets[f"UPD{region}"])
    grads = grad_reader(rt, g, sources)
    picks: dict[bf.Buffer, set[int]] = {}
    for buf, index, _ in sources:
        if index is not None:
            picks.setdefault(buf, set()).add(index)
    state = bf.opt(region)
    level = rt.ctx.zero_level[g]
    accs = [bf.acc(n) for n in names]
    written = [b for b in access.writes if b not in (state, *accs)]

    def update(env: Env) -> Env:
        extra = (env[bf.value(GNORM)],) if rt.ctx.global_norm else ()
        whole = [g_ for g_, _ in grads(env)]
        new_params, new_state = program.update(
            [env[bf.param(n)] for n in names], whole, env[state], *extra
        )
        out: Env = {state: new_state}
        for a in accs:  # laid out as the group holds them, not replicated as XLA would
            zeros = jnp.zeros_like(env[a])
            out[a] = jax.lax.with_sharding_constraint(zeros, rt.acc_sharding(g, a.name))
        if level == 2:
            out[written[0]] = new_params
        elif level == 0:  # parameters keep their layout (split over tp or whole)
            out.update(
                (b, jax.lax.with_sharding_constraint(v, rt.param_sharding(g, b.name)))
                for b, v in zip(written, new_params)
            )
        else:
            out.update(zip(written, new_params))
        return out

    return Piece(access, update, {b: tuple(sorted(i)) for b, i in picks.items()})


GradSource = tuple[bf.Buffer, int | None, Placement]  # buffer, position in it, layout


def grad_sources(rt: Runtime, g: Group, params: Sequence[int]) -> list[GradSource]:
    """Where an update or norm on group g finds each parameter's gradient: a position in
    an all-reduced bucket, or the group's accumulator. A plain group reads totals (or,
    with one replica, its accumulator row); a ZeRO group its stacked shards."""
    level, width = rt.ctx.zero_level[g], replicas(rt.meshes[g])
    sources: list[GradSource] = []
    for p in params:
        name = rt.ctx.lifted.param_names[p]
        reduced = rt.ctx.reduced_by[g].get(p)
        if reduced:
            index = rt.ctx.param_sets[reduced].index(p)
            layout = Placement.FLAT if level >= 2 else Placement.REPLICATED
            sources.append((bf.value(reduced), index, layout))
        else:
            assert level >= 2 or width == 1, (name, g)
            layout = Placement.FLAT if level >= 2 else Placement.PARTIAL
            sources.append((bf.acc(name), None, layout))
    return sources


def grad_reader(
    rt: Runtime, g: Group, sources: Sequence[GradSource]
) -> Callable[[Env], list[tuple[Any, Placement]]]:
    """Each gradient of `sources` as the step holds it, with its layout."""
    level = rt.ctx.zero_level[g]

    def read(env: Env) -> list[tuple[Any, Placement]]:
        out = []
        for buf, index, layout in sources:
            x = env[buf] if index is None else env[buf][index]
            if layout is Placement.PARTIAL and level < 2:
                x = x[0]  # one replica: its partial sum is the total
            out.append((x, layout))
        return out

    return read


def all_to_all_piece(rt: Runtime, g: Group, ins: Instruction) -> Piece:
    """Tokens to their other layout (Note [experts over ep]): the tokens of the source
    value that the reader reads, split by expert for an expert pass (dispatch) or by
    batch row for another (combine). Written back in place: the reader, fused after it
    in one program, reads them as laid out here, and XLA makes the move an all-to-all."""
    access = bf.access(ins, g, rt.ctx)
    (source,) = access.reads
    move = parse_all_to_all(ins.value)
    positions = read_positions(rt, g, move.source, move.reader)
    mesh, experts = rt.meshes[g], rt.experts(g)
    width = mesh.shape[EP]

    def spec(x: jax.Array) -> P:
        if move.to_experts:
            return P(AXIS, None, EP)
        return P(AXIS, EP) if x.shape[1] % width == 0 else P(AXIS)

    def all_to_all(env: Env) -> Env:
        leaves = list(env[source])
        for k in positions:
            if is_tokens(leaves[k], experts, lead=1):
                sharding = NamedSharding(mesh, spec(leaves[k]))
                leaves[k] = jax.lax.with_sharding_constraint(leaves[k], sharding)
        return {source: leaves}

    return Piece(access, all_to_all)


def read_positions(rt: Runtime, g: Group, source: Label, reader: Label) -> list[int]:
    """Which leaves of the value `source` wrote the pass `reader` reads: outputs of a
    forward it takes as inputs, or the cotangents a consumer's backward sends it."""
    regions = rt.lifts[g].regions
    if reader.pass_ == "F":
        return [a.position for a in regions[reader.region].act_inputs if a.region == source.region]
    sources = cotangent_sources(rt.lifts[g], regions[reader.region])
    return sorted({j for pairs in sources for c, j in pairs if c == source.region})


PIECES: dict[str, Callable[[Runtime, Group, Instruction], Piece]] = {
    RUN: run_piece,
    UPD: update_piece,
    ALL_REDUCE: reduce_piece,
    REDUCE_SCATTER: scatter_piece,
    ALL_GATHER: gather_piece,
    ALL_TO_ALL: all_to_all_piece,
}


# ---- exchanges: instructions that span groups or only move host references ----------


def bind_send(rt: Runtime, g: Group, ins: Instruction) -> Exchange:
    peer = tuple(ins.peer)
    transfer = make_transfer(
        rt.meshes[g],
        rt.meshes[peer],
        rt.buffer_avals(ins.value, g),
        rt.buffer_avals(ins.value, peer),
    )
    store, mailbox, key, buf = rt.stores[g], rt.mailbox, (ins.value, peer), bf.value(ins.value)
    sending = g in rt.local

    def send() -> Any:
        out, witness = transfer(store[buf] if sending else None)
        if out is not None:
            mailbox[key] = out
        return witness

    return send


def bind_sends(rt: Runtime, sends: Sequence[tuple[Group, Instruction]]) -> Exchange:
    """Cross-process SENDs run as one program (Note [transfers that meet together])."""
    specs = []
    for g, ins in sends:
        peer = tuple(ins.peer)
        avals = rt.buffer_avals(ins.value, g), rt.buffer_avals(ins.value, peer)
        specs.append(TransferSpec(rt.meshes[g], rt.meshes[peer], *avals))
    exchange = make_exchange(specs)
    sources = [(rt.stores[g], bf.value(ins.value)) if g in rt.local else None for g, ins in sends]
    keys = [(ins.value, tuple(ins.peer)) for _, ins in sends]
    mailbox = rt.mailbox

    def send() -> Any:
        received, witness = exchange([None if s is None else s[0][s[1]] for s in sources])
        for key, out in zip(keys, received):
            if out is not None:
                mailbox[key] = out
        return witness

    return send


def bind_recv(rt: Runtime, g: Group, ins: Instruction) -> Exchange:
    store, mailbox, key, buf = rt.stores[g], rt.mailbox, (ins.value, g), bf.value(ins.value)

    def recv() -> None:
        store[buf] = mailbox.pop(key)

    return recv


def bind_free(rt: Runtime, g: Group, ins: Instruction) -> Exchange:
    store, buf = rt.stores[g], bf.value(ins.value)

    def free() -> None:
        store.pop(buf, None)

    return free


def bind_cross_reduce(rt: Runtime, members: Sequence[Group], ins: Instruction) -> Exchange:
    """An ALL_REDUCE over several groups (a tied weight, the global norm): each local
    member group turns its gradients into partial rows, one program on the union sums
    them, and each takes the total back in its own layout."""
    union = [d for g in members for d in rt.meshes[g].devices.flat]
    program, in_sharding = collectives.union_sum_program(union)
    local = [g for g in members if g in rt.local]
    out_buf = bf.value(ins.value)
    if ins.value == GNORM:
        shapes: list[tuple[int, ...]] = [()]
        ends = {g: _norm_side(rt, g) for g in local}
    else:
        params = rt.ctx.param_sets[ins.value]
        shapes = [rt.param_shape(n) for n in rt.ctx.names(params)]
        ends = {g: _reduce_side(rt, g, params, shapes) for g in local}
    size = collectives.flat_length(shapes)
    to_rows = shard_assembler((len(union), size), in_sharding)
    to_full = {g: shard_assembler((size,), replicated(rt.meshes[g])) for g in local}

    def reduce() -> Any:
        rows = {}
        for g in local:
            rows.update(shards_by_device(ends[g][0](rt.stores[g])))
        total = program(to_rows(rows))
        for g in local:
            rt.stores[g][out_buf] = ends[g][1](to_full[g](shards_by_device(total)))
        return total

    return reduce


def cross_reduce_result(rt: Runtime, g: Group, ins: Instruction) -> Any:
    """The abstract value (shapes, dtypes, layouts) `bind_cross_reduce` leaves on group g:
    the global norm replicated; gradients replicated, or under ZeRO-2/3 the replica's
    flat shards (Note [compiling ahead])."""
    mesh = rt.meshes[g]
    if ins.value == GNORM:
        return jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated(mesh))
    width, flat = replicas(mesh), rt.ctx.zero_level[g] >= 2
    out = []
    for name in rt.ctx.names(rt.ctx.param_sets[ins.value]):
        shape, dtype = rt.param_avals[name]
        if flat:
            shape, sharding = (width, zero.shard_len(shape, width)), stacked(mesh)
        else:
            sharding = replicated(mesh)
        out.append(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding))
    return out


def _reduce_side(
    rt: Runtime, g: Group, params: Sequence[int], shapes: list[tuple[int, ...]]
) -> tuple[Callable, Callable]:
    mesh, level = rt.meshes[g], rt.ctx.zero_level[g]
    accs = [bf.acc(n) for n in rt.ctx.names(params)]
    layout = Placement.FLAT if level >= 2 else Placement.PARTIAL
    out_layout = Placement.FLAT if level >= 2 else Placement.REPLICATED
    dtypes = [rt.param_dtype(n) for n in rt.ctx.names(params)]
    before = jax.jit(lambda xs: collectives.contribution(xs, shapes, [layout] * len(xs), mesh))
    after = jax.jit(
        lambda total: collectives.result(total, shapes, dtypes, [out_layout] * len(shapes), mesh)
    )
    return (lambda store: before([store[a] for a in accs])), after


# gradients of fewer elements per replica than this share one reduction (see norm_partials)
NORM_CONCAT_MAX = 1 << 17


def norm_partials(rt: Runtime, g: Group) -> Callable[[Env], jax.Array]:
    """Group g's squared gradient norm as per-replica partial sums (dp,), whose sum is
    the group's share of the global norm: no collective per parameter, one at the end.
    XLA:CPU compiles a kernel for every reduction: one per parameter took a GPT's norm
    program (52 parameters) 0.18 s of compile under DP and 0.29 s under ZeRO-3. So the
    gradients under NORM_CONCAT_MAX elements are concatenated and summed at once (0.04
    and 0.05-0.12 s); larger ones keep a reduction each, as copying them costs more per step
    than their kernels cost once (four 1024x1024 gradients: 1.2-1.5 ms a step against
    0.5 ms)."""
    mesh = rt.meshes[g]
    width = replicas(mesh)
    grads = grad_reader(rt, g, grad_sources(rt, g, bf.norm_params(rt.ctx, g)))

    def partial(env: Env) -> jax.Array:
        whole, rows = [], []
        for x, layout in grads(env):
            x = x.astype(jnp.float32)
            if layout is Placement.REPLICATED:  # every replica holds the total
                whole.append(x.reshape(1, -1))
            else:  # per-replica rows: partial sums (one replica) or ZeRO shards
                rows.append((x if layout is Placement.FLAT else x[None]).reshape(width, -1))
        total = _square_sums(rows) if rows else jnp.zeros((width,), jnp.float32)
        if whole:  # counted once: a share of it on each replica
            total += _square_sums(whole)[0] / width
        return jax.lax.with_sharding_constraint(total, stacked(mesh))

    return partial


def _square_sums(rows: list[jax.Array]) -> jax.Array:
    """Per row, the sum of squares of (rows, n_i) arrays (a non-empty list), the small
    ones over their concatenation (see norm_partials)."""
    small = [r for r in rows if r.shape[1] < NORM_CONCAT_MAX]
    sums = [jnp.sum(jnp.square(r), axis=1) for r in rows if r.shape[1] >= NORM_CONCAT_MAX]
    if small:
        sums.append(jnp.sum(jnp.square(jnp.concatenate(small, axis=1)), axis=1))
    return sum(sums[1:], sums[0])


def _norm_side(rt: Runtime, g: Group) -> tuple[Callable, Callable]:
    mesh = rt.meshes[g]
    partial = norm_partials(rt, g)
    reads = bf.access(Instruction(ALL_REDUCE, GNORM, (0,)), g, rt.ctx).reads
    before = jax.jit(
        lambda values: collectives.device_rows(partial(dict(zip(reads, values)))[:, None], mesh)
    )
    after = jax.jit(lambda total: jax.lax.with_sharding_constraint(total[0], replicated(mesh)))
    return (lambda store: before([store[b] for b in reads])), after


EXCHANGES: dict[str, Callable[[Runtime, Group, Instruction], Exchange]] = {
    SEND: bind_send,
    RECV: bind_recv,
    FREE: bind_free,
}
