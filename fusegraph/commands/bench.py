"""`fusegraph bench`: time a shape on every engine, beside PyTorch, cuDNN and ONNX Runtime.

    fusegraph bench conv -n 32 -c 64 -H 56 -W 56 -k 64 -y 3 -x 3 -p 1 -q 1 -u 1 -v 1 -F 1 -t 1
    fusegraph bench matmul -m 256 -n 512 -k 512 --bias --activation gelu --engine all --compare eager,ort
    fusegraph bench --from-file resnet50_convs.txt --csv out.csv --plot out.png

The flags keep MIOpenDriver's meanings (fusegraph/bench/flags.py; docs/bench.md). Exit
status: 0 when every case ran (and, with ``--verify``, matched the reference); 2 for a
command line that cannot be acted on (a bad flag, a shape that does not build -- in a
``--from-file`` run the line is named and the run goes on); 1 when a case ran and failed.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from fusegraph.commands._checks import check_device, device_problem


def register(sub: Any) -> None:
    from fusegraph.bench import flags

    p = sub.add_parser("bench", help="benchmark driver: time a shape on every engine, beside PyTorch/cuDNN/ONNX Runtime",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.build(p)
    p.set_defaults(fn=_run)


def _options(args: argparse.Namespace) -> Any:
    from fusegraph.bench.runner import Options

    return Options(
        engine=args.engine, compare=tuple(args.compare), tune=bool(args.tune), tune_budget=args.tune_budget,
        verify=bool(args.verify), device=args.device, rounds=args.iter, budget=args.budget, warmup=args.warmup,
        seed=args.seed, dump=args.dump,
    )


def _command_line(tokens: list[str]) -> str:
    import shlex

    return "fusegraph bench " + " ".join(shlex.quote(t) for t in tokens)


def _check_outer(args: argparse.Namespace) -> None:
    from fusegraph.bench.flags import UsageError

    check_device("bench", args.device)
    problem = device_problem(args.device)
    if problem is not None:
        raise UsageError(f"fusegraph bench: --device {args.device}: not usable here ({problem})")
    if args.engine not in ("auto", "all"):
        from fusegraph.engines.registry import active_registry

        known = active_registry().names()
        for name in (n.strip() for n in args.engine.split(",")):
            if name not in known:
                raise UsageError(f"fusegraph bench: --engine {name!r}: unknown engine (known: {', '.join(known)}, auto, all)")


def _run(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from fusegraph.bench import flags, report
    from fusegraph.bench.cases import Case, cases_of
    from fusegraph.bench.runner import CaseResult, run_case
    from fusegraph.errors import ValidationError
    from fusegraph.select.autotune import bar_options

    argv = sys.argv[1:]
    if args.family is None and args.from_file is None:
        raise flags.UsageError("fusegraph bench: name a family (conv, matmul, layernorm, rmsnorm, softmax, sdpa, "
                               "graph FILE.json) or give --from-file FILE; see fusegraph bench --help")
    if args.family is not None and args.from_file is not None:
        raise flags.UsageError("fusegraph bench: --from-file runs the file's lines; give no family beside it")
    _check_outer(args)
    if args.plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise flags.UsageError("fusegraph bench: --plot needs matplotlib (pip install 'fusegraph[bench]')")
    planned: list[tuple[argparse.Namespace, list[Case]]] = []  # each line's options and cases
    usage_errors = 0
    if args.from_file is None:
        tokens = argv[argv.index("bench") + 1:] if "bench" in argv else []
        planned.append((args, cases_of(args, _command_line(tokens))))
    else:
        try:
            with open(args.from_file, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise flags.UsageError(f"fusegraph bench: --from-file {args.from_file!r}: {exc.strerror or exc}") from None
        for lineno, line in enumerate(text.splitlines(), 1):
            where = f"{args.from_file}:{lineno}"
            try:
                words = flags.split_line(line)
                if words is None:
                    continue
                line_args = flags.parse_line(words, args)
                _check_outer(line_args)
                planned.append((line_args, cases_of(line_args, line.strip())))
            except (flags.UsageError, ValidationError, ValueError) as exc:
                msg = str(exc).removeprefix("fusegraph bench: ")
                print(f"fusegraph bench: {where}: error: {msg}", file=sys.stderr)
                usage_errors += 1
        if not planned:
            raise flags.UsageError(f"fusegraph bench: --from-file {args.from_file!r}: no line could be run")
    results: list[CaseResult] = []
    failed = 0
    total = sum(len(c) for _, c in planned)
    bar = tqdm(total=total, desc="bench", unit="case", **bar_options(None))
    try:
        for line_args, cases in planned:
            for case in cases:
                bar.set_postfix_str(case.name[:40])
                res = run_case(case, _options(line_args))
                results.append(res)
                failed += int(res.failed)
                bar.clear()
                print(report.table(res) + "\n", flush=True)
                bar.update(1)
    finally:
        bar.close()
    if args.csv:
        report.write_csv(args.csv, results)
    if args.json:
        report.write_json(args.json, results, ["fusegraph", *argv])
    if args.plot:
        try:
            report.write_plot(args.plot, results)
        except RuntimeError as exc:  # nothing to compare: said, and not a failed run
            print(f"fusegraph bench: --plot: {exc}", file=sys.stderr)
    if usage_errors or failed:
        print(f"fusegraph bench: {len(results) - failed} of {len(results)} cases ran"
              + (f"; {usage_errors} line(s) could not be built" if usage_errors else ""), file=sys.stderr)
    if failed:
        return 1
    return 2 if usage_errors else 0

