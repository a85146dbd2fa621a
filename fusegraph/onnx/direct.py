"""A session's whole model on one ONNX Runtime session, by the floor's verdict or while the
verdict is measured in the background (``background.py``), and the switch to fusegraph's
plan when the background finds that plan faster."""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import onnxruntime as ort

from fusegraph.onnx import background, floor
from fusegraph.onnx.report import PartitionReport, SubgraphEntry

if TYPE_CHECKING:
    from fusegraph.onnx.plan import SessionPlan
    from fusegraph.onnx.session import InferenceSession

log = logging.getLogger("fusegraph.onnx")

POLL_S = 0.5  # run() looks at the background child at most this often (a poll costs ~2 us)


class DirectOrt:
    def __init__(self, session: ort.InferenceSession, verdict: floor.Verdict | None,
                 evaluation: background.Evaluation | None) -> None:
        self.session = session
        self.verdict = verdict
        self.evaluation = evaluation
        self._next_poll = 0.0
        self._builder: threading.Thread | None = None
        self._built: SessionPlan | None = None
        self._build_error: str = ""
        self._explained: SessionPlan | None = None

    def run(self, wanted: list[str], feed: dict[str, Any], run_options: Any) -> list[Any]:
        return self.session.run(wanted, feed, run_options)  # type: ignore[no-any-return]

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
        if verdict.keep:  # fusegraph's plan won: build it from the caches, off the caller's thread
            self._builder = threading.Thread(target=self._build, args=(sess,), name="fusegraph-plan", daemon=True)
            self._builder.start()

    def _build(self, sess: InferenceSession) -> None:
        try:
            self._built = sess._new_plan(_static_shapes(sess))
        except Exception as exc:  # the session stays on ONNX Runtime, and says why
            log.warning("fusegraph's plan for %s could not be built after its evaluation: %s", sess._model_name, exc)
            self._build_error = f"{type(exc).__name__}: {exc}"

    def _take_plan(self, sess: InferenceSession) -> None:
        self._builder = None
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
        if self._explained is None:  # the partition and every node's reason, nothing built
            verdict = self.verdict or floor.Verdict(False, source="not measured", why="no verdict")
            if self._build_error:
                verdict = floor.with_note(verdict, f"its plan failed to build: {self._build_error}")
            self._explained = sess._new_plan(_static_shapes(sess), direct=(self.session, verdict))
        return self._explained.report()

    def _pending_report(self, sess: InferenceSession) -> PartitionReport:
        model = sess._model
        nodes = tuple(n.name or f"{n.op_type}_{k}" for k, n in enumerate(model.graph.node))
        ops = dict(collections.Counter(n.op_type for n in model.graph.node))
        what = self.evaluation.describe() if self.evaluation is not None else "fusegraph's plan is being built"
        entry = SubgraphEntry("onnxruntime_0", "onnxruntime", "onnxruntime", nodes, ops,
                              note="the whole model, until the evaluation decides")
        return PartitionReport(
            model=sess._model_name, total_nodes=len(nodes), folded_nodes=0, subgraphs=(entry,), unclaimed=(),
            input_shapes=_static_shapes(sess),
            floor=f"floor: whole model on ONNX Runtime while {what}",
        )


def _static_shapes(sess: InferenceSession) -> dict[str, tuple[int, ...]]:
    return {k: tuple(int(d) for d in v) for k, v in sess._signature.items() if v is not None}  # type: ignore[arg-type]
