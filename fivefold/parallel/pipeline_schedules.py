"""Pipeline schedules as explicit per-rank action lists: what each rank runs, in order. The same lists
are executed by fivefold.parallel.pipeline, simulated here (unit costs) for the theoretical bubble, and
drawn by `fivefold pipeline`.

    F(mb, chunk)  forward of micro-batch mb through the rank's model chunk (one chunk unless interleaved)
    B(mb, chunk)  backward; under zero-bubble only the input gradient
    W(mb, chunk)  zero-bubble only: the weight gradients of that backward

Virtual stage `chunk * pp + rank` holds the chunk's layers (Megatron-LM's interleaved layout), so
activations flow rank 0 -> pp-1, then back to rank 0 for the next chunk. Receives and sends are implied
by the actions: F of a stage > 0 receives its input from the stage before, B of a stage < last receives
its output gradient from the stage after.

    afab         all forwards, then all backwards (GPipe, Huang et al. 2019): m micro-batches in flight
    1f1b         pp - rank - 1 warm-up forwards, then one forward one backward (PipeDream-Flush,
                 Narayanan et al. 2021): at most pp - rank in flight, bubble (pp-1)/m
    interleaved  v chunks per rank, Megatron-LM's order (Narayanan et al. 2021): bubble (pp-1)/(v m)
    zero-bubble  1F1B's order with backward split into B and W (ZB-H1, Qi et al. 2023): each rank fills
                 the time it would wait for a gradient with pending W passes: bubble (pp-1)/(3m)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

SCHEDULES = ("afab", "1f1b", "interleaved", "zero-bubble")


@dataclass(frozen=True)
class Action:
    kind: str  # "F", "B" or "W"
    mb: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


def stage_of(rank: int, chunk: int, pp: int) -> int:
    return chunk * pp + rank


def build_schedule(name: str, pp: int, m: int, v: int = 1) -> list[list[Action]]:
    """The action list of every rank."""
    return [list(actions) for actions in _built(name, pp, m, v)]


def rank_schedule(name: str, pp: int, m: int, rank: int, v: int = 1) -> tuple[Action, ...]:
    """One rank's action list (shared: do not modify)."""
    return _built(name, pp, m, v)[rank]


@functools.lru_cache(maxsize=256)
def _built(name: str, pp: int, m: int, v: int) -> tuple[tuple[Action, ...], ...]:
    """Built once per shape: the planner and the layout search ask for the same schedules many times."""
    return tuple(tuple(actions) for actions in _build(name, pp, m, v))


def _build(name: str, pp: int, m: int, v: int) -> list[list[Action]]:
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if name == "afab":
        return [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)] for _ in range(pp)]
    if name == "interleaved":
        return [_interleaved(pp, m, v, r) for r in range(pp)]
    lists = [_one_f_one_b(pp, m, r) for r in range(pp)]
    return _insert_weight_passes(lists, pp, m) if name == "zero-bubble" else lists


def _one_f_one_b(pp: int, m: int, rank: int) -> list[Action]:
    warmup = min(pp - rank - 1, m)
    out = [Action("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        out += [Action("F", warmup + i), Action("B", i)]
    return out + [Action("B", i) for i in range(m - warmup, m)]


def _interleaved(pp: int, m: int, v: int, rank: int) -> list[Action]:
    """Megatron-LM's interleaved 1F1B: micro-batches go through the chunks in groups of pp; rank r warms
    up with 2(pp - r - 1) + (v - 1) pp chunk-forwards."""
    total = m * v

    def forward(k: int) -> Action:
        return Action("F", (k // (pp * v)) * pp + k % pp, (k // pp) % v)

    def backward(k: int) -> Action:
        return Action("B", (k // (pp * v)) * pp + k % pp, v - 1 - (k // pp) % v)

    warmup = min(2 * (pp - rank - 1) + (v - 1) * pp, total)
    out = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        out += [forward(warmup + k), backward(k)]
    return out + [backward(k) for k in range(total - warmup, total)]


def _insert_weight_passes(lists: list[list[Action]], pp: int, m: int) -> list[list[Action]]:
    """ZB-H1: keep 1F1B's forwards and (input-gradient) backwards in order, and run a pending W pass
    whenever a rank's next forward or backward cannot start yet, stepping through time with unit
    costs. Every rank may hold pp micro-batches whose W has not run (the first rank's 1F1B peak), so
    later ranks postpone their W passes (rank r by pp - 1 - r micro-batches) and the gradients flow back
    without waiting: idle time drops from 1F1B's (pp-1)(F+B+W) to (pp-1)(F+B-W), a bubble of
    (pp-1)/(3m) with equal costs. Full activations stay at 1F1B's pp - r; what waits for W is only the
    linears' inputs and output gradients."""
    out: list[list[Action]] = [[] for _ in range(pp)]
    position, waiting_w = [0] * pp, [[] for _ in range(pp)]
    unfinished = [0] * pp  # forwards whose W has not run
    done: dict[tuple[str, int, int], float] = {}
    t = 0
    while any(position[r] < len(lists[r]) or waiting_w[r] for r in range(pp)):
        finished = []
        for r in range(pp):
            nxt = lists[r][position[r]] if position[r] < len(lists[r]) else None
            ready = _ready_time(nxt, r, pp, 1, done) if nxt is not None else None
            if ready is not None and ready <= t and not (nxt.kind == "F" and unfinished[r] >= pp):
                action = nxt
                position[r] += 1
                unfinished[r] += action.kind == "F"
                if action.kind == "B":
                    waiting_w[r].append(Action("W", action.mb, action.chunk))
            elif waiting_w[r]:
                action = waiting_w[r].pop(0)
                unfinished[r] -= 1
            else:
                continue
            out[r].append(action)
            finished.append((action.kind, action.mb, stage_of(r, action.chunk, pp)))
        for key in finished:  # visible to the other ranks from the next time step
            done[key] = t + 1
        t += 1
        if t > 4 * pp * m + 4 * pp:
            raise RuntimeError("zero-bubble schedule construction stalled")
    return out


def peak_held(actions: list[Action], full: float, pending_w: float) -> float:
    """Peak activation memory of a rank's action list: `full` per micro-batch-chunk between its F and B,
    `pending_w` (what a W pass still needs) between its B and W."""
    after_b = pending_w if any(a.kind == "W" for a in actions) else 0.0
    live = peak = 0.0
    for a in actions:
        live += {"F": full, "B": after_b - full, "W": -pending_w}[a.kind]
        peak = max(peak, live)
    return peak


def _input_of(action: Action, rank: int, pp: int, chunks: int) -> tuple[str, int, int] | None:
    """The (kind, micro-batch, stage) whose result `action` waits for, over stages 0..pp*chunks-1 (None: the
    first stage's forward waits for nothing): F for the stage before's F, B for the stage after's B (the last
    stage for its own F), W for its own B."""
    stage, last = stage_of(rank, action.chunk, pp), pp * chunks - 1
    if action.kind == "F":
        return None if stage == 0 else ("F", action.mb, stage - 1)
    if action.kind == "B":
        return ("F", action.mb, stage) if stage == last else ("B", action.mb, stage + 1)
    return ("B", action.mb, stage)


def _ready_time(action: Action, rank: int, pp: int, chunks: int, done: dict) -> float | None:
    """When the cross-rank input of `action` is available (None: not yet known)."""
    need = _input_of(action, rank, pp, chunks)
    return 0.0 if need is None else done.get(need)


# -- simulation: the theoretical timeline -------------------------------------------------------------


@dataclass
class Timeline:
    """(rank, action, start, end) for every action; time in units of one chunk-forward."""
    events: list[tuple[int, Action, float, float]]
    pp: int

    @functools.cached_property
    def makespan(self) -> float:
        return max(end for *_, end in self.events) - min(start for _, _, start, _ in self.events)

    def busy(self, rank: int) -> float:
        return self._busy.get(rank, 0.0)

    @functools.cached_property
    def _busy(self) -> dict[int, float]:
        out: dict[int, float] = {}
        for r, _, start, end in self.events:
            out[r] = out.get(r, 0.0) + end - start
        return out

    @property
    def bubble(self) -> float:
        """Idle time over useful time, the rank with the most work: (p-1)/m for 1F1B."""
        busy = max(self.busy(r) for r in range(self.pp))
        return (self.makespan - busy) / busy


class SimulatedTimeline(Timeline):
    """A simulation's timeline, kept per rank (a rank's actions run in list order, each starting after the
    one before ends): the step-time model asks only for the makespan and each rank's busy time, so the
    event list is made only when something reads it (a drawing)."""

    def __init__(self, lists, starts: list[list[float]], ends: list[list[float]]):
        self.pp, self._lists, self._starts, self._ends = len(lists), lists, starts, ends

    @functools.cached_property
    def events(self) -> list[tuple[int, Action, float, float]]:
        return [(r, a, start, end) for r in range(self.pp)
                for a, start, end in zip(self._lists[r], self._starts[r], self._ends[r])]

    @functools.cached_property
    def makespan(self) -> float:
        ranks = [r for r in range(self.pp) if self._starts[r]]
        return max(self._ends[r][-1] for r in ranks) - min(self._starts[r][0] for r in ranks)

    @functools.cached_property
    def _busy(self) -> dict[int, float]:
        out: dict[int, float] = {}
        for r in range(self.pp):
            for start, end in zip(self._starts[r], self._ends[r]):
                out[r] = out.get(r, 0.0) + end - start  # Timeline's sum, term for term
        return out


KINDS = "FBW"


@dataclass(frozen=True)
class _Program:
    """A schedule compiled for simulation: per rank, each action's id (kind, micro-batch, stage as one
    int), the id of the action on another rank whose result it waits for (-1: none) and its class
    (chunk * 3 + kind), so that the simulation runs over plain ints and lists."""
    lists: tuple[tuple[Action, ...], ...]
    keys: tuple[list[int], ...]
    needs: tuple[list[int], ...]
    classes: tuple[list[int], ...]
    size: int


def _compile(lists) -> _Program:
    pp = len(lists)
    chunks = 1 + max((a.chunk for lst in lists for a in lst), default=0)
    stages = pp * chunks
    mbs = 1 + max((a.mb for lst in lists for a in lst), default=0)

    def key(kind: str, mb: int, stage: int) -> int:
        return (KINDS.index(kind) * mbs + mb) * stages + stage

    keys, needs, classes = [], [], []
    for r, actions in enumerate(lists):
        k, n, c = [], [], []
        for a in actions:
            need = _input_of(a, r, pp, chunks)
            k.append(key(a.kind, a.mb, stage_of(r, a.chunk, pp)))
            n.append(-1 if need is None else key(*need))
            c.append(a.chunk * 3 + KINDS.index(a.kind))
        keys.append(k)
        needs.append(n)
        classes.append(c)
    return _Program(tuple(tuple(lst) for lst in lists), tuple(keys), tuple(needs), tuple(classes), 3 * mbs * stages)


@functools.lru_cache(maxsize=128)
def _compiled(name: str, pp: int, m: int, v: int) -> _Program:
    return _compile(_built(name, pp, m, v))


def _run(program: _Program, costs: list[list[float]]) -> SimulatedTimeline:
    """Each action as soon as its rank is free and its input has arrived; `costs[r][i]`: rank r's action
    i. Event-driven: a rank runs until an input is missing, then waits on that one action, which wakes it
    when it completes, so every action is visited once."""
    pp = len(program.keys)
    done = [-1.0] * program.size  # completion times; -1: not yet
    waiter: dict[int, list[int]] = {}  # action id -> the ranks whose next action waits for it
    position, free = [0] * pp, [0.0] * pp
    starts: list[list[float]] = [[] for _ in range(pp)]
    ends: list[list[float]] = [[] for _ in range(pp)]
    runnable = list(range(pp - 1, -1, -1))
    while runnable:
        r = runnable.pop()
        keys, needs, cost, start_r, end_r = program.keys[r], program.needs[r], costs[r], starts[r], ends[r]
        i, now, n = position[r], free[r], len(keys)
        while i < n:
            need = needs[i]
            if need >= 0:
                ready = done[need]
                if ready < 0.0:
                    waiter.setdefault(need, []).append(r)
                    break
                start = now if now > ready else ready
            else:
                start = now
            now = start + cost[i]
            start_r.append(start)
            end_r.append(now)
            key = keys[i]
            done[key] = now
            if key in waiter:
                runnable += waiter.pop(key)
            i += 1
        position[r], free[r] = i, now
    stuck = {r: str(program.lists[r][position[r]]) for r in range(pp) if position[r] < len(program.keys[r])}
    if stuck:
        raise RuntimeError(f"pipeline schedule deadlocks; waiting actions: {stuck}")
    return SimulatedTimeline(program.lists, starts, ends)


def _default_costs(lists) -> dict[str, float]:
    split = any(a.kind == "W" for lst in lists for a in lst)
    return {"F": 1.0, "B": 1.0 if split else 2.0, "W": 1.0}


def simulate(lists: list[list[Action]], costs=None) -> Timeline:
    """Run the lists with costs per kind (default F=1, B=2, or B=W=1 when W passes exist) or from a
    function (rank, action) -> seconds, each action as soon as its rank is free and its input has arrived.
    Raises if the lists deadlock."""
    program = _compile(lists)
    costs = costs or _default_costs(lists)
    if callable(costs):
        per_action = [[costs(r, a) for a in actions] for r, actions in enumerate(program.lists)]
    else:
        per_action = [[costs[a.kind] for a in actions] for actions in program.lists]
    return _run(program, per_action)


def simulate_schedule(name: str, pp: int, m: int, v: int, stage_costs: dict[tuple[int, int, str], float]) -> Timeline:
    """`simulate` of `build_schedule(name, pp, m, v)` with each action costing `stage_costs[rank, chunk,
    kind]`: what the step-time model runs for every layout it prices, so the schedule is compiled once per
    shape and an action's cost is looked up by its class."""
    program = _compiled(name, pp, m, v)
    per_action = []
    for r, classes in enumerate(program.classes):
        by_class = {c: stage_costs[r, c // 3, KINDS[c % 3]] for c in set(classes)}
        per_action.append([by_class[c] for c in classes])
    return _run(program, per_action)


def theoretical_bubble(name: str, pp: int, m: int, v: int = 1) -> float:
    """The textbook bubble: (p-1)/m for afab and 1f1b, (p-1)/(v m) for interleaved, (p-1)/(3m) for
    zero-bubble (ZB-H1 with F = B = W, m >= p)."""
    return (pp - 1) / (m * {"interleaved": v, "zero-bubble": 3}.get(name, 1))


def max_in_flight(actions: list[Action]) -> int:
    """Most micro-batch-chunks whose forward ran and whose backward has not (activations held)."""
    live = peak = 0
    for a in actions:
        live += a.kind == "F"
        live -= a.kind == "B"
        peak = max(peak, live)
    return peak


def draw(timeline: Timeline, path: str, title: str) -> str:
    """The familiar pipeline picture: one row per rank, a box per action, forwards light and backwards
    dark, numbered by micro-batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"F": "#8ecae6", "B": "#fb8500", "W": "#90be6d"}
    fig, ax = plt.subplots(figsize=(max(8, timeline.makespan * 0.35), 0.6 * timeline.pp + 1.2))
    for rank, action, start, end in timeline.events:
        shade = 1.0 - 0.25 * action.chunk
        ax.barh(rank, end - start, left=start, color=colors[action.kind], alpha=max(0.4, shade),
                edgecolor="black", linewidth=0.5)
        ax.text((start + end) / 2, rank, str(action.mb), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(timeline.pp), [f"rank {r}" for r in range(timeline.pp)])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for k, c in colors.items()
               if any(a.kind == k for _, a, _, _ in timeline.events)]
    labels = [{"F": "forward", "B": "backward", "W": "weight grad"}[k] for k in colors
              if any(a.kind == k for _, a, _, _ in timeline.events)]
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
