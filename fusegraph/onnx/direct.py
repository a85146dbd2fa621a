"""A session's whole model on one runner -- the caller's ONNX Runtime session, or another
whole-model runner the floor found faster (OpenVINO's CPU plugin, ONNX Runtime without
spinning: ``floor.RUNNERS``) -- by the floor's verdict or while the verdict is measured in
the background (``background.py``), and the switch to fusegraph's plan or to the winning
runner when the background evaluation finds one faster."""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnxruntime as ort

from fusegraph.onnx import background, floor
from fusegraph.onnx.report import PartitionReport, SubgraphEntry
from fusegraph.runtime.cache_dir import cache_enabled, cache_root

if TYPE_CHECKING:
    from fusegraph.onnx.plan import SessionPlan
    from fusegraph.onnx.session import InferenceSession

log = logging.getLogger("fusegraph.onnx")

POLL_S = 0.5  # run() looks at the background child at most this often (a poll costs ~2 us)


class OrtRunner:
    """The whole model on one ONNX Runtime session (``name``: "onnxruntime" for the
    caller's, a ``floor.RUNNERS`` name for another configuration)."""

    def __init__(self, session: ort.InferenceSession, name: str = "onnxruntime") -> None:
        self.session = session
        self.name = name

    def run(self, wanted: Sequence[str] | None, feed: Mapping[str, Any], run_options: Any = None) -> list[Any]:
        return self.session.run(wanted, feed, run_options)  # type: ignore[arg-type,no-any-return]


def make_runner(name: str, model: str | bytes, shapes: Mapping[str, Sequence[int]], sess_options: Any,
                providers: list[Any], cache_dir: str | None) -> floor.Runner:
    """The whole model on runner ``name`` (a ``floor.RUNNERS`` name). OpenVINO gets the
    caller's thread count (``intra_op_num_threads``) and keeps its compiled models under
    the cache directory (a warm session loads instead of compiling)."""
    if name == "openvino":
        from fusegraph.onnx import openvino_runner

        threads = int(getattr(sess_options, "intra_op_num_threads", 0) or 0)
        ov_cache = (Path(cache_dir) if cache_dir else cache_root()) / openvino_runner.CACHE_SUBDIR
        return openvino_runner.OpenVinoRunner(model, shapes, threads=threads,
                                              cache_dir=ov_cache if cache_enabled() else None)
    if name == "ort-nospin":
        so = ort.SessionOptions()
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return OrtRunner(ort.InferenceSession(model, sess_options=so, providers=providers), name)
    raise ValueError(f"unknown whole-model runner {name!r} (known: {sorted(floor.RUNNERS)})")


def allowed(name: str, sess_options: Any) -> bool:
    """Whether runner ``name`` may run a session with the caller's ``sess_options``: another
    ONNX Runtime configuration only where the caller gave none (a verdict recorded by the
    background child, which never sees them, must not override the caller's choice)."""
    return not (name.startswith("ort-") and sess_options is not None)


def as_allowed(verdict: floor.Verdict, sess_options: Any, load: str = "") -> floor.Verdict:
    """``verdict`` without its runner where the caller's ``sess_options`` rule that runner out
    (``allowed``), or where it won in another load class than the machine's now (``load``;
    which ONNX Runtime configuration wins depends on it: docs/models.md), saying why. The
    model is not measured again in the other class: the caller's session runs it there."""
    if not verdict.runner:
        return verdict
    label = floor.RUNNERS[verdict.runner]
    if not allowed(verdict.runner, sess_options):
        return dataclasses.replace(verdict, runner="", why=f"{label} won, but the caller's session options stand")
    if load and verdict.load and load != verdict.load:
        return dataclasses.replace(verdict, runner="", why=f"{label} won on a {verdict.load} machine; on a {load} "
                                   "one the caller's session runs the model")
    return verdict


def runner_label(runner: Any) -> str:
    name = getattr(runner, "name", "onnxruntime")
    return str(floor.RUNNERS.get(name, "ONNX Runtime"))


class DirectOrt:
    """The whole model on one runner (``OrtRunner`` or another ``floor.Runner``); ``verdict``
    is the whole-model verdict that put it there, ``evaluation`` the background child."""

    def __init__(self, runner: floor.Runner, verdict: floor.Verdict | None,
                 evaluation: background.Evaluation | None) -> None:
        self.runner = runner
        self.verdict = verdict
        self.evaluation = evaluation
        self._next_poll = 0.0
        self._builder: threading.Thread | None = None
        self._built: SessionPlan | None = None
        self._built_runner: floor.Runner | None = None
        self._build_error: str = ""
        self._explained: SessionPlan | None = None

    @property
    def session(self) -> ort.InferenceSession | None:
        """The ONNX Runtime session running the whole model (None: another runner does)."""
        return self.runner.session if isinstance(self.runner, OrtRunner) else None

    def run(self, wanted: list[str], feed: dict[str, Any], run_options: Any) -> list[Any]:
        evaluation = self.evaluation
        gate = evaluation.gate if evaluation is not None else None
        if gate is None:
            return self.runner.run(wanted, feed, run_options)
        gate.enter()  # the child waits while the caller's inference runs
        try:
            return self.runner.run(wanted, feed, run_options)
        finally:
            gate.leave()

    @property
    def pending(self) -> bool:
        return self.evaluation is not None or self._builder is not None

    # ---- the switch ------------------------------------------------------------------------
    def poll(self, sess: InferenceSession) -> None:
        """Called by ``run``: takes in a finished evaluation or a built plan, never waits."""
        if self._builder is not None:
            if not self._builder.is_alive():
                self._take_plan(sess)
            return
        if self.evaluation is None:
            return
        now = time.monotonic()
        if now < self._next_poll:
            return
        self._next_poll = now + POLL_S
        if self.evaluation.done():
            self._evaluated(sess)

    def wait(self, sess: InferenceSession, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        if self.evaluation is not None:
            if not self.evaluation.wait(left()):
                return False
            self._evaluated(sess)
        if self._builder is not None:
            self._builder.join(left())
            if self._builder.is_alive():
                return False
            self._take_plan(sess)
        return True

    def _evaluated(self, sess: InferenceSession) -> None:
        assert self.evaluation is not None
        verdict = self.evaluation.verdict()
        if verdict is None:
            verdict = floor.Verdict(False, source="not measured",
                                    why=f"the background evaluation left no verdict (log: {self.evaluation.log_path})")
        self.evaluation = None
        self.verdict = verdict
        log.info("background evaluation of %s: %s", sess._model_name, verdict.describe())
        verdict = self.verdict = as_allowed(verdict, sess._sess_options, sess._opts.load)
        if verdict.keep or verdict.runner:  # build the winner off the caller's thread
            self._builder = threading.Thread(target=self._build, args=(sess, verdict), name="fusegraph-plan", daemon=True)
            self._builder.start()

    def _build(self, sess: InferenceSession, verdict: floor.Verdict) -> None:
        try:
            if verdict.runner:
                self._built_runner = sess._make_runner(verdict.runner)
            else:
                self._built = sess._new_plan(_static_shapes(sess))
        except Exception as exc:  # the session stays on ONNX Runtime, and says why
            what = floor.RUNNERS.get(verdict.runner, "fusegraph's plan")
            log.warning("%s for %s could not be built after its evaluation: %s", what, sess._model_name, exc)
            self._build_error = f"{type(exc).__name__}: {exc}"

    def _take_plan(self, sess: InferenceSession) -> None:
        self._builder = None
        if self._built_runner is not None:
            self.runner, self._built_runner = self._built_runner, None
            self._explained = None
            log.info("%s now runs on %s", sess._model_name, runner_label(self.runner))
            return
        plan, self._built = self._built, None
        if plan is None:
            return
        shapes = _static_shapes(sess)
        sess._plans[tuple(sorted(shapes.items()))] = plan
        sess._last = plan
        sess._direct = None  # later runs use the plan
        log.info("%s now runs on fusegraph's plan: %s", sess._model_name, plan.report().summary())

    # ---- the report ------------------------------------------------------------------------
    def report(self, sess: InferenceSession) -> PartitionReport:
        if self.pending:
            return self._pending_report(sess)
        verdict = self.verdict or floor.Verdict(False, source="not measured", why="no verdict")
        if self._build_error:
            what = floor.RUNNERS.get(verdict.runner, "its plan")
            verdict = floor.with_note(verdict, f"{what} failed to build: {self._build_error}")
        session = self.session
        if session is None or getattr(self.runner, "name", "") != "onnxruntime":  # another runner: one unit of it
            return self._runner_report(sess, verdict)
        if self._explained is None:  # the partition and every node's reason, nothing built
            self._explained = sess._new_plan(_static_shapes(sess), direct=(session, verdict))
        return dataclasses.replace(self._explained.report(), runners=verdict.candidates)

    def _runner_report(self, sess: InferenceSession, verdict: floor.Verdict) -> PartitionReport:
        model = sess._model
        nodes = tuple(n.name or f"{n.op_type}_{k}" for k, n in enumerate(model.graph.node))
        ops = dict(collections.Counter(n.op_type for n in model.graph.node))
        name = getattr(self.runner, "name", "runner")
        entry = SubgraphEntry(f"{name}_0", name, runner_label(self.runner), nodes, ops, note="the whole model",
                              fusegraph_ms=verdict.fusegraph_ms, ort_ms=verdict.ort_ms)
        return PartitionReport(
            model=sess._model_name, total_nodes=len(nodes), folded_nodes=0, subgraphs=(entry,), unclaimed=(),
            input_shapes=_static_shapes(sess), floor=f"whole model {verdict.describe()}", runners=verdict.candidates,
        )

    def _pending_report(self, sess: InferenceSession) -> PartitionReport:
        model = sess._model
        nodes = tuple(n.name or f"{n.op_type}_{k}" for k, n in enumerate(model.graph.node))
        ops = dict(collections.Counter(n.op_type for n in model.graph.node))
        if self.evaluation is not None:
            what = self.evaluation.describe()
        elif self.verdict is not None and self.verdict.runner:
            what = f"{floor.RUNNERS[self.verdict.runner]} is being built"
        else:
            what = "fusegraph's plan is being built"
        entry = SubgraphEntry("onnxruntime_0", "onnxruntime", "onnxruntime", nodes, ops,
                              note="the whole model, until the evaluation decides")
        return PartitionReport(
            model=sess._model_name, total_nodes=len(nodes), folded_nodes=0, subgraphs=(entry,), unclaimed=(),
            input_shapes=_static_shapes(sess),
            floor=f"floor: whole model on ONNX Runtime while {what}",
        )


# ---- models with dynamic dimensions ------------------------------------------------------------
ShapeKey = tuple[tuple[str, tuple[int, ...]], ...]


def shape_key(feed: Mapping[str, Any]) -> ShapeKey:
    return tuple(sorted((k, tuple(int(d) for d in v.shape)) for k, v in feed.items() if hasattr(v, "shape")))


class ShapedOrt(DirectOrt):
    """A model with dynamic dimensions on ONNX Runtime, every set of input shapes at once.

    The floor decides per set of shapes (a plan is specialized to them). A new set never
    waits for it: it runs on ONNX Runtime, and a helper thread looks its verdict up (under
    the model's identity at those shapes, ``background.at_shapes``) and, where there is
    none, starts the background child for it -- one child at a time per session, the
    other new sets queued. Where fusegraph's plan won at a set, the plan is built in that
    thread and later runs at that set use it; every other set stays on ONNX Runtime."""

    def __init__(self, runner: floor.Runner, verdict: floor.Verdict | None, source: background.Source,
                 cache: floor.VerdictCache, sess: InferenceSession) -> None:
        super().__init__(runner, verdict, None)
        self._source = source
        self._cache = cache
        # weak: the session holds this runner, and a strong reference back would keep a
        # dropped session (its model, its plans) until the collector's next full pass
        self._session = weakref.ref(sess)
        self._lock = threading.Lock()
        self._seen: set[ShapeKey] = set()
        self._queue: collections.deque[ShapeKey] = collections.deque()
        self._evaluating: ShapeKey | None = None
        self._worker: threading.Thread | None = None
        self.shape_verdicts: dict[ShapeKey, floor.Verdict] = {}
        self.plans: dict[ShapeKey, SessionPlan] = {}
        self.last: ShapeKey = ()

    @property
    def pending(self) -> bool:
        with self._lock:
            return bool(self._queue) or self.evaluation is not None or (
                self._worker is not None and self._worker.is_alive())

    def run(self, wanted: list[str], feed: dict[str, Any], run_options: Any) -> list[Any]:
        key = shape_key(feed)
        self.last = key
        plan = self.plans.get(key)
        if plan is not None:
            return plan.run(feed, wanted)
        try:
            return super().run(wanted, feed, run_options)
        finally:  # after the run: the helper thread's start must not share the CPU with it
            if key not in self._seen:
                with self._lock:
                    self._seen.add(key)
                    self._queue.append(key)
                self._pump()

    def poll(self, sess: InferenceSession) -> None:
        """Takes in a finished child's verdict (at most every POLL_S), never waits."""
        evaluation = self.evaluation
        if evaluation is None:
            return
        now = time.monotonic()
        if now < self._next_poll:
            return
        self._next_poll = now + POLL_S
        if evaluation.done():
            self._pump()

    def wait(self, sess: InferenceSession, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.pending:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            worker, evaluation = self._worker, self.evaluation
            if worker is not None and worker.is_alive():
                worker.join(0.05 if left is None else min(left, 0.05))
            elif evaluation is not None:
                evaluation.wait(0.05 if left is None else min(left, 0.05))
                self._pump()
            else:
                self._pump()
        return True

    def _pump(self) -> None:
        """Starts the helper thread unless it is at work or a child is (never blocks)."""
        with self._lock:
            if self._worker is not None and self._worker.is_alive():
                return
            if self.evaluation is not None and not self.evaluation.done():
                return
            if self.evaluation is None and not self._queue:
                return
            self._worker = threading.Thread(target=self._work, name="fusegraph-shapes", daemon=True)
            self._worker.start()

    def _work(self) -> None:
        """Off the caller's thread: the finished child's verdict taken in, then the queued
        sets' verdicts looked up (plans built where fusegraph won) until one needs a child.
        A session dropped meanwhile ends it: nothing is left to run the verdicts."""
        sess = self._session()
        if sess is None:
            return
        if self.evaluation is not None:
            key, done = self._evaluating, self.evaluation
            verdict = done.verdict() or floor.Verdict(
                False, source="not measured", why=f"the background evaluation left no verdict (log: {done.log_path})")
            log.info("background evaluation of %s at %s: %s", sess._model_name, _shapes_text(key or ()),
                     verdict.describe())
            with self._lock:
                self.evaluation, self._evaluating = None, None
            if key is not None:
                self._decided(sess, key, verdict)
        while True:
            with self._lock:
                if not self._queue:
                    return
                key = self._queue.popleft()
            at = background.at_shapes(self._source, dict(key))
            known = floor.VerdictCache(str(self._cache.path.parent), self._cache.settings).lookup(at.content)
            if known is not None:
                self._decided(sess, key, known)
                continue
            started = background.launch(at, sess._opts, self._cache, dict(key))
            if started is None:  # cannot be measured (no cache directory): ONNX Runtime there
                self._decided(sess, key, floor.Verdict(False, source="not measured", why="not evaluated"))
                continue
            with self._lock:
                self.evaluation, self._evaluating = started, key
            return

    def _decided(self, sess: InferenceSession, key: ShapeKey, verdict: floor.Verdict) -> None:
        self.shape_verdicts[key] = verdict
        if not verdict.keep:
            return
        try:
            self.plans[key] = sess._new_plan(dict(key))
        except Exception as exc:  # that shape stays on ONNX Runtime, and says why
            log.warning("fusegraph's plan for %s at %s could not be built after its evaluation: %s",
                        sess._model_name, _shapes_text(key), exc)
            self.shape_verdicts[key] = floor.with_note(verdict, f"its plan failed to build: {type(exc).__name__}: {exc}")

    def report(self, sess: InferenceSession) -> PartitionReport:
        plan = self.plans.get(self.last)
        if plan is not None:
            return plan.report()
        model = sess._model
        nodes = tuple(n.name or f"{n.op_type}_{k}" for k, n in enumerate(model.graph.node))
        ops = dict(collections.Counter(n.op_type for n in model.graph.node))
        states = []
        for key in sorted(self._seen):
            v = self.shape_verdicts.get(key)
            if v is not None:
                states.append(f"{_shapes_text(key)}: {v.describe()}")
            elif key == self._evaluating and self.evaluation is not None:
                states.append(f"{_shapes_text(key)}: {self.evaluation.describe()}")
            else:
                states.append(f"{_shapes_text(key)}: waiting for its evaluation")
        entry = SubgraphEntry("onnxruntime_0", "onnxruntime", "onnxruntime", nodes, ops,
                              note="the whole model, at every input shape until its evaluation decides")
        return PartitionReport(
            model=sess._model_name, total_nodes=len(nodes), folded_nodes=0, subgraphs=(entry,), unclaimed=(),
            input_shapes=dict(self.last),
            floor="floor: whole model on ONNX Runtime, each new input shape evaluated in the background"
                  + (f" -- {' | '.join(states)}" if states else ""),
        )


def _shapes_text(key: ShapeKey) -> str:
    return ", ".join(f"{k} {list(v)}" for k, v in key) or "no inputs"


# ---- the choice at session creation (floor_mode=inline, and the background child) --------------
def choose_whole_runner(sess: InferenceSession, plan: SessionPlan) -> tuple[DirectOrt | None, floor.Verdict | None]:
    """Times the whole model on each candidate runner (the ``runners`` option) against what
    the plan decided -- fusegraph's plan, or the caller's ONNX Runtime session where the
    floor gave the whole model back -- and returns (the winner to run the model, or None;
    the verdict with every candidate's line, or None where nothing was measured). Cached
    like the floor's verdicts, under the plan's whole-model key."""
    opts = sess._opts
    names = [n for n in opts.runner_candidates() if allowed(n, sess._sess_options)]
    if not names or plan.floor_budget <= 0 or opts.lazy_compile or opts.device != "cpu":
        return None, None
    cache = plan._verdict_cache()
    content = _runners_key(sess, plan)
    known = cache.lookup(content)
    runner: floor.Runner | None = None
    if known is None:
        measured = _measure_runners(sess, plan, names)
        if measured is None:
            return None, None
        runner, known = measured
        known = dataclasses.replace(known, load=cache.load)
        cache.record(content, known)
        cache.flush()
    known = as_allowed(known, sess._sess_options, opts.load)
    if not known.runner:
        return None, known
    try:
        runner = runner or sess._make_runner(known.runner)
    except Exception as exc:  # the plan stands
        log.warning("%s won the floor for %s but did not start: %s", floor.RUNNERS[known.runner], sess._model_name, exc)
        return None, floor.with_note(dataclasses.replace(known, runner=""), f"{floor.RUNNERS[known.runner]} did not start: {exc}")
    log.info("%s runs on %s: %s", sess._model_name, runner_label(runner), known.describe())
    return DirectOrt(runner, known, None), known


def _runners_key(sess: InferenceSession, plan: SessionPlan) -> str:
    """The model (its file's identity or its bytes' hash, as the background evaluation keys
    it), its input shapes and the partition the incumbent ran: the plan's own whole-model key
    changes once the plan hands the whole model back (the weights leave its graph)."""
    source = background.source_of(sess._source_arg)
    shape = ",".join(f"{'f' if g.claimed else 'o'}{len(g.nodes)}" for g in plan.partitioning.groups)
    model = source.content if source is not None else plan._whole_key()
    return f"runners|{model}|{sorted(plan.input_shapes.items())}|{shape}"


def _measure_runners(sess: InferenceSession, plan: SessionPlan,
                     names: Sequence[str]) -> tuple[floor.Runner | None, floor.Verdict] | None:
    og = plan.og
    ins = [i for i in og.inputs if i not in og.constants]
    try:
        feed = floor.sample_inputs(og, ins)
    except KeyError as exc:
        log.info("floor: whole-model runners not measured: the type of input %s is unknown", exc)
        return None
    wanted = list(sess._output_names)
    try:
        want = plan.run(feed, wanted)
        if plan.whole_on_ort:
            reference, against = want, "ONNX Runtime"
        else:  # fusegraph's plan agrees with ONNX Runtime within the floor's 1e-3; runners must within 1e-4
            reference = ort.InferenceSession(sess._runner_model(), sess_options=sess._sess_options,
                                             providers=sess._ort_providers).run(wanted, feed)
            against = "fusegraph's plan"
    except Exception as exc:
        log.info("floor: whole-model runners not measured: %s", exc)
        return None
    budget = min(floor.WHOLE_S, plan.floor_budget * (1 - floor.UNITS_SHARE))
    candidates = {n: partial(sess._make_runner, n) for n in names}
    runner, verdict = floor.choose_runner(lambda: plan.run(feed, wanted), against, candidates, feed, wanted,
                                          reference, budget)
    log.info("floor: whole-model runners for %s: %s", sess._model_name, "; ".join(verdict.candidates))
    return runner, verdict


def _static_shapes(sess: InferenceSession) -> dict[str, tuple[int, ...]]:
    return {k: tuple(int(d) for d in v) for k, v in sess._signature.items() if v is not None}  # type: ignore[arg-type]
