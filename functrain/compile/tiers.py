"""Tiered compilation: a run starts on the eager step and builds the inductor step only where it pays.

On a 2-core CPU a cold inductor compile costs 10-70 s, while a whole short eager run takes seconds. So a
:class:`TieredStep` runs its first steps eagerly (the user's errors are eager errors), times them, and at a
step boundary asks a :class:`TierPolicy` whether inductor pays over the steps left::

    saving = remaining steps x eager step time x (1 - 1 / expected speedup)
    cost   = the last compile of this step on this machine (near zero when the caches are warm),
             else a cold prior by device and model size, times how much slower than its CPU time the
             eager step ran on a CPU (a machine busy with other work slows a compile as much as the steps)

It switches only where ``saving > cost``. Given a :class:`~functrain.compile.background.BackgroundBuild`
(where cores are idle), the step starts it at its first boundary: a child process compiles the step into
the shared caches while the run goes on eagerly; a decision that would stay eager waits for it, then weighs
the warm compile's cost instead (:mod:`functrain.compile.background`). The decision is a :class:`TierPlan` (the step it was taken at, the
step from which inductor runs, both estimates): logged in one line, kept in the run's checkpoints by
``fit``, so a resume takes each step on the same tier as the uninterrupted run and stays bitwise. A run
resumed from a checkpoint saved before the decision decides again, on its own measurements.

Example:
    >>> import functrain as ft
    >>> model = torch.nn.Linear(4, 2)
    >>> data = [(torch.randn(4), torch.tensor(i % 2)) for i in range(64)]
    >>> state = ft.TrainState.create(model, ft.optim.sgd(0.1))
    >>> loss = ft.supervised_loss(torch.nn.functional.cross_entropy)
    >>> step = tiered(ft.make_train_step(model, loss))  # what TrainerConfig(compile="auto") builds
    >>> result = ft.fit(state, step, data, batch_size=16, epochs=2, progress_bar=False)
    >>> # decided after a warm-up and 5 timed steps: 2 steps left cannot pay for a compile
    >>> step.plan.decided_at, step.plan.switch_at, step.num_compiles, int(result.state.step)
    (6, None, 0, 8)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from functrain.compile import compile_times
from functrain.compile.background import RUNNING, BackgroundBuild, BuildResult
from functrain.compile.wrappers import device_of
from functrain.step import Step, as_step
from functrain.step.batch import is_short

__all__ = [
    "Policy",
    "SwitchAt",
    "TierEstimates",
    "TierPlan",
    "TierPolicy",
    "TieredStep",
    "cold_compile_seconds",
    "tiered",
]

log = logging.getLogger("functrain.jit")  # the logger jit's users configure

EAGER, INDUCTOR = "eager", "inductor"

# A cold first compile on this kind of device: seconds = base + per_tensor x (parameters + buffers).
# Measured on a 2-core CPU (torch 2.13): an MLP (4 tensors) 17.5 s, a 2-layer GPT (~30 tensors) 40 s
# beyond `import torch`; dynamo's and inductor's own imports included. The CUDA row is a guess (Triton
# compiles kernels in parallel); a recorded compile replaces the prior after the first one.
_COLD_PRIOR: dict[str, tuple[float, float]] = {"cpu": (15.0, 0.8), "cuda": (20.0, 0.5)}
# A follower (the eval step) compiles a forward-only graph: about half the train step's cost.
_FOLLOWER_COST = 0.5


@dataclasses.dataclass(frozen=True)
class TierPlan:
    """What a tiered run decided: ``decided_at``, the step count when the policy decided (``None``: not
    yet); ``switch_at``, the first step run on inductor (``None``: eager to the end); ``cost`` and
    ``saving``, the estimates it weighed (seconds).

    Example:
        >>> plan = TierPlan(decided_at=6, switch_at=6, cost=2.0, saving=30.0)
        >>> plan.tier_at(5), plan.tier_at(6)
        ('eager', 'inductor')
        >>> TierPlan.from_json(plan.to_json()) == plan
        True
    """

    decided_at: int | None = None
    switch_at: int | None = None
    cost: float = 0.0
    saving: float = 0.0

    def tier_at(self, step: int) -> str:
        """The tier that takes the step after ``step`` steps are done."""
        return INDUCTOR if self.switch_at is not None and step >= self.switch_at else EAGER

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TierPlan:
        """The plan :meth:`to_json` wrote; ``""`` (a run that was not tiered): no decision yet."""
        if not text:
            return cls()
        data = json.loads(text)
        if not isinstance(data, dict) or set(data) != {f.name for f in dataclasses.fields(cls)}:
            raise ValueError(f"a checkpoint's tier plan is malformed: {text[:200]!r}")
        return cls(**data)

    def describe(self) -> str:
        """The one log line: ``tier: eager (inductor would cost ~41 s, saves ~0.9 s)``."""
        cost, saving = _seconds(self.cost), _seconds(self.saving)
        if self.switch_at is None:
            return f"tier: eager (inductor would cost ~{cost} s, saves ~{saving} s)"
        return f"tier: inductor from step {self.switch_at} (compiling costs ~{cost} s, saves ~{saving} s)"


def _seconds(x: float) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:.2g}"


@dataclasses.dataclass(frozen=True)
class TierEstimates:
    """What a policy decides on: the steps left in the run, the eager step's measured time (median, s;
    ``nan`` when the policy measures nothing) and the estimated cost of building the inductor step (s)."""

    remaining_steps: int
    eager_step_seconds: float
    compile_seconds: float


class Policy(Protocol):
    """What :class:`TieredStep` asks: how many eager steps to time first, then a plan."""

    measure_steps: int

    def decide(self, step: int, estimates: TierEstimates) -> TierPlan: ...


@dataclasses.dataclass(frozen=True)
class TierPolicy:
    """Switch to inductor at once where it saves more than it costs, else stay eager to the end.

    ``measure_steps``: eager steps timed before deciding (after one warm-up step that is not counted);
    ``speedup``: the inductor step's expected speed over the eager one (measured on 2 CPU cores: 1.16x
    on a BatchNorm CNN, 1.35x on a tiny BERT; the lower end by default).

    Example:
        >>> TierPolicy().decide(6, TierEstimates(10_000, 0.005, 20.0)).switch_at  # saves ~8 s: no
        >>> TierPolicy().decide(6, TierEstimates(100_000, 0.005, 20.0)).switch_at  # saves ~83 s
        6
    """

    measure_steps: int = 5
    speedup: float = 1.2

    def __post_init__(self) -> None:
        if self.measure_steps < 1:
            raise ValueError(f"TierPolicy: measure_steps must be >= 1, got {self.measure_steps}")
        if not self.speedup > 1:
            raise ValueError(
                f"TierPolicy: speedup must be > 1 (inductor faster than eager), got {self.speedup}"
            )

    def decide(self, step: int, estimates: TierEstimates) -> TierPlan:
        saving = estimates.remaining_steps * estimates.eager_step_seconds * (1 - 1 / self.speedup)
        cost = estimates.compile_seconds
        return TierPlan(step, step if saving > cost else None, round(cost, 3), round(saving, 3))


@dataclasses.dataclass(frozen=True)
class SwitchAt:
    """A fixed plan: eager before step ``step``, inductor from it (``None``: eager throughout). It
    measures nothing: deterministic, for tests and for runs that know their answer.

    Example:
        >>> SwitchAt(100).decide(0, TierEstimates(1000, math.nan, 0.0)).tier_at(100)
        'inductor'
    """

    step: int | None
    measure_steps: int = 0

    def decide(self, step: int, estimates: TierEstimates) -> TierPlan:
        return TierPlan(step, self.step, estimates.compile_seconds, 0.0)


def cold_compile_seconds(model: Any, device: torch.device | None) -> float:
    """The prior for a first compile with empty caches: by the device's kind and the model's size.

    Example:
        >>> cold_compile_seconds(torch.nn.Linear(4, 2), torch.device("cpu"))
        16.6
    """
    base, per_tensor = _COLD_PRIOR.get(device.type if device is not None else "cpu", _COLD_PRIOR["cpu"])
    tensors = len(model.state_dict()) if isinstance(model, torch.nn.Module) else 10
    return round(base + per_tensor * tensors, 3)


class TieredStep:
    """A step run eagerly until its policy says the inductor step pays, then compiled (see the module's
    docstring). Call it like the step; ``fit`` drives it at each step boundary (:meth:`at_step`) and keeps
    its :attr:`plan` in the run's checkpoints. A step nothing drives (a predict step, an evaluation before
    any training) stays eager; an eval step given to ``fit`` with a tiered train step follows its tier.

    Attributes:
        plan: the :class:`TierPlan` (``decided_at is None``: not decided yet).
        tier: the tier the next call runs on (``"eager"``/``"inductor"``).
        step: the :class:`functrain.step.Step` it runs.
        eager_seconds: the eager calls timed so far (seconds; the warm-up call excluded);
            ``eager_cpu_seconds``: their CPU time (the process's).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        policy: Policy | None = None,
        build: Callable[[], Callable[..., Any]] | None = None,
        compile_cost: Callable[[Any, tuple, dict], float] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        cpu_clock: Callable[[], float] = time.process_time,
        donate: bool = False,
        seed: bool = True,
        rank: int | None = None,
        rows: int | None = None,
        background: BackgroundBuild | None = None,
        **jit_options: Any,
    ) -> None:
        self.fn = fn
        self.background = background  # started at the first boundary of an undecided run
        self.rows = rows  # a full batch's examples: a shorter batch runs eagerly on the inductor tier too
        self._step = as_step(fn)
        self.__name__ = getattr(self._step.fn, "__name__", "step")
        self.policy: Policy = policy if policy is not None else TierPolicy()
        self.donate = donate
        self._jit_args = dict(donate=donate, seed=seed, rank=rank)
        self._jit_options = jit_options  # for the inductor step: mode, dynamic, cache_dir, ...
        self._build = build if build is not None else self._inductor_step
        self._compile_cost = compile_cost if compile_cost is not None else self._estimated_cost
        self._clock, self._cpu_clock = clock, cpu_clock
        self.plan = TierPlan()
        self.tier = EAGER
        self.eager_seconds: list[float] = []
        self.eager_cpu_seconds: list[float] = []
        self._warmed_up = False
        self._last_call: tuple[Any, tuple, dict] | None = None
        self._eager: Callable[..., Any] | None = None
        self._inductor: Callable[..., Any] | None = None
        self.leader: TieredStep | None = None
        self.followers: list[TieredStep] = []
        # Measured and would stay eager, waiting for the background build: (eager step s, cost s, key).
        self._waiting: tuple[float, float, str | None] | None = None
        self._key: str | None = None

    @property
    def step(self) -> Step:
        """The step this runs (:class:`functrain.step.Step`)."""
        return self._step

    @property
    def num_compiles(self) -> int:
        """Graphs the inductor tier has compiled (0 while eager)."""
        return getattr(self._inductor, "num_compiles", 0)

    @property
    def compiling(self) -> bool:
        """Whether the next call builds the inductor step (it waits for the compiler)."""
        return self.current_tier == INDUCTOR and self.num_compiles == 0

    @property
    def current_tier(self) -> str:
        return self.leader.tier if self.leader is not None else self.tier

    def follow(self, leader: TieredStep) -> None:
        """Run on ``leader``'s tier (the eval step follows the train step: it compiles once the run has
        switched, and the leader's decision counts its compile too)."""
        self.leader = leader
        if self not in leader.followers:
            leader.followers.append(self)

    def compile_from_start(self) -> None:
        """Take the inductor tier from the first step on (a background build's warm-up compiles)."""
        self.restore(TierPlan(decided_at=0, switch_at=0))

    def restore(self, plan: TierPlan) -> None:
        """Take a checkpoint's plan (a resume replays it)."""
        self.plan = plan

    def at_step(self, step: int, total: int) -> str:
        """At the boundary before step ``step + 1`` of a run that ends at ``total``: decide once enough eager
        steps are timed (and log the decision; one that would stay eager waits for a background build
        running), then set and return the tier that takes the next step."""
        measured = len(self.eager_seconds) >= self.policy.measure_steps
        if self._waiting is not None:
            self._after_background(step, total)
        elif (
            self.plan.decided_at is None and measured and (self.policy.measure_steps == 0 or self._last_call)
        ):
            seconds = statistics.median(self.eager_seconds) if self.eager_seconds else math.nan
            cost = self._cost() if self.policy.measure_steps else 0.0
            plan = self.policy.decide(step, TierEstimates(max(total - step, 0), seconds, cost))
            if plan.switch_at is None and self._building():
                self._waiting = (seconds, cost, self._key)  # decided once the caches are warm
            else:
                self._take(plan)
        if self.plan.decided_at is None and self.background is not None and not self.background.started:
            self.background.start()
            log.info("%s: building the inductor step in the background (pid %s)", self.__name__,
                     self.background.pid)  # fmt: skip
        self.tier = self.plan.tier_at(step)
        return self.tier

    def _building(self) -> bool:
        """Whether a background build runs (not under torchrun: every rank decides at the same step)."""
        from functrain.distributed.env import is_distributed

        return self.background is not None and self.background.poll() == RUNNING and not is_distributed()

    def _take(self, plan: TierPlan, note: str = "") -> None:
        self.plan = _rank_zero_plan(plan)
        log.info("%s: %s%s", self.__name__, note, self.plan.describe())
        self.close()

    def _after_background(self, step: int, total: int) -> None:
        """Waiting for the background build: decide once it is done (with the warm cost if it built this
        step), or on the last step (eager: it can no longer pay)."""
        assert self._waiting is not None and self.background is not None
        result = self.background.poll()
        if result == RUNNING and step < total - 1:
            return
        seconds, cost, key = self._waiting
        self._waiting = None
        note = ""
        if isinstance(result, BuildResult) and result.key == key:
            cost = result.warm_seconds  # timed in the child beside this run: its load included
            note = f"caches warmed in the background in {result.cold_seconds:.0f} s; "
        elif isinstance(result, BuildResult):
            note = "the background build compiled another step (its recipe differs); "
        elif result != RUNNING:
            note = f"the background build failed ({self.background.failure}); "
        self._take(self.policy.decide(step, TierEstimates(max(total - step, 0), seconds, cost)), note)

    def close(self) -> None:
        """Stop the background build, if any (the run decided, ended or was interrupted)."""
        if self.background is not None:
            self.background.stop()

    def __call__(self, state: Any, *args: Any, **kwargs: Any) -> Any:
        if self.current_tier == INDUCTOR and not (args and is_short(args[0], self.rows)):
            if self._inductor is None:
                self._inductor = self._build()
            return self._inductor(state, *args, **kwargs)
        if self._eager is None:
            from functrain.jit import jit

            self._eager = jit(self.fn, compile=False, **self._jit_args)
        if len(self.eager_seconds) >= self.policy.measure_steps or self.leader is not None:
            return self._eager(state, *args, **kwargs)  # timed enough: nothing but the step
        self._last_call = (state, args, kwargs)
        started, cpu = self._clock(), self._cpu_clock()
        out = self._eager(state, *args, **kwargs)
        device = device_of(state)
        if device is not None and device.type == "cuda":  # the step's own time, not its launch
            torch.cuda.synchronize(device)
        if self._warmed_up:
            self.eager_seconds.append(self._clock() - started)
            self.eager_cpu_seconds.append(self._cpu_clock() - cpu)
        self._warmed_up = True
        return out

    def _cost(self) -> float:
        """The inductor tiers' build cost: this step's, plus its followers' (forward-only graphs)."""
        assert self._last_call is not None
        state, args, kwargs = self._last_call
        self._last_call = None  # not kept alive: a donated state's tensors are the next state's
        try:
            self._key = self.compile_key(state, args, kwargs)
        except Exception as e:  # only the record is lost: the prior stands in
            log.debug("%s: no compile key (%s: %s)", self.__name__, type(e).__name__, e)
            self._key = None
        own = self._compile_cost(state, args, kwargs)
        return own * (1 + _FOLLOWER_COST * len(self.followers))

    def compile_key(self, state: Any, args: tuple, kwargs: dict) -> str:
        """The key jit records this step's compile under (:func:`functrain.compile.compile_times.compile_key`)
        for a call ``self(state, *args, **kwargs)``."""
        options = {k: self._jit_options.get(k, d) for k, d in _COMPILE_OPTIONS.items()}
        return compile_times.compile_key(self.__name__, self._step.model, (state, args, kwargs), options)

    def _estimated_cost(self, state: Any, args: tuple, kwargs: dict) -> float:
        """The last compile of this step on this machine where functrain's cache dir records it (near zero
        after a warm start), else :func:`cold_compile_seconds`."""
        try:
            key = self._key if self._key is not None else self.compile_key(state, args, kwargs)
            recorded = compile_times.estimate(key)
        except Exception as e:  # only the record is lost: the prior stands in
            log.debug("%s: no recorded compile time (%s: %s)", self.__name__, type(e).__name__, e)
            recorded = None
        if recorded is not None:
            return recorded
        device = device_of(state)
        # Steps on an accelerator leave the host idle while they run: their wall/CPU time says nothing of load.
        busy = self.slowdown if device is None or device.type == "cpu" else 1.0
        return cold_compile_seconds(self._step.model, device) * busy

    @property
    def slowdown(self) -> float:
        """How much longer than their CPU time the timed eager steps took (at least 1): on a machine busy
        with other work (measured here: 8x), a compile, CPU-bound too, takes that much longer than the
        prior (measured on an idle machine) says."""
        wall, cpu = sum(self.eager_seconds), sum(self.eager_cpu_seconds)
        return max(1.0, wall / cpu) if cpu > 0 else 1.0

    def _inductor_step(self) -> Callable[..., Any]:
        from functrain.jit import jit

        return jit(self.fn, compile=True, **self._jit_args, **self._jit_options)

    def __repr__(self) -> str:
        return f"TieredStep({self.__name__}, tier={self.current_tier}, plan={self.plan})"


def _rank_zero_plan(plan: TierPlan) -> TierPlan:
    """Under torchrun, rank 0's plan on every rank: each measured its own steps, and replicas whose steps
    ran on different tiers would drift apart by rounding. Every rank decides at the same step (after the
    same number of calls), so every rank is here together."""
    from functrain.distributed.env import is_distributed

    if not is_distributed():
        return plan
    from functrain.distributed.replicate import replicate

    switch = -1 if plan.switch_at is None else plan.switch_at
    agreed = replicate(torch.tensor([plan.decided_at, switch, plan.cost, plan.saving], dtype=torch.float64))
    decided, switch_at, cost, saving = agreed.tolist()
    return TierPlan(int(decided), None if switch_at < 0 else int(switch_at), cost, saving)


# jit's options that key a compile record (functrain.jit.CompiledStep._options), with jit's defaults.
_COMPILE_OPTIONS: dict[str, Any] = {"fullgraph": True, "dynamic": False, "mode": None, "options": None}


def tiered(
    fn: Callable[..., Any],
    *,
    policy: Policy | None = None,
    donate: bool = False,
    seed: bool = True,
    rank: int | None = None,
    rows: int | None = None,
    background: BackgroundBuild | None = None,
    **jit_options: Any,
) -> TieredStep:
    """``fn`` as a :class:`TieredStep`: eager first, :func:`functrain.jit`'s inductor step where it pays.

    ``jit_options`` (``mode``, ``dynamic``, ``options``, ``cache_dir``, ``max_compiles``...) go to the
    inductor step's :func:`functrain.jit`; ``donate``, ``seed`` and ``rank`` to both tiers. ``rows`` (a
    full batch's examples): on the inductor tier a shorter batch (a set's last) runs on the eager step,
    exactly and without a second compile (:mod:`functrain.trainer.short_batch` says why). ``background``:
    a :class:`~functrain.compile.background.BackgroundBuild` that warms the caches beside the run.

    Example:
        >>> import functrain as ft
        >>> model = torch.nn.Linear(4, 2)
        >>> data = [(torch.randn(4), torch.tensor(i % 2)) for i in range(64)]
        >>> state = ft.TrainState.create(model, ft.optim.sgd(0.1))
        >>> loss = ft.supervised_loss(torch.nn.functional.cross_entropy)
        >>> step = tiered(ft.make_train_step(model, loss), policy=SwitchAt(None))  # eager throughout
        >>> int(ft.fit(state, step, data, batch_size=16, epochs=1, progress_bar=False).state.step)
        4
        >>> step.plan, step.num_compiles
        (TierPlan(decided_at=0, switch_at=None, cost=0.0, saving=0.0), 0)
    """
    return TieredStep(
        fn,
        policy=policy,
        donate=donate,
        seed=seed,
        rank=rank,
        rows=rows,
        background=background,
        **jit_options,
    )


def tiered_steps(steps: Sequence[Any]) -> list[TieredStep]:
    """The tiered ones among ``steps``."""
    return [s for s in steps if isinstance(s, TieredStep)]
